"""FLOPs per train step counted from the traced step against the Llama's analytic counts, and the trace's cost.

  python benchmarks/bench_flops.py [--presets=tiny,gpt2_124m,llama_1b,vit_base] [--repeats=3]

Per preset (configs/<preset>.py on synthetic data, float32, train.remat_policy 'auto' read as 'full' since
resolving it compiles): the traced count (trainer/observe/flops.py), the analytic 'matmul' count with causal attention
halved (MaxText) and unhalved, 6N, the traced count over the unhalved one, and the seconds a count takes: the
first, as a launch pays it, and the median of --repeats (building the Job, which a run does anyway, is not
included). Scanned and unrolled layers
both, where the preset has layers to scan. Nothing is compiled.
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

from trainer.observe import flops  # noqa: E402
from trainer.run import job as job_lib  # noqa: E402


def _config(preset: str, scan: bool):
  config = importlib.import_module(f'configs.{preset}').get_config()
  config.data.source = 'synthetic'
  config.train.compute_dtype = 'float32'
  if config.train.remat_policy == 'auto':
    config.train.remat_policy = 'full'
  config.model.scan_layers = scan
  return config


def row(preset: str, scan: bool, repeats: int) -> dict:
  config = _config(preset, scan)
  job = job_lib.build_job(config, jax.devices()[:1])
  times, counted = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    counted = flops.job_step_flops(job)
    times.append(time.perf_counter() - start)
  out = {'preset': preset, 'layers': 'scanned' if scan else 'unrolled', 'traced': counted.flops,
         'first_s': times[0], 'trace_s': statistics.median(times)}
  if config.model.name == 'llama':
    m, b, t = config.model, config.train.batch_size, config.data.seq_len
    analytic = flops.step_flops(m, b, t)
    out.update(matmul=analytic.matmul, unhalved=analytic.matmul_unmasked, six_n=analytic.six_n,
               ratio=counted.flops / analytic.matmul_unmasked)
  return out


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--presets', default='tiny,gpt2_124m,llama_1b,vit_base')
  parser.add_argument('--repeats', type=int, default=3)
  args = parser.parse_args(argv)
  rows = [row(p, scan, args.repeats) for p in args.presets.split(',') for scan in (True, False)]
  fmt = lambda r, k: f'{r[k]:.4g}' if k in r else '-'
  print('| preset | layers | traced | analytic matmul (causal halved) | unhalved | 6N | traced / unhalved | '
        'trace (s): first, median |')
  print('|---|---|---|---|---|---|---|---|')
  for r in rows:
    ratio = f"{r['ratio']:.6f}" if 'ratio' in r else '-'
    print(f"| {r['preset']} | {r['layers']} | {r['traced']:.4g} | {fmt(r, 'matmul')} | {fmt(r, 'unhalved')} | "
          f"{fmt(r, 'six_n')} | {ratio} | {r['first_s']:.2f}, {r['trace_s']:.2f} |")
  return rows


if __name__ == '__main__':
  main()
