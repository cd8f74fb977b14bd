"""Parallelism figures for BENCHMARKS.md, on 8 fake CPU devices.

  python benchmarks/bench_parallel.py [--config=configs/default.py] [--steps=30]

1. For DP, FSDP, TP and a 2x2x2 mix: the all-reduce / all-gather / reduce-scatter
   ops in the compiled train step, and per-device parameter and optimizer bytes.
2. Step time of each strategy relative to 'jit' on the data-parallel mesh,
   measured side by side (alternating rounds) in one process.
"""

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import timing  # noqa: E402
from parallel import sharding  # noqa: E402
from trainer.run import job as job_lib  # noqa: E402

MESHES = {  # name: ((data, fsdp, tensor), number of devices)
    'DP (8,1,1)': ((8, 1, 1), 8),
    'FSDP (1,8,1)': ((1, 8, 1), 8),
    'TP (1,1,4), 4 devices': ((1, 1, 4), 4),
    'mix (2,2,2)': ((2, 2, 2), 8),
}
COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter')


def _load_config(path: str):
  spec = importlib.util.spec_from_file_location('bench_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _job(config, shape, num_devices, strategy='jit'):
  config = config.copy_and_resolve_references()
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = shape
  config.parallel.strategy = strategy
  job = job_lib.build_job(config, jax.devices()[:num_devices], log_fn=print)  # A preset's 'auto', as a launch does.
  return job.config, job


def collectives_table(base_config) -> list[dict]:
  rows = []
  for name, (shape, num_devices) in MESHES.items():
    _, job = _job(base_config, shape, num_devices)
    hlo = job.compile_train_step().as_text()
    counts = {op: len(re.findall(rf'\s{op}(?:-start)?\(', hlo)) for op in COLLECTIVES}
    _, totals = sharding.sharding_table(job.abstract, job.shardings)
    rows.append({'mesh': name, **counts,
                 'params_MiB_per_device': round(totals['params_bytes_per_device'] / 2**20, 3),
                 'opt_state_MiB_per_device': round(totals['opt_state_bytes_per_device'] / 2**20, 3)})
  return rows


def strategy_times(base_config, steps: int, rounds: int = 3) -> dict[str, float]:
  """Median step time per strategy; rounds alternate strategies so drift hits all alike."""
  runners = {}
  for strategy in ('jit', 'shard_map', 'pmap'):
    config, job = _job(base_config, (8, 1, 1), 8, strategy)
    compiled = job.compile_train_step()
    state = job.init_state(config.train.seed)
    rng = np.random.default_rng(0)
    local = {k: rng.integers(0, 256, job.abstract_batch['inputs'].shape, dtype=np.int32)
             for k in ('inputs', 'targets')}
    batch = {k: jax.device_put(v, job.batch_shardings[k]) for k, v in local.items()}
    runners[strategy] = [compiled, state, batch]
  return timing.alternating_medians(runners, steps, rounds)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='configs/default.py')
  parser.add_argument('--steps', type=int, default=30)
  args = parser.parse_args()
  config = _load_config(args.config)
  print('| mesh | all-reduce | all-gather | reduce-scatter | params MiB/device | opt state MiB/device |')
  print('|---|---|---|---|---|---|')
  for row in collectives_table(config):
    print('| ' + ' | '.join(str(v) for v in row.values()) + ' |')
  medians = strategy_times(config, args.steps)
  print('\n| strategy | median step (ms) | vs jit |')
  print('|---|---|---|')
  for strategy, median in medians.items():
    print(f'| {strategy} | {median * 1e3:.1f} | {median / medians["jit"]:.2f} |')
  print('\n' + json.dumps({'jax': jax.__version__, 'devices': len(jax.devices()), 'config': args.config,
                           'steps_per_round': args.steps}))


if __name__ == '__main__':
  main()
