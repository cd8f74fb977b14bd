"""train.quantization on an H100 or a TPU without one: llama_1b's step compiled for `--topology`, bf16 against fp8/int8.

  python benchmarks/bench_quantization.py [--config=configs/llama_1b.py] [--batch_size=16]   # needs requirements-gpu-plan.txt
  python benchmarks/bench_quantization.py --topology=v5p:2x2x1 [--mode=int8]   # needs requirements-tpu-plan.txt
  python benchmarks/bench_quantization.py --candidates [--h100]   # the libraries compared (issue 56), on CPU / an H100

--candidates: one (2048, 1024) x (1024, 4096) bf16 Dense forward and backward through each candidate quantized dot
on our pins (flax's Fp8DirectDotGeneralOp with its delayed scaling, Qwix's quantized training in fp8 and int8 with
per-tensor current scaling, jax's float8 dot_general with hand-computed scales, forward only): the relative error
of the output and both gradients against float32 on CPU, or with --h100 the operand types of the dots in the
step compiled for one H100.

For each precision it builds the launcher's real Job on one compile-only H100 (trainer/memory/gpu_targets.py),
compiles the step and prints: the share of the transformer-layer matmul FLOPs whose dots take fp8 operands in the
compiled HLO (layer matmuls: every dot without a vocabulary-sized dimension; the output head has one, the attention
core is cuDNN's fused kernel, not a dot), and the compiled step's memory (what `launch.py --plan` reports). The
tokens/s and loss rows of issue 56 need a GPU: "not measured" until one is lent. For a TPU slice (default
--mode=int8) it prints the operand types of the layer matmuls' ops in the compiled HLO (TPU lowers a dot to a
`convolution`; a layer matmul is one whose op_name names an attention projection or an MLP kernel) and the share
that takes 8-bit operands on both sides. tpu7x topologies are described by the pinned libtpu (0.0.51), but any
step compiled for one, bf16 too, fails inside it (RET_CHECK "async-update instruction should have 1 operands").
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


_LAYER_OP = re.compile(r'= \w+\[[\d,]*\]\S* (?:dot|convolution)\(%([\w.\-]+), %([\w.\-]+)\).*?op_name="[^"]*/'
                       r'(?:attention/(?:query|key|value|out)|(?:mlp|shared_expert)/(?:gate|up|down))/[^"]*"')


def layer_op_types(hlo: str) -> dict[tuple[str, str], int]:
  """How many dot or convolution ops of the layer matmuls (by their op_name) a compiled HLO module's text has, by
  their (lhs, rhs) element types."""
  types = {name: dtype for name, dtype, _ in _INSTRUCTION.findall(hlo)}
  return dict(collections.Counter((types[lhs], types[rhs]) for lhs, rhs in _LAYER_OP.findall(hlo)))


def eight_bit(dtype: str, mode: str) -> bool:
  return dtype.startswith('f8') if mode == 'fp8' else dtype == 's8'


def compile_for(config, topology: str = 'h100:1'):
  """(compiled HLO text, compiled step bytes) of `config`'s step on the compile-only devices of `topology`."""
  from trainer.memory import footprint, gpu_targets
  from trainer.observe import flops
  from trainer.run import job as job_lib, plan
  devices = plan.topology_devices(topology)
  limit = (gpu_targets.memory_limit(devices[0]) if gpu_targets.is_gpu_topology(topology) else
           footprint.Limit(plan.HBM_GIB[flops.accelerator_name(devices[0])] * footprint.GIB, topology))
  compiled = footprint.compile_step(job_lib.build_job(config, devices, limit=limit))
  return compiled.as_text(), footprint.compiled_bytes(compiled)


