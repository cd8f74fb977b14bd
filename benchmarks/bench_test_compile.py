"""What tests/conftest.py's XLA flag (--xla_backend_optimization_level=0) changes, for BENCHMARKS.md.

  python benchmarks/bench_test_compile.py [--rounds=3] [--steps=5]

In fresh processes on 8 fake CPU devices, alternating the default level and 0 round by round: the tiny
config's train step, its compile time, its memory analysis (which must not change: tests assert on it),
its median step time and the losses of a few steps on fixed synthetic batches.
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
LEVEL_0 = '--xla_backend_optimization_level=0'

ONE_PROCESS = '''
import json, sys, time
sys.path.insert(0, {repo!r})
import jax, numpy as np
from configs import tiny
from trainer.run import job as job_lib
config = tiny.get_config()
config.data.source = 'synthetic'
job = job_lib.build_job(config)
state = job.init_state(0)
start = time.perf_counter()
step = job.compile_train_step()
compile_s = time.perf_counter() - start
memory = step.memory_analysis()
rng = np.random.default_rng(0)
losses, times = [], []
for _ in range({steps}):
  batch = {{k: jax.device_put(rng.integers(0, 256, v.shape).astype(np.int32), v.sharding)
            for k, v in job.abstract_batch.items()}}
  start = time.perf_counter()
  state, metrics = step(state, batch)
  losses.append(float(metrics['loss']))
  times.append(time.perf_counter() - start)
print(json.dumps({{'compile_s': compile_s, 'step_s': sorted(times[1:])[len(times[1:]) // 2], 'losses': losses,
                  'memory': [memory.temp_size_in_bytes, memory.argument_size_in_bytes, memory.output_size_in_bytes,
                             memory.alias_size_in_bytes]}}))
'''


def measure(extra_flags: str, steps: int) -> dict:
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
         'XLA_FLAGS': f'{extra_flags} --xla_force_host_platform_device_count=8'.strip()}
  out = subprocess.run([sys.executable, '-c', ONE_PROCESS.format(repo=str(REPO), steps=steps)], env=env, check=True,
                       capture_output=True, text=True).stdout
  return json.loads(out.splitlines()[-1])


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=5)
  args = parser.parse_args()
  runs = {'default': [], 'level 0': []}
  for _ in range(args.rounds):
    runs['default'].append(measure('', args.steps))
    runs['level 0'].append(measure(LEVEL_0, args.steps))
  print('| XLA flags | compile s (median) | step ms (median) | temp/argument/output/alias bytes | losses |')
  print('|---|---|---|---|---|')
  for name, results in runs.items():
    compile_s = statistics.median(r['compile_s'] for r in results)
    step_ms = statistics.median(r['step_s'] for r in results) * 1e3
    memory = {tuple(r['memory']) for r in results}
    losses = {tuple(r['losses']) for r in results}
    print(f'| {name} | {compile_s:.2f} | {step_ms:.1f} | {" / ".join(map(str, next(iter(memory))))} | '
          f'{", ".join(f"{l:.6f}" for l in next(iter(losses)))} |')
    assert len(memory) == 1 and len(losses) == 1, 'varied between rounds'
  same_memory = runs['default'][0]['memory'] == runs['level 0'][0]['memory']
  same_losses = runs['default'][0]['losses'] == runs['level 0'][0]['losses']
  print(f'memory analysis identical: {same_memory}; losses bitwise identical: {same_losses}')


if __name__ == '__main__':
  main()
