"""What the supervisor costs: a healthy run's step time with and without it, and the time a restart takes.

  python benchmarks/bench_supervisor.py [--config=configs/tiny.py] [--rounds=3] [--processes=1]
      [--override=train.steps=60 ...]

Runs launch.py alternately with --max_restarts=0 (training in the launched process)
and --max_restarts=3 (training in the supervisor's child), `--rounds` times each,
in fresh workdirs, and reports the median logged step_time_s of each (the first
record, which includes start-up, left out). With --processes=2 each run is
scripts/launch_local.py with 2 processes x 4 CPU devices. Then one supervised run
whose process is SIGKILLed at step 7 (LAUNCH_TEST_FAULT, trainer/supervision/faults.py)
with --restart_backoff_s=0 measures the restart: from the moment the killed attempt
ended (attempts.jsonl) to the first step the next attempt logged (its log line's time).
"""

import argparse
import datetime
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent


def _command(args, workdir: str, restarts: int, overrides: list[str]) -> list[str]:
  head = [sys.executable, str(REPO / 'launch.py')]
  if args.processes > 1:
    head = [sys.executable, str(REPO / 'scripts' / 'launch_local.py'), f'--num_processes={args.processes}',
            f'--devices_per_process={8 // args.processes}']
  return [*head, f'--config={args.config}', f'--workdir={workdir}', f'--max_restarts={restarts}',
          '--restart_backoff_s=0', '--config.log.every_steps=1', *[f'--config.{o}' for o in overrides]]


def _run(command: list[str], env: dict[str, str]) -> str:
  result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
  if result.returncode != 0:
    sys.exit(f'failed ({result.returncode}): {" ".join(command)}\n{result.stderr[-3000:]}')
  return result.stderr


def _step_time(workdir: str) -> float:
  records = [json.loads(l) for l in (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()]
  return statistics.median(r['step_time_s'] for r in records[1:] if 'step_time_s' in r)


def _restart_s(stderr: str, workdir: str, year: int) -> float:
  first_attempt_end = json.loads((pathlib.Path(workdir) / 'attempts.jsonl').read_text().splitlines()[0])['end']
  after = stderr.split('restarting from the newest intact checkpoint', 1)[1]
  stamp = re.search(r'I(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*\] step \d+/', after)  # absl: I<MMDD> <time> ... step N/
  moment = datetime.datetime.strptime(f'{year}{stamp.group(1)} {stamp.group(2)}', '%Y%m%d %H:%M:%S.%f')
  return moment.timestamp() - first_attempt_end


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='configs/tiny.py')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--processes', type=int, default=1)
  parser.add_argument('--override', action='append', default=['train.steps=60'])
  args = parser.parse_args()
  env = {**os.environ, 'LAUNCH_MAX_RESTARTS': '3'}
  env.pop('LAUNCH_TEST_FAULT', None)
  times = {0: [], 3: []}
  root = pathlib.Path(tempfile.mkdtemp(prefix='bench_supervisor_'))
  for i in range(args.rounds):
    for restarts in ((0, 3) if i % 2 == 0 else (3, 0)):  # Alternating which goes first: no order effect.
      workdir = str(root / f'r{restarts}')
      shutil.rmtree(workdir, ignore_errors=True)
      _run(_command(args, workdir, restarts, args.override), env)
      times[restarts].append(_step_time(workdir))
  bare, supervised = statistics.median(times[0]), statistics.median(times[3])
  print(f'{args.config} x{args.processes} process(es), {args.rounds} rounds: median step time unsupervised '
        f'{bare * 1e3:.2f} ms {[round(t * 1e3, 2) for t in times[0]]}, supervised {supervised * 1e3:.2f} ms '
        f'{[round(t * 1e3, 2) for t in times[3]]}: ratio {supervised / bare:.3f}')
  workdir = str(root / 'killed')
  killed_env = {**env, 'LAUNCH_TEST_FAULT': 'kill@7,attempt=1' + (',process=1' if args.processes > 1 else '')}
  stderr = _run(_command(args, workdir, 3, [*args.override, 'ckpt.every_steps=4', 'ckpt.async_save=False']),
                killed_env)
  print(f'restart: {_restart_s(stderr, workdir, datetime.date.today().year):.1f}s from the killed attempt\'s end to '
        f'the next attempt\'s first logged step (start-up, restore and compile included)')
  shutil.rmtree(root, ignore_errors=True)


if __name__ == '__main__':
  main()
