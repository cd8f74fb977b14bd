"""What a launch's collector settings (trainer/run/collector.py) save: CPU seconds and garbage collections of a tiny
launch with them and with CPython's defaults, in alternated rounds.

  python benchmarks/bench_launch_gc.py [rounds]

Each launch is `python launch.py --config=configs/tiny.py` (docs/*.md as its text, the suite's XLA flags, 8 fake
CPU devices, one warm compilation cache shared by both arms) run through a wrapper that counts the collections and
the CPU inside them (gc.callbacks); the defaults arm turns collector.tune and freeze_imports into no-ops. Rows: the
median over `rounds` of the child's user + system CPU, its collections, and their CPU.
"""

import json
import os
import pathlib
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parent.parent
WRAPPER = '''
import atexit, gc, json, runpy, sys, time
sys.path.insert(0, {repo!r})
if {defaults!r}:
  from trainer.run import collector
  collector.tune = collector.freeze_imports = lambda: None
seen = {{'collections': 0, 'cpu_s': 0.0}}
started = []
def on_collect(phase, info):
  if phase == 'start':
    started.append(time.process_time())
  else:
    seen['collections'] += 1
    seen['cpu_s'] += time.process_time() - started.pop()
gc.callbacks.append(on_collect)
atexit.register(lambda: open({out!r}, 'w').write(json.dumps(seen)))
sys.argv = ['launch.py', *{args!r}]
runpy.run_path({launch!r}, run_name='__main__')
'''


def _launch(defaults: bool, workdir: pathlib.Path, out: pathlib.Path, env: dict[str, str]) -> dict:
  shutil.rmtree(workdir, ignore_errors=True)
  args = ['--config=configs/tiny.py', f'--workdir={workdir}', f'--config.data.text_dir={REPO / "docs"}',
          '--config.data.file_glob=*.md']
  code = WRAPPER.format(repo=str(REPO), defaults=defaults, out=str(out), args=args, launch=str(REPO / 'launch.py'))
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  subprocess.run([sys.executable, '-c', code], cwd=REPO, env=env, check=True, capture_output=True)
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  return {'cpu_s': after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
          **{f'gc_{k}': v for k, v in json.loads(out.read_text()).items()}}


def main(rounds: int = 9) -> None:
  tmp = pathlib.Path(tempfile.mkdtemp(prefix='bench-launch-gc-'))
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'LAUNCH_MAX_RESTARTS': '0',
         'XLA_FLAGS': '--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false '
                      '--xla_force_host_platform_device_count=8',
         'JAX_COMPILATION_CACHE_DIR': str(tmp / 'cache'), 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
         'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0'}
  arms = {'CPython defaults (700, 10, 10)': True, 'collector.py (50000, 20, 100) + freeze': False}
  runs = {name: [] for name in arms}
  try:
    for defaults in arms.values():  # Warms the compilation cache, unmeasured.
      _launch(defaults, tmp / 'run', tmp / 'gc.json', env)
    for _ in range(rounds):
      for name, defaults in arms.items():
        runs[name].append(_launch(defaults, tmp / 'run', tmp / 'gc.json', env))
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  print(f'| collector | launch CPU s (median of {rounds}) | collections | CPU in them s |')
  print('|---|---|---|---|')
  for name, rows in runs.items():
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"| {name} | {median['cpu_s']:.2f} | {median['gc_collections']:.0f} | {median['gc_cpu_s']:.3f} |")


if __name__ == '__main__':
  main(*map(int, sys.argv[1:2]))
