"""Expert-parallel dispatch figures for BENCHMARKS.md: the compiled MoE train step at mesh.expert=N on 8 fake CPU devices.

  python benchmarks/bench_expert_dispatch.py [--root=.] [--expert=4] [--fsdp=2] [--steps=10] [--capacity_factor=0]

Imports the launcher from `--root` (point it at an export of another commit, e.g. `git archive int | tar -x -C
/tmp/old`, to compare dispatches side by side in alternating processes), builds the tiny preset with 8 experts,
top-2, d_model 64, batch 16 x 64 tokens, compiles the train step, and prints the collectives in its HLO (all-to-all,
all-reduce, all-gather) and the median step time over `--steps` steps after one warm-up step.
"""

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--root', default='.')
  parser.add_argument('--expert', type=int, default=4)
  parser.add_argument('--fsdp', type=int, default=2)
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--capacity_factor', type=float, default=0.0)
  args = parser.parse_args()
  sys.path.insert(0, os.path.abspath(args.root))
  import jax
  import numpy as np

  from configs import tiny
  from trainer.run import job as job_lib

  c = tiny.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.expert = 8 // (args.fsdp * args.expert), args.fsdp, args.expert
  c.train.compute_dtype = 'float32'
  c.train.batch_size, c.data.seq_len = 16, 64
  c.model.update(d_model=64, mlp_dim=128, num_experts=8, experts_per_token=2,
                 expert_capacity_factor=args.capacity_factor or None)
  job = job_lib.build_job(c)
  compiled = job.compile_train_step()
  hlo = compiled.as_text()
  counts = {op: hlo.count(f' {op}(') for op in ('all-to-all', 'all-reduce', 'all-gather', 'reduce-scatter')}
  rng = np.random.default_rng(0)
  batch = {k: rng.integers(0, 256, s.shape).astype(s.dtype) for k, s in job.abstract_batch.items()}
  batch = jax.device_put(batch, job.batch_shardings)
  state = job.init_state(0)
  times = []
  for _ in range(args.steps + 1):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  print(f'root={args.root} expert={args.expert} fsdp={args.fsdp} capacity_factor={args.capacity_factor} '
        f'collectives={counts} median_step_ms={1000 * statistics.median(times[1:]):.1f}')


if __name__ == '__main__':
  main()
