"""How long an over-budget launch takes to be refused, against a plain compile of the same step (issue 14).

  python benchmarks/bench_preflight.py [--config=configs/tiny.py] [--rounds=3] [--memory_gb=0.001]

In one process, alternating rounds, on one CPU device (float32): a fresh Job's
`compile_train_step()`; the pre-flight check up to its verdict (the compile plus
the memory analysis and the limit); and the whole refusal, which also compiles
each candidate fix (trainer/run/plan.py) before it raises. Medians in seconds.
"""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import argparse  # noqa: E402
import importlib  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from trainer.base.errors import UserError  # noqa: E402
from trainer.memory import footprint  # noqa: E402
from trainer.run import job as job_lib  # noqa: E402
from trainer.run import preflight


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--config', default='configs/tiny.py')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--memory_gb', type=float, default=0.001)
  args = parser.parse_args()
  config = importlib.import_module(args.config.removesuffix('.py').replace('/', '.')).get_config()
  config.train.compute_dtype, config.train.device_memory_gb = 'float32', args.memory_gb
  devices = jax.devices()[:1]
  times = {'compile': [], 'verdict': [], 'refusal': []}

  def verdict():
    job = job_lib.build_job(config, devices)
    limit = footprint.device_limit(config.train.device_memory_gb, devices)
    footprint.verdict(footprint.compiled_bytes(job.compile_train_step()), limit)

  def refusal():
    try:
      preflight.compile_checked(job_lib.build_job(config, devices))
    except UserError as e:
      times.setdefault('message', str(e))
      return
    raise SystemExit('the config fits: lower --memory_gb')

  for _ in range(args.rounds):
    times['compile'].append(_timed(lambda: job_lib.build_job(config, devices).compile_train_step()))
    times['verdict'].append(_timed(verdict))
    times['refusal'].append(_timed(refusal))
  compile_s = statistics.median(times['compile'])
  print(f'refusal message: {times["message"]}')
  print('| what | median s | vs compile |\n|---|---|---|')
  for name in ('compile', 'verdict', 'refusal'):
    median = statistics.median(times[name])
    print(f'| {name} | {median:.2f} | {median / compile_s:.2f}x |')


if __name__ == '__main__':
  main()
