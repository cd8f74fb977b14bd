"""train.quantization on an H100 without one: llama_1b's step compiled for `--topology=h100:1`, bf16 against fp8.

  python benchmarks/bench_quantization.py [--config=configs/llama_1b.py] [--batch_size=16]   # needs requirements-gpu-plan.txt

For each precision it builds the launcher's real Job on one compile-only H100 (trainer/memory/gpu_targets.py),
compiles the step and prints: the share of the transformer-layer matmul FLOPs whose dots take fp8 operands in the
compiled HLO (layer matmuls: every dot without a vocabulary-sized dimension; the output head has one, the attention
core is cuDNN's fused kernel, not a dot), and the compiled step's memory (what `launch.py --plan` reports). The
tokens/s and loss rows of issue 56 need a GPU: "not measured" until one is lent.
"""

import argparse
import collections
import math
import os
import pathlib
import re
import sys

os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')  # The CUDA plugin loads without a GPU (as --plan does).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

_INSTRUCTION = re.compile(r'%([\w.\-]+) = (\w+)\[([\d,]*)\]')
_DOT = re.compile(r'= \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\),.*?lhs_contracting_dims=\{([\d,]*)\}')


def _dims(text: str) -> list[int]:
  return [int(d) for d in text.split(',') if d]


def dot_flops_by_operands(hlo: str, skip_dim: int | None = None) -> dict[tuple[str, str], float]:
  """FLOPs (2 x output elements x contracted extent) of every dot in a compiled HLO module's text, by the
  (lhs, rhs) element types; dots with a dimension of `skip_dim` (the vocabulary: the output head) left out."""
  shapes = {name: (dtype, _dims(dims)) for name, dtype, dims in _INSTRUCTION.findall(hlo)}
  flops = collections.Counter()
  for match in _DOT.finditer(hlo):
    out, lhs, rhs, contracting = match.groups()
    (lhs_type, lhs_dims), (rhs_type, rhs_dims) = shapes[lhs], shapes[rhs]
    if skip_dim is not None and skip_dim in lhs_dims + rhs_dims + _dims(out):
      continue
    flops[(lhs_type, rhs_type)] += 2 * math.prod(_dims(out)) * math.prod(lhs_dims[i] for i in _dims(contracting))
  return dict(flops)


def fp8_share(flops: dict[tuple[str, str], float]) -> float:
  total = sum(flops.values())
  return sum(f for (a, b), f in flops.items() if a.startswith('f8') and b.startswith('f8')) / total if total else 0.0


def compile_for_h100(config):
  """(compiled HLO text, compiled step bytes) of `config`'s step on one compile-only H100."""
  from trainer.memory import footprint, gpu_targets
  from trainer.run import job as job_lib
  devices = gpu_targets.devices('h100:1')
  job = job_lib.build_job(config, devices, limit=gpu_targets.memory_limit(devices[0]))
  compiled = footprint.compile_step(job)
  return compiled.as_text(), footprint.compiled_bytes(compiled)


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--config', default='configs/llama_1b.py')
  parser.add_argument('--batch_size', type=int, default=16)
  args = parser.parse_args()
  import importlib.util
  spec = importlib.util.spec_from_file_location('bench_config', args.config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for mode in (None, 'fp8'):
    config = module.get_config()
    config.train.batch_size, config.train.compute_dtype, config.train.quantization = args.batch_size, 'bfloat16', mode
    text, step_bytes = compile_for_h100(config)
    flops = dot_flops_by_operands(text, skip_dim=config.model.vocab_size)
    print(f'{mode or "bf16"}: layer matmul FLOPs in fp8 dots {fp8_share(flops):.1%} '
          f'({ {k: f"{v:.3g}" for k, v in flops.items()} }); compiled step {step_bytes / 2**30:.2f} GiB per device; '
          f'tokens/s and loss after 200 steps: not measured (no GPU)')


if __name__ == '__main__':
  main()
