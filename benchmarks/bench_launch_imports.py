"""What the kernels a launch may never run cost its start: CPU seconds of importing them after jax, and whether the
launch's own modules still import them.

  python benchmarks/bench_launch_imports.py [rounds]

Each row is the median over `rounds` alternated rounds of `python -c "import jax; import X"` minus `import jax`
alone (user + system CPU of the child). The last line lists what of them importing launch.py's modules loads.
"""

import resource
import statistics
import subprocess
import sys

KERNELS = {
    'splash attention (TPU)': 'from jax.experimental.pallas.ops.tpu import splash_attention',
    'Pallas + Triton (grouped matmul)': 'from jax.experimental import pallas; from jax.experimental.pallas import triton',
}
LAUNCH_MODULES = 'import trainer.run.loop, trainer.run.plan, trainer.hf.load, parallel.distributed'
PROBES = ('jax.experimental.pallas.ops.tpu.splash_attention', 'jax.experimental.pallas.triton',
          'jax.experimental.pallas')


def _cpu(code: str) -> float:
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  subprocess.run([sys.executable, '-c', code], check=True)
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main(rounds: int = 7) -> None:
  times = {name: [] for name in ['jax', *KERNELS]}
  for _ in range(rounds):
    times['jax'].append(_cpu('import jax'))
    for name, code in KERNELS.items():
      times[name].append(_cpu(f'import jax; {code}'))
  base = statistics.median(times['jax'])
  print(f'import jax: {base:.3f} s of CPU (median of {rounds})')
  for name in KERNELS:
    print(f'{name}: +{statistics.median(times[name]) - base:.3f} s')
  loaded = subprocess.run([sys.executable, '-c', f'import sys; {LAUNCH_MODULES}; '
                           f'print([m for m in {PROBES!r} if m in sys.modules])'],
                          check=True, capture_output=True, text=True).stdout.strip()
  print(f'loaded by the launch modules: {loaded}')


if __name__ == '__main__':
  main(*map(int, sys.argv[1:2]))
