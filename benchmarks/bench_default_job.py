"""Times the default job (or another preset) end to end and reports how much it learned and how long it waited.

  python benchmarks/bench_default_job.py [--config=configs/default.py] [--workdir=/tmp/bench_default]
  python benchmarks/bench_default_job.py --compare_tree=/tmp/old_tree --rounds=2 \
      --override=train.steps=100 --override=log.every_steps=1

Runs `launch.py` in a fresh workdir as a user would (wall time includes start-up,
data loading, compile, eval and checkpoints), then reads metrics.jsonl. "data
wait" is the sum of `data_wait_s` over the sum of `step_time_s` of every logged
step but the first (which starts the read threads). With --compare_tree (another
checkout, e.g. `git archive REV | tar -x -C DIR`) both trees run alternately,
`--rounds` times each, on the same config, so their data-wait shares are measured side by side.
"""

import argparse
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent


def run_launcher(tree: pathlib.Path, config: str, workdir: str, overrides: list[str]) -> tuple[float, list[dict]]:
  """(wall seconds, metrics.jsonl records) of one fresh `launch.py` run from checkout `tree`."""
  shutil.rmtree(workdir, ignore_errors=True)
  start = time.perf_counter()
  subprocess.run([sys.executable, str(tree / 'launch.py'), f'--config={tree / config}', f'--workdir={workdir}',
                  *[f'--config.{o}' for o in overrides]], cwd=tree, check=True)
  wall = time.perf_counter() - start
  return wall, [json.loads(l) for l in (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()]


def data_wait_share(records: list[dict]) -> float:
  steps = [r for r in records[1:] if 'data_wait_s' in r]
  return sum(r['data_wait_s'] for r in steps) / sum(r['step_time_s'] for r in steps)


def summary(config: str, wall: float, records: list[dict]) -> dict:
  first, last = records[0], records[-1]
  evals = [r for r in records if 'eval_loss' in r]
  unit = 'tokens_per_s' if 'tokens_per_s' in last else 'images_per_s'  # LM or classifier presets.
  steady = [r[unit] for r in records[1:]]
  import jax
  return {
      'config': config, 'wall_s': round(wall, 1), 'steps': last['step'],
      'first_loss': round(first['loss'], 4), 'last_loss': round(last['loss'], 4),
      'loss_drop_pct': round(100 * (1 - last['loss'] / first['loss']), 1),
      'final_eval_loss': round(evals[-1]['eval_loss'], 4) if evals else None,
      **({'final_eval_accuracy': round(evals[-1]['eval_accuracy'], 4)} if evals and 'eval_accuracy' in evals[-1] else {}),
      f'median_{unit}': round(sorted(steady)[len(steady) // 2]) if steady else None,
      'data_wait_pct': round(100 * data_wait_share(records), 3) if len(records) > 1 else None,
      'machine': f'{platform.machine()} {platform.processor() or ""} cpus={os.cpu_count()}'.strip(),
      'jax': jax.__version__, 'python': platform.python_version(),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='configs/default.py', help='Relative to each tree.')
  parser.add_argument('--workdir', default='/tmp/bench_default')
  parser.add_argument('--override', action='append', default=[], help='KEY=VALUE, passed as --config.KEY=VALUE.')
  parser.add_argument('--compare_tree', default=None, help='Another checkout to run alternately with this one.')
  parser.add_argument('--rounds', type=int, default=1)
  args = parser.parse_args()
  trees = [REPO] + ([pathlib.Path(args.compare_tree).resolve()] if args.compare_tree else [])
  if len(trees) == 1 and args.rounds == 1:
    print(json.dumps(summary(args.config, *run_launcher(REPO, args.config, args.workdir, args.override)), indent=1))
    return
  results = {tree: [] for tree in trees}
  for _ in range(args.rounds):
    for tree in trees:
      results[tree].append(summary(args.config, *run_launcher(tree, args.config, args.workdir, args.override)))
  unit = next(k for k in results[REPO][0] if k.startswith('median_'))
  print('| tree | round | data wait (% of step time) | ' + unit + ' | first loss |')
  print('|---|---|---|---|---|')
  for tree, rows in results.items():
    for i, r in enumerate(rows):
      print(f"| {tree} | {i + 1} | {r['data_wait_pct']:.3f} | {r[unit]} | {r['first_loss']} |")


if __name__ == '__main__':
  main()
