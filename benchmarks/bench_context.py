"""Figures for BENCHMARKS.md "Long sequences": what splitting rows over `mesh.context` costs and balances.

  python benchmarks/bench_context.py [--steps=10] [--seq_len=1024] [--schemes=all-gather,ring]

1. CPU step time with each row split over context = 2 and 4 devices against whole rows (context = 1), at the same
   global shape (batch 8 x seq_len on 8 fake devices: data = 8 / context), side by side in alternating rounds, for
   each scheme of attention across the split (model.context_scheme: the all-gather of keys/values, the ring):
   the cost of the split and of each scheme, as ratios.
2. Load balance of causal attention over 4 devices at 131,072 tokens: per device, the (query, key) pairs a block
   kernel computes, in plain row order and in the balanced (zig-zag) order the launcher uses (parallel/context.py).
"""

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import default  # noqa: E402
from parallel import context as context_lib  # noqa: E402
from benchmarks import timing  # noqa: E402


def _runner(context: int, seq_len: int, scheme: str = 'auto'):
  config = default.get_config()
  config.model.context_scheme = scheme
  config.data.source = 'synthetic'
  config.train.batch_size = 8
  config.train.compute_dtype = 'float32'
  config.data.seq_len = seq_len
  config.model.num_heads, config.model.num_kv_heads = 4, 2
  config.mesh.data, config.mesh.fsdp, config.mesh.context, config.mesh.tensor = 8 // context, 1, context, 1
  return timing.runner(config)


def step_times(seq_len: int, steps: int, schemes=('all-gather', 'ring'),
               rounds: int = 3) -> dict[tuple[int, str], float]:
  """Median step time per (context size, scheme); rounds alternate runners so drift hits all alike."""
  runners = {(1, '-'): _runner(1, seq_len)}
  runners.update({(c, s): _runner(c, seq_len, s) for c in (2, 4) for s in schemes})
  return timing.alternating_medians(runners, steps, rounds)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--seq_len', type=int, default=1024)
  parser.add_argument('--schemes', default='all-gather,ring', help='model.context_scheme values to time')
  args = parser.parse_args()
  schemes = tuple(args.schemes.split(','))
  medians = step_times(args.seq_len, args.steps, schemes)
  print(f'| mesh (batch 8 x {args.seq_len}) | scheme | median step (ms) | vs context=1 | vs {schemes[0]} |')
  print('|---|---|---|---|---|')
  for (context, scheme), median in medians.items():
    same = medians.get((context, schemes[0]), median)
    print(f'| data={8 // context}, context={context} | {scheme} | {median * 1e3:.1f} | '
          f'{median / medians[1, "-"]:.2f} | {median / same:.2f} |')
  seq_len, parts = 131_072, 4
  plain, balanced = context_lib.causal_work(seq_len, parts, False), context_lib.causal_work(seq_len, parts)
  print(f'\n| row order ({seq_len:,} tokens over context={parts}) | causal (query, key) pairs per device, '
        f'in units of 10^9 | slowest / mean |')
  print('|---|---|---|')
  for name, work in (('plain', plain), ('balanced (zig-zag)', balanced)):
    print(f'| {name} | {", ".join(f"{w / 1e9:.2f}" for w in work)} | {max(work) / np.mean(work):.2f} |')
  print('\n' + json.dumps({'jax': jax.__version__, 'devices': len(jax.devices()), 'steps_per_round': args.steps}))


if __name__ == '__main__':
  main()
