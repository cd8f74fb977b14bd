"""The experts' grouped matmul on NVIDIA GPUs, before and after, compiled for an H100 on this machine (no GPU needed).

  python benchmarks/bench_expert_kernel.py [--config=configs/moe_1b.py] [--batch_size=8] [--topology=h100:1]
      [--override=SECTION.KEY=VALUE ...]

Needs requirements-gpu-plan.txt (jax's CUDA plugin). For each kernel (jax.lax.ragged_dot, XLA's GPU lowering:
'before'; the Pallas Triton grouped matmul, trainer/models/grouped_matmul.py: 'after') it compiles the real train
step (remat none, synthetic data) and prints one row: per-device temporaries and total (the compiled memory
analysis), the matmul FLOPs XLA runs (trainer/observe/compiled_flops.py: read from the optimized HLO, loops times their
trip counts; custom calls unseen) and those plus the Triton kernels' expert matmuls (3 projections x forward,
input and weight gradients x 2 x assignments x d_model x expert width x MoE layers), each over the active count
(the traced step, trainer/observe/traced_flops.py), and the dense-experts guard's line.
"""

import argparse
import os
import sys

os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import importlib.util  # noqa: E402

from trainer.memory import footprint  # noqa: E402
from trainer.models import moe  # noqa: E402
from trainer.observe import compiled_flops, flops  # noqa: E402
from trainer.run import job as job_lib  # noqa: E402
from trainer.run import plan  # noqa: E402


def _config(path: str, batch_size: int, overrides: list[str]):
  spec = importlib.util.spec_from_file_location('bench_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.train.batch_size, c.train.remat_policy, c.data.source = batch_size, 'none', 'synthetic'
  c.train.compute_dtype = 'bfloat16'
  for override in overrides:  # KEY=VALUE, an int, float or text.
    key, value = override.split('=', 1)
    section, name = key.split('.')
    for kind in (int, float, str):
      try:
        c[section][name] = kind(value)
        break
      except (TypeError, ValueError):
        continue
  return c


def row(config, devices, kernel: str) -> dict:
  real = moe.for_platform
  moe.for_platform = lambda cfg, platform: real(cfg, platform if kernel == 'triton' else 'not-gpu')
  try:
    job = job_lib.build_job(config, devices)
    compiled = job.compile_train_step()
    active = flops.job_step_flops(job, log=False).flops
  finally:
    moe.for_platform = real
  m = config.model
  xla = compiled_flops.dot_flops(compiled.as_text()) * len(devices)
  assignments = config.train.batch_size * config.data.seq_len * m.experts_per_token
  kernels = (3 * 3 * 2 * assignments * m.d_model * m.expert_mlp_dim * moe.num_moe_layers(m)
             if kernel == 'triton' else 0)
  analysis = compiled.memory_analysis()
  return {'kernel': kernel, 'temp': analysis.temp_size_in_bytes, 'total': footprint.compiled_bytes(compiled),
          'xla_over_active': xla / active, 'all_over_active': (xla + kernels) / active, 'active': active,
          'guard': compiled_flops.dense_experts_line(xla, active, moe_dropless=True)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default='configs/moe_1b.py')
  parser.add_argument('--batch_size', type=int, default=8)
  parser.add_argument('--topology', default='h100:1')
  parser.add_argument('--override', action='append', default=[], help='SECTION.KEY=VALUE, e.g. model.num_experts=4.')
  args = parser.parse_args()
  config = _config(args.config, args.batch_size, args.override)
  devices = plan.topology_devices(args.topology)
  print(f'{args.config} batch {args.batch_size}, compiled for {args.topology} ({devices[0].device_kind}), remat none')
  print('| kernel | temporaries per device | total per device | XLA matmul FLOPs / active | with kernels / active |')
  print('|---|---|---|---|---|')
  guards = []
  for kernel in ('ragged_dot', 'triton'):
    r = row(config, devices, kernel)
    print(f'| {r["kernel"]} | {footprint.gib(r["temp"])} | {footprint.gib(r["total"])} | '
          f'{r["xla_over_active"]:.2f}x | {r["all_over_active"]:.2f}x |')
    guards.append(f'{kernel}: {r["guard"] or "guard silent"}')
  print('\n'.join(guards))


if __name__ == '__main__':
  main()
