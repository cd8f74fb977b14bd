"""The training side of the launcher: state, step, loop, data, checkpoints, metrics, models."""