def candidates(h100: bool) -> None:
  """The library comparison of the module docstring, one line per candidate."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import qwix
  from flax.linen import fp8_ops
  B, D, F = 2048, 1024, 4096
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x, g = jax.random.normal(k1, (B, D)), jax.random.normal(k3, (B, F))
  params = {'dense': {'kernel': jax.random.normal(k2, (D, F)) / D ** 0.5}}

  class Dense(nn.Module):
    dot_general_cls: type | None = None

    @nn.compact
    def __call__(self, x):
      extra = {'dot_general_cls': self.dot_general_cls} if self.dot_general_cls else {}
      return nn.Dense(F, use_bias=False, dtype=jnp.bfloat16, name='dense', **extra)(x)

  def qt(forward, backward):
    return qwix.quantize_model(Dense(), qwix.QtProvider([qwix.QtRule(
        module_path='.*', weight_qtype=forward, act_qtype=forward, bwd_qtype=backward, disable_channelwise_axes=True)]))

  flax_fp8 = Dense(fp8_ops.Fp8DirectDotGeneralOp)
  scales = {k: v for k, v in flax_fp8.init(jax.random.key(1), x).items() if k != 'params'}
  models = {'bf16': (Dense(), {}), 'flax Fp8DirectDotGeneralOp (delayed scaling)': (flax_fp8, scales),
            'qwix QT fp8 (current scaling)': (qt(jnp.float8_e4m3fn, jnp.float8_e5m2), {}),
            'qwix QT int8 (current scaling)': (qt(jnp.int8, jnp.int8), {})}

  def step(model, variables):
    def loss(p, x):
      return jnp.sum(model.apply({**variables, 'params': p}, x).astype(jnp.float32) * g)
    return lambda p, x: jax.grad(loss, argnums=(0, 1))(p, x) + (model.apply({**variables, 'params': p}, x),)

  def native(p, x):  # jax's own float8 dot, scales by hand (what a library would hide), forward only.
    w = p['dense']['kernel']
    sx, sw = jnp.max(jnp.abs(x)) / 448, jnp.max(jnp.abs(w)) / 448
    y = jax.lax.dot_general((x / sx).astype(jnp.float8_e4m3fn), (w / sw).astype(jnp.float8_e4m3fn),
                            (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * sx * sw).astype(jnp.bfloat16)
  steps = {name: step(*mv) for name, mv in models.items()}
  steps['jax float8 dot_general (forward only)'] = native
  if h100:
    from trainer.memory import gpu_targets
    sharding = jax.sharding.SingleDeviceSharding(gpu_targets.devices('h100:1')[0])
    shaped = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
    for name, f in steps.items():
      text = jax.jit(f).trace(jax.tree.map(shaped, params), shaped(x)).lower().compile().as_text()
      print(f'{name:45s} H100 dots (lhs, rhs): FLOPs {dot_flops_by_operands(text)}')
    return
  w = params['dense']['kernel']
  rel = lambda a, b: float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
  for name, f in steps.items():
    out = jax.jit(f)(params, x)
    if name.startswith('jax'):
      print(f'{name:45s} relative error: output {rel(out, x @ w):.4f}')
      continue
    (dp, dx, y) = out
    print(f'{name:45s} relative error: output {rel(y, x @ w):.4f}, input gradient {rel(dx, g @ w.T):.4f}, '
          f'kernel gradient {rel(dp["dense"]["kernel"], x.T @ g):.4f}')


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--config', default='configs/llama_1b.py')
  parser.add_argument('--batch_size', type=int, default=16)
  parser.add_argument('--candidates', action='store_true')
  parser.add_argument('--h100', action='store_true')
  parser.add_argument('--topology', default='h100:1', help='an H100 (h100:1) or a TPU slice such as v5p:2x2x1')
  parser.add_argument('--mode', choices=('fp8', 'int8'), help='default: fp8 on a GPU, int8 on a TPU')
  args = parser.parse_args()
  if args.candidates:
    return candidates(args.h100)
  gpu = args.topology.startswith('h100')
  quantized = args.mode or ('fp8' if gpu else 'int8')
  import importlib.util
  spec = importlib.util.spec_from_file_location('bench_config', args.config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for mode in (None, quantized):
    config = module.get_config()
    config.train.batch_size, config.train.compute_dtype, config.train.quantization = args.batch_size, 'bfloat16', mode
    text, step_bytes = compile_for(config, args.topology)
    if not gpu:
      ops = layer_op_types(text)
      share = sum(n for (a, b), n in ops.items() if eight_bit(a, quantized) and eight_bit(b, quantized))
      print(f'{mode or "bf16"}: layer matmul ops in {quantized} {share / sum(ops.values()):.1%} ({ops}); compiled '
            f'step {step_bytes / 2**30:.4f} GiB per device ({args.topology})')
      continue
    flops = dot_flops_by_operands(text, skip_dim=config.model.vocab_size)
    print(f'{mode or "bf16"}: layer matmul FLOPs in fp8 dots {fp8_share(flops):.1%} '
          f'({ {k: f"{v:.3g}" for k, v in flops.items()} }); compiled step {step_bytes / 2**30:.2f} GiB per device; '
          f'tokens/s and loss after 200 steps: not measured (no GPU)')


if __name__ == '__main__':
  main()
