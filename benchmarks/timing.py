"""Shared by the step-time benchmarks: a compiled step ready to time, and medians taken in alternating rounds.

Ratios are what the benchmarks report (absolute CPU times drift with the machine's load), so every runner of one
comparison lives in one process and the runners take turns each round.
"""

import statistics
import time

import jax
import numpy as np

from trainer.run import job as job_lib


def runner(config) -> list:
  """`[compiled step, state, batch]` for `config`: its Job's step compiled, its state at seed 0, a random batch of
  token ids placed as the run places them. A list: `alternating_medians` carries the state forward in it."""
  job = job_lib.build_job(config)
  compiled = job.compile_train_step()
  state = job.init_state(0)
  rng = np.random.default_rng(0)
  batch = {k: jax.device_put(rng.integers(0, 256, job.abstract_batch[k].shape, dtype=np.int32), job.batch_shardings[k])
           for k in ('inputs', 'targets')}
  return [compiled, state, batch]


def alternating_medians(runners: dict, steps: int, rounds: int) -> dict:
  """Median seconds per step of each `[compiled, state, batch]` runner, the runners taking turns each round so
  that drift in the machine's load hits all alike; two warm-up steps per round are not timed."""
  times = {name: [] for name in runners}
  for _ in range(rounds):
    for name, runner_ in runners.items():
      compiled, state, batch = runner_
      for i in range(steps + 2):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        if i >= 2:
          times[name].append(time.perf_counter() - start)
      runner_[1] = state
  return {name: statistics.median(t) for name, t in times.items()}
