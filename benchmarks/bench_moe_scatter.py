"""The scatters in the MoE train step, compiled for one H100 on this machine (no GPU needed).

  python benchmarks/bench_moe_scatter.py [--config=configs/moe_1b.py] [--batch_size=8] [--topology=h100:1]
      [--override=SECTION.KEY=VALUE ...]

Needs requirements-gpu-plan.txt (jax's CUDA plugin). It compiles the real train step (remat none, synthetic data,
bfloat16: benchmarks/bench_expert_kernel.py's config, the Triton grouped matmul on) and lists every `scatter` of the
optimized HLO (in fused computations too; a loop body's counted once) by element type, shape and jax scope, with
the bytes of the array it writes into, the compiled cost analysis's bytes accessed where XLA gives one (not for a GPU
target compiled without a GPU, jax 0.10.2) and the temporaries' bytes. Why: on an
H200 the profile of moe_1b b8 (benchmarks/moe_profile.py) put about 39 ms of the grouped matmuls' 104 ms a step in
XLA scatter fusions around the kernels (docs/moe.md "Where the time goes"); trainer/models/row_permute.py moves the
experts' rows by gathers only. The last line counts the scatters that move rows inside MoE layers: 0 when none does
(the embedding's and the loss's gradients, and the router's top-k, keep theirs).
"""

import argparse
import math
import os
import re
import sys
from collections import Counter

os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_expert_kernel  # noqa: E402
from trainer.run import job as job_lib  # noqa: E402
from trainer.run import plan  # noqa: E402

_SCATTER = re.compile(r'= (\w+)\[([\d,]*)\][^ ]* scatter\(.*op_name="([^"]*)"')
_BYTES = {'bf16': 2, 'f16': 2, 'f32': 4, 'f64': 8, 's32': 4, 'u32': 4, 's64': 8, 'pred': 1, 's8': 1, 'u8': 1}


def scatters(hlo_text: str) -> Counter:
  """Counter of (element type, written shape, jax scope) over the `scatter` instructions of `hlo_text`."""
  found = Counter()
  for line in hlo_text.splitlines():
    match = _SCATTER.search(line)
    if match:
      element, dims, op_name = match.groups()
      scope = re.sub(r'^jit\(train_step\)/|/while/body/closed_call', '', op_name)
      found[(element, f'[{dims}]', scope)] += 1
  return found


def moves_expert_rows(key: tuple[str, str, str], num_experts: int) -> bool:
  """Whether a scatter moves rows of activations inside an MoE layer: under its `moe` scope, writing (rows, width)
  of a float type or of u32 (XLA writes bf16 rows as u32 words); not the router's (tokens, experts) probabilities
  (top_k's gradient) nor the per-expert counts."""
  element, shape, scope = key
  dims = [int(d) for d in shape.strip('[]').split(',') if d]
  return '/moe/' in scope and element not in ('s32', 's64', 'pred') and len(dims) == 2 and dims[1] != num_experts


def _bytes(element: str, shape: str) -> int:
  return _BYTES.get(element, 4) * math.prod(int(d) for d in shape.strip('[]').split(',') if d)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default='configs/moe_1b.py')
  parser.add_argument('--batch_size', type=int, default=8)
  parser.add_argument('--topology', default='h100:1')
  parser.add_argument('--override', action='append', default=[], help='SECTION.KEY=VALUE, e.g. model.num_layers=2.')
  args = parser.parse_args()
  config = bench_expert_kernel._config(args.config, args.batch_size, args.override)
  devices = plan.topology_devices(args.topology)
  print(f'{args.config} batch {args.batch_size}, compiled for {args.topology} ({devices[0].device_kind}), remat none')
  compiled = job_lib.build_job(config, devices).compile_train_step()
  found = scatters(compiled.as_text())
  print('| element | written shape | jax scope | instructions | written MiB each |')
  print('|---|---|---|---|---|')
  for (element, shape, scope), n in sorted(found.items()):
    print(f'| {element} | {shape} | {scope} | {n} | {_bytes(element, shape) / 2**20:.2f} |')
  moves = {key: n for key, n in found.items() if moves_expert_rows(key, config.model.num_experts)}
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) and cost else cost
  accessed = (cost or {}).get('bytes accessed')
  print(f'scatters: {sum(found.values())} ({sum(_bytes(k[0], k[1]) * n for k, n in found.items()) / 2**20:.1f} MiB '
        'written into, loop bodies once)')
  print('cost analysis bytes accessed: ' + (f'{accessed / 2**30:.2f} GiB' if accessed else 'not given by XLA') +
        f'; temporaries {compiled.memory_analysis().temp_size_in_bytes / 2**30:.2f} GiB per device')
  print(f'MoE row-movement scatters: {sum(moves.values())} '
        f'({sum(_bytes(k[0], k[1]) * n for k, n in moves.items()) / 2**20:.1f} MiB written into)')

if __name__ == '__main__':
  main()
