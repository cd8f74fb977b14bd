"""Times the default job (or another preset) end to end and reports how much it learned.

  python scripts/bench_default_job.py [--config=configs/default.py] [--workdir=/tmp/bench_default]

Runs `launch.py` in a fresh workdir as a user would (wall time includes start-up,
data loading, compile, eval and checkpoints), then reads metrics.jsonl.
"""

import argparse
import json
import pathlib
import platform
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='configs/default.py')
  parser.add_argument('--workdir', default='/tmp/bench_default')
  args = parser.parse_args()
  shutil.rmtree(args.workdir, ignore_errors=True)
  start = time.perf_counter()
  subprocess.run([sys.executable, str(REPO / 'launch.py'), f'--config={args.config}', f'--workdir={args.workdir}'],
                 cwd=REPO, check=True)
  wall = time.perf_counter() - start
  records = [json.loads(l) for l in (pathlib.Path(args.workdir) / 'metrics.jsonl').read_text().splitlines()]
  first, last = records[0], records[-1]
  evals = [r for r in records if 'eval_loss' in r]
  unit = 'tokens_per_s' if 'tokens_per_s' in last else 'images_per_s'  # LM or classifier presets.
  steady = [r[unit] for r in records[1:]]
  import jax
  print(json.dumps({
      'config': args.config, 'wall_s': round(wall, 1), 'steps': last['step'],
      'first_loss': round(first['loss'], 4), 'last_loss': round(last['loss'], 4),
      'loss_drop_pct': round(100 * (1 - last['loss'] / first['loss']), 1),
      'final_eval_loss': round(evals[-1]['eval_loss'], 4) if evals else None,
      **({'final_eval_accuracy': round(evals[-1]['eval_accuracy'], 4)} if evals and 'eval_accuracy' in evals[-1] else {}),
      f'median_{unit}': round(sorted(steady)[len(steady) // 2]) if steady else None,
      'machine': f'{platform.machine()} {platform.processor() or ""} cpus={__import__("os").cpu_count()}'.strip(),
      'jax': jax.__version__, 'python': platform.python_version(),
  }, indent=1))


if __name__ == '__main__':
  main()
