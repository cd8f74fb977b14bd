"""Launches configs/tiny.py, sends a signal N seconds after start (t=N) or after a stderr line matching a pattern
(PATTERN@DELAY), and prints the exit code, the time from the signal to the exit and the stderr (BENCHMARKS.md, issue 39).

  .venv/bin/python benchmarks/bench_fault_signal.py SIGTERM t=1
  .venv/bin/python benchmarks/bench_fault_signal.py SIGINT 'Data: @1'
"""
import os, re, signal, subprocess, sys, time, threading
import pathlib
REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'tests'))
from conftest import launcher_env, make_text_dir
import pathlib
sig = getattr(signal, sys.argv[1]); when = sys.argv[2]; extra = sys.argv[3:]
wd = f'/tmp/bench-faults/wd-{os.getpid()}'; td = pathlib.Path('/tmp/bench-faults/text'); td.mkdir(parents=True, exist_ok=True); make_text_dir(td)
cmd = [sys.executable, 'launch.py', '--config=configs/tiny.py', f'--workdir={wd}', f'--config.data.text_dir={td}', *extra]
t0 = time.monotonic()
p = subprocess.Popen(cmd, cwd=REPO, env=launcher_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
sent = [None]
if when.startswith('t='):
  def later():
    time.sleep(float(when[2:])); sent[0] = time.monotonic(); os.kill(p.pid, sig)
  threading.Thread(target=later, daemon=True).start()
out = []
for line in p.stderr:
  out.append(f'{time.monotonic()-t0:6.1f} {line}')
  if sent[0] is None and not when.startswith('t=') and re.search(when.split('@')[0], line):
    sent[0] = time.monotonic()
    delay = float(when.split('@')[1]) if '@' in when else 0
    threading.Timer(delay, lambda: os.kill(p.pid, sig)).start()
p.wait()
print(''.join(out)[-6000:])
print('RC', p.returncode, 'after signal %.1fs' % (time.monotonic() - sent[0]) if sent[0] else 'no signal sent', 'total %.1f' % (time.monotonic()-t0))
