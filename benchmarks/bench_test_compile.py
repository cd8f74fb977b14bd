"""What tests/conftest.py's XLA flags (LLVM at -O0, XLA's older CPU fusion emitters, one codegen module) change, for
BENCHMARKS.md.

  python benchmarks/bench_test_compile.py [--rounds=3] [--steps=5]

In fresh processes on 8 fake CPU devices, alternating the flag sets round by round: the tiny config's train step,
its compile time (wall and the process's CPU), its memory analysis (which must not change: tests assert on it), its
median step time and the losses of a few steps on fixed synthetic batches.
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
OLDER_FUSIONS = '--xla_cpu_use_fusion_emitters=false'
ONE_MODULE = '--xla_cpu_parallel_codegen_split_count=1'  # LLVM's code generated as one module, not split for threads.

ONE_PROCESS = '''
import json, resource, sys, time
sys.path.insert(0, {repo!r})
import jax, numpy as np
from configs import tiny
from trainer.run import job as job_lib
config = tiny.get_config()
config.data.source = 'synthetic'
job = job_lib.build_job(config)
state = job.init_state(0)
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
start, start_cpu = time.perf_counter(), cpu()
step = job.compile_train_step()
compile_s, compile_cpu_s = time.perf_counter() - start, cpu() - start_cpu
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
print(json.dumps({{'compile_s': compile_s, 'compile_cpu_s': compile_cpu_s,
                  'step_s': sorted(times[1:])[len(times[1:]) // 2], 'losses': losses,
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
  flag_sets = {'default': '', 'level 0': LEVEL_0,
               'level 0, older fusion emitters': f'{LEVEL_0} {OLDER_FUSIONS}',
               'level 0, older fusion emitters, one codegen module (the suite)':
                   f'{LEVEL_0} {OLDER_FUSIONS} {ONE_MODULE}'}
  runs = {name: [] for name in flag_sets}
  for _ in range(args.rounds):
    for name, flags in flag_sets.items():
      runs[name].append(measure(flags, args.steps))
  print('| XLA flags | compile s (median) | compile CPU s (median) | step ms (median) '
        '| temp/argument/output/alias bytes | losses |')
  print('|---|---|---|---|---|---|')
  for name, results in runs.items():
    compile_s = statistics.median(r['compile_s'] for r in results)
    compile_cpu_s = statistics.median(r['compile_cpu_s'] for r in results)
    step_ms = statistics.median(r['step_s'] for r in results) * 1e3
    memory = {tuple(r['memory']) for r in results}
    losses = {tuple(r['losses']) for r in results}
    print(f'| {name} | {compile_s:.2f} | {compile_cpu_s:.2f} | {step_ms:.1f} | '
          f'{" / ".join(map(str, next(iter(memory))))} | {", ".join(f"{l:.6f}" for l in next(iter(losses)))} |')
    assert len(memory) == 1 and len(losses) == 1, 'varied between rounds'
  names = list(flag_sets)
  for base, name in [('default', n) for n in names[1:]] + [(names[2], names[3])]:
    same_memory = runs[base][0]['memory'] == runs[name][0]['memory']
    same_losses = runs[base][0]['losses'] == runs[name][0]['losses']
    print(f'{name} against {base}: memory analysis identical: {same_memory}; '
          f'losses bitwise identical: {same_losses}')


if __name__ == '__main__':
  main()
