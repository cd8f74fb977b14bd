"""The parts a training job is built from: the task (model and loss), the optimizer, the typed state, the pure step and
how it runs over the mesh, the checks before device work, checkpoints."""
