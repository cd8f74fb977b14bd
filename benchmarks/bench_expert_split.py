"""Whether the MoE step's matmuls are split over the devices or repeated on each, compiled for 8 H100s on this machine.

  python benchmarks/bench_expert_split.py [--config=configs/moe_1b.py] [--batch_size=64] [--topology=h100:8]
      [--layout=data=8 --layout=expert=8 ...] [--capacity_factor=F] [--buffer_factor=F]

Needs requirements-gpu-plan.txt (jax's CUDA plugin). For each layout (mesh sizes; the others 1) it compiles the real
train step (remat none, synthetic data, bfloat16) and prints one row: the per-device matmul FLOPs read from the
optimized HLO (trainer/observe/compiled_flops.py: XLA's dots and the Triton grouped matmuls at their grid's size,
loops times their trip counts) over one eighth (one device's share) of the step's active FLOPs (the traced count,
trainer/observe/flops.py). 1.0x: the work split evenly; 8x: every device repeating the whole step's. --buffer_factor sets
model.expert_buffer_factor (dropless over `expert`: receive buffers of F times the balanced load).
"""

import argparse
import os
import sys

os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_expert_kernel  # noqa: E402
from trainer.observe import compiled_flops, flops  # noqa: E402
from trainer.run import job as job_lib  # noqa: E402
from trainer.run import plan  # noqa: E402


def _config(path: str, batch_size: int, layout: str, capacity_factor: float | None,
            buffer_factor: float | None = None):
  """bench_expert_kernel's config (remat none, synthetic data, bfloat16) on the mesh `layout` ('AXIS=N,...')."""
  sizes = [f'mesh.{size}' for size in layout.split(',')]
  sizes += [f'model.expert_capacity_factor={capacity_factor}'] if capacity_factor else []
  return bench_expert_kernel._config(path, batch_size, sizes + (
      [f'model.expert_buffer_factor={buffer_factor}'] if buffer_factor else []))


def row(config, devices) -> dict:
  job = job_lib.build_job(config, devices)
  per_device = compiled_flops.dot_flops(job.compile_train_step().as_text(), kernels=True)
  active = flops.job_step_flops(job, log=False).flops
  return {'per_device': per_device, 'active': active, 'ratio': per_device / (active / len(devices))}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default='configs/moe_1b.py')
  parser.add_argument('--batch_size', type=int, default=64)
  parser.add_argument('--topology', default='h100:8')
  parser.add_argument('--layout', action='append', help='mesh sizes, e.g. data=8 or data=2,expert=4')
  parser.add_argument('--capacity_factor', type=float, default=None, help='None: dropless (the preset\'s).')
  parser.add_argument('--buffer_factor', type=float, default=None,
                      help='model.expert_buffer_factor; None: worst-case receive buffers (exact).')
  args = parser.parse_args()
  devices = plan.topology_devices(args.topology)
  mode = f'capacity {args.capacity_factor:g}' if args.capacity_factor else 'dropless'
  mode += f', buffer factor {args.buffer_factor:g}' if args.buffer_factor else ''
  print(f'{args.config} batch {args.batch_size} {mode}, compiled for {args.topology} ({devices[0].device_kind}), '
        'remat none')
  print('| layout | matmul FLOPs per device | active FLOPs of the step | per device / (active / devices) |')
  print('|---|---|---|---|')
  for layout in args.layout or ['data=8', 'expert=8']:
    r = row(_config(args.config, args.batch_size, layout, args.capacity_factor, args.buffer_factor), devices)
    print(f'| {layout} | {r["per_device"]:.4g} | {r["active"]:.4g} | {r["ratio"]:.2f}x |', flush=True)


if __name__ == '__main__':
  main()
