"""FLOPs of a traced program: a walk over its jaxpr that counts matmuls and convolutions.

`count(fn, *abstract_args)` traces `fn` with `jax.make_jaxpr` (shapes only:
nothing is allocated or compiled) and adds up, per equation:

- `dot_general`: 2 * batch * contracting * lhs-free * rhs-free elements;
- `ragged_dot_general` (MoE grouped matmuls): each row of the ragged dimension
  meets one group's slice of the other operand only, so 2 * lhs elements *
  rhs-free elements: the active experts' FLOPs, never all experts';
- `conv_general_dilated`: 2 * output elements * the kernel's elements per output
  feature (spatial taps * input features / groups), over the input dilation
  (the zeros a strided convolution's input gradient inserts); taps that fall on
  padding count, as the hardware does them;
- the bodies of higher-order primitives: `scan` times its `length`, `cond` its
  costliest branch, `shard_map` times the devices of its manual axes, `jit`,
  `custom_jvp_call`, `checkpoint` and the others once. A `while` body is counted
  once and the loop reported as unbounded: its trip count is not in the program.

Everything else (elementwise math, reductions, softmax, gathers) is not counted:
the matmuls are the model FLOPs that MFU is about. Rematerialization is not
useful work either: under `jax.grad`, jax traces the forward pass that a
`checkpoint` recomputes for its transpose under the name 'rematted_computation'
(tests/test_flops.py shows a rematted function counting as the plain one), and
those equations are skipped. Custom kernels (Pallas, cuDNN fused attention, FFI
calls) hide their FLOPs: they count 0 and are named in `Count.opaque`, except the launcher's own grouped matmuls
(DECLARED_KERNELS), which declare the active experts' FLOPs.

Unlike `compiled.cost_analysis()`, which counts a scanned loop's body once, this
multiplies each scan body by its trip count, so scanned layers and gradient
accumulation microbatches are all counted.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
from jax import extend

RECOMPUTED = 'rematted_computation'  # jax's name-stack entry for the forward a checkpoint's transpose recomputes.
# The launcher's own Pallas kernels that declare their useful FLOPs (pl.CostEstimate): the experts' grouped matmuls
# (trainer/models/grouped_matmul.py) count the active experts' work, as ragged_dot_general does.
DECLARED_KERNELS = ('grouped_matmul',)
# Primitives whose work runs in a kernel the jaxpr does not describe (prefixes of their names).
OPAQUE_PREFIXES = ('pallas_call', 'dot_product_attention', 'ffi_call', 'custom_call', 'cudnn', 'scaled_matmul')


@dataclasses.dataclass(frozen=True)
class Count:
  """FLOPs of a program, and what the walk could not bound or see."""
  flops: float = 0.0
  unbounded_loops: int = 0  # `while` loops, their bodies counted once.
  opaque: tuple[str, ...] = ()  # Names of custom-kernel primitives met (counted as 0 FLOPs).
  quantized: float = 0.0  # Of `flops`, those of dots whose operands are both 8-bit (fp8 or int8: train.quantization).

  def __add__(self, other: 'Count') -> 'Count':
    return Count(self.flops + other.flops, self.unbounded_loops + other.unbounded_loops,
                 tuple(sorted(set(self.opaque) | set(other.opaque))), self.quantized + other.quantized)

  def times(self, n: int) -> 'Count':
    return dataclasses.replace(self, flops=self.flops * n, quantized=self.quantized * n)


def count(fn: Callable, *args) -> Count:
  """FLOPs of `fn(*args)`; `args` may be `jax.ShapeDtypeStruct`s (pytrees of them)."""
  return count_jaxpr(jax.make_jaxpr(fn)(*args).jaxpr)


def count_jaxpr(jaxpr: extend.core.Jaxpr, scope: str | None = None) -> Count:
  """FLOPs of `jaxpr`'s equations; with `scope`, of those traced inside `jax.named_scope(scope)` only (a train
  step's gradient computation, its optimizer update left out)."""
  total = Count()
  for eqn in jaxpr.eqns:
    name_stack = str(eqn.source_info.name_stack)
    # A recomputed call (a `jit` inside a rematted block) carries the name itself; what is inside it is skipped with it.
    if RECOMPUTED not in name_stack and (scope is None or name_stack.split('/', 1)[0] == scope):
      total += _equation(eqn)
  return total


def _equation(eqn) -> Count:
  name, params = eqn.primitive.name, eqn.params
  if name == 'dot_general':
    flops = _dot_flops(eqn)
    return Count(flops, quantized=flops if all(v.aval.dtype.itemsize == 1 for v in eqn.invars) else 0.0)
  if name == 'ragged_dot_general':
    return Count(_ragged_dot_flops(eqn))
  if name == 'conv_general_dilated':
    return Count(_conv_flops(eqn))
  if name == 'pallas_call' and str(params.get('name', '')).startswith(DECLARED_KERNELS) and params['cost_estimate']:
    return Count(params['cost_estimate'].flops)
  if name.startswith(OPAQUE_PREFIXES):
    return Count(opaque=(name,))
  if name == 'scan':
    return _body(params['jaxpr']).times(params['length'])
  if name == 'while':
    return _body(params['body_jaxpr']) + _body(params['cond_jaxpr']) + Count(unbounded_loops=1)
  if name == 'cond':
    return max((_body(b) for b in params['branches']), key=lambda c: c.flops)
  if name == 'shard_map':
    devices = math.prod(params['mesh'].shape[a] for a in params.get('newly_manual_axes', params['mesh'].axis_names))
    return _body(params['jaxpr']).times(devices)
  total = Count()  # jit, closed_call, custom_jvp_call, custom_vjp_call, checkpoint, ...: each body once.
  for value in params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(sub, (extend.core.ClosedJaxpr, extend.core.Jaxpr)):
        total += _body(sub)
  return total


def _body(jaxpr) -> Count:
  return count_jaxpr(jaxpr.jaxpr if isinstance(jaxpr, extend.core.ClosedJaxpr) else jaxpr)


def _dot_flops(eqn) -> float:
  lhs, rhs = (v.aval.shape for v in eqn.invars)
  (lhs_contract, _), (lhs_batch, _) = eqn.params['dimension_numbers']
  shared = math.prod(lhs[d] for d in (*lhs_contract, *lhs_batch))  # Batch and contracting sizes, in both operands.
  return 2.0 * math.prod(lhs) * math.prod(rhs) / shared


def _ragged_dot_flops(eqn) -> float:
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  numbers = eqn.params['ragged_dot_dimension_numbers']
  (_, rhs_contract), (_, rhs_batch) = numbers.dot_dimension_numbers
  not_free = {*rhs_contract, *rhs_batch, *numbers.rhs_group_dimensions}
  return 2.0 * math.prod(lhs) * math.prod(n for d, n in enumerate(rhs) if d not in not_free)


def _conv_flops(eqn) -> float:
  rhs = eqn.invars[1].aval.shape
  out = eqn.outvars[0].aval.shape
  out_features = rhs[eqn.params['dimension_numbers'].rhs_spec[0]]
  # Each output element is a dot over the kernel's taps for one output feature: spatial * in_features / groups.
  # Also right for the kernel's gradient (batch_group_count): its kernel operand is then the grouped one. The input
  # gradient of a strided convolution dilates its input with zeros (lhs_dilation): only the non-zero taps count.
  dilated = math.prod(eqn.params['lhs_dilation'] or (1,))
  return 2.0 * math.prod(out) * math.prod(rhs) / out_features / dilated
