"""What a trace window costs, side by side in one run: traced steps vs the steps around them.

Runs `launch.py` once with a trace window and every step logged, then compares the
median step time inside the window with the steps outside it (step 1 left out),
and reports the trace's write-out time and size and the run's goodput.

  python benchmarks/bench_profiling.py [--config=configs/default.py] [--steps=60] [--start=21] [--num=10]
"""

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='configs/default.py')
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--start', type=int, default=21, help='first traced step')
  parser.add_argument('--num', type=int, default=10, help='traced steps')
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as workdir:
    command = [sys.executable, str(REPO / 'launch.py'), f'--config={args.config}', f'--workdir={workdir}',
               f'--config.train.steps={args.steps}', '--config.log.every_steps=1', '--config.train.eval_every_steps=0',
               '--config.ckpt.every_steps=100000', '--config.profile.trace_window=True',
               f'--config.profile.start_step={args.start}', f'--config.profile.num_steps={args.num}',
               '--config.log.progress_bar=off']
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800, env=dict(os.environ))
    if result.returncode:
      sys.exit(f'launch.py failed:\n{result.stderr[-3000:]}')
    records = [json.loads(line) for line in (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()]
    goodput = json.loads((pathlib.Path(workdir) / 'goodput.jsonl').read_text().splitlines()[-1])
    traces = list(pathlib.Path(workdir).glob('plugins/profile/*/*.xplane.pb'))
    size_mib = sum(p.stat().st_size for p in traces) / 2**20
  window = range(args.start, args.start + args.num)
  inside = [r['step_time_s'] for r in records if r['step'] in window]
  outside = [r['step_time_s'] for r in records if r['step'] not in window and r['step'] > 1]
  write_s = float(re.search(r'Trace written under .* in ([0-9.]+)s', result.stderr).group(1))
  print('| config | steps traced | median step, untraced (ms) | median step, traced (ms) | traced / untraced '
        '| trace write-out (s) | xplane.pb (MiB) | goodput |')
  print('|---|---|---|---|---|---|---|---|')
  print(f'| {args.config} | {args.start}..{window[-1]} of {args.steps} | {1000 * statistics.median(outside):.1f} '
        f'| {1000 * statistics.median(inside):.1f} | {statistics.median(inside) / statistics.median(outside):.2f} '
        f'| {write_s:.1f} | {size_mib:.2f} | {goodput["goodput"]:.1%} |')


if __name__ == '__main__':
  main()
