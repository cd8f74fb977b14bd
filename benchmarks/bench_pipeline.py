"""Figures for BENCHMARKS.md "Pipeline stages": CPU step time of mesh.pipeline = 4 against pipeline = 1.

  python benchmarks/bench_pipeline.py [--steps=5] [--rounds=3] [--seq_len=128] [--num_layers=8]

The default job (d_model 128) deepened to --num_layers, batch 8 on 8 fake CPU devices: data = 8 (pipeline = 1)
against pipeline = 4 x data = 2 with 4 microbatches and 1 or 2 repeats, side by side in alternating rounds. The
bubble fraction (S-1)/(repeats x microbatches + S-1) is printed beside each ratio: the share of each step a stage
idles. On CPU the fake devices share the host's cores, so the ratio shows the schedule's overhead, not a speed-up.
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

from configs import default  # noqa: E402
from trainer import pipeline  # noqa: E402
from benchmarks import timing  # noqa: E402


def _runner(stages: int, repeats: int, seq_len: int, num_layers: int):
  config = default.get_config()
  config.data.source = 'synthetic'
  config.train.batch_size = 8
  config.train.compute_dtype = 'float32'
  config.data.seq_len = seq_len
  config.model.num_layers, config.model.scan_layers = num_layers, True
  config.mesh.data, config.mesh.fsdp, config.mesh.pipeline = 8 // stages, 1, stages
  config.train.pipeline_microbatches, config.train.pipeline_repeats = (4 if stages > 1 else 0), repeats
  return timing.runner(config)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--seq_len', type=int, default=128)
  parser.add_argument('--num_layers', type=int, default=8)
  args = parser.parse_args()
  shapes = ((1, 1), (4, 1), (4, 2))
  runners = {s: _runner(*s, args.seq_len, args.num_layers) for s in shapes}
  medians = timing.alternating_medians(runners, args.steps, args.rounds)
  print(f'| mesh (batch 8 x {args.seq_len}, {args.num_layers} layers) | repeats | microbatches | bubble | '
        f'median step (ms) | vs pipeline=1 |')
  print('|---|---|---|---|---|---|')
  for (stages, repeats), median in medians.items():
    bubble = pipeline.Schedule(stages, 4, repeats).bubble_fraction if stages > 1 else 0.0
    print(f'| data={8 // stages}, pipeline={stages} | {repeats} | {4 if stages > 1 else "-"} | {bubble:.1%} | '
          f'{median * 1e3:.1f} | {median / medians[1, 1]:.2f} |')
  print('\n' + json.dumps({'jax': jax.__version__, 'devices': len(jax.devices()), 'steps_per_round': args.steps,
                           'rounds': args.rounds}))


if __name__ == '__main__':
  main()
