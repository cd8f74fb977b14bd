"""Runs that look after themselves: restarts, the hang watch, stragglers and the record of every attempt.

Two halves, each imported by one side only:
- `supervisor`: the parent launch.py becomes (no jax imported there). It starts the
  training process as a child, forwards signals to it, reads how it ended, writes
  WORKDIR/attempts.jsonl and starts it again when the failure is worth retrying.
- `attempt`, `hang`, `stragglers`, `faults`: the child's side, used by trainer/run/loop.py:
  what it tells its supervisor (resumed step, last step, how it stopped), the
  watch that ends a run with no finished step for too long, the per-process step
  times process 0 compares, and the test hooks that inject the faults the tests prove.
"""
