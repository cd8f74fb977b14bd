"""One supervised launch of configs/tiny.py per bad setting given (each a quoted string of flags); prints the exit code,
the time, the count of stderr lines and tracebacks, and the last line (BENCHMARKS.md, issue 39).

  .venv/bin/python benchmarks/bench_fault_sweep.py "--max_restarts=-1" "--workdir=gs://tb/run"
"""
import subprocess, sys, os, time
import pathlib
REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'tests'))
from conftest import launcher_env
cases = [l.split() for l in sys.argv[1:]]
for extra in cases:
  t=time.monotonic()
  wd = '/tmp/bench-faults/sw-' + str(abs(hash(tuple(extra))))
  args = [a if a.startswith('--workdir') else a for a in extra]
  if not any(a.startswith('--workdir') for a in args): args.append(f'--workdir={wd}')
  r = subprocess.run([sys.executable, 'launch.py', '--config=configs/tiny.py', '--config.train.steps=2', *args],
     cwd=REPO, env=launcher_env(LAUNCH_MAX_RESTARTS='1'), capture_output=True, text=True, timeout=300)
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  print(f'{" ".join(extra)} -> rc {r.returncode} {time.monotonic()-t:.0f}s lines {len(lines)} tb {r.stderr.count("Traceback")}')
  print('   ', (lines[-1] if lines else '')[:300])
