"""The MoE dispatch split over every device of the mesh: each batch shard routes, sorts and runs its own tokens, and
over the `expert` axis (N > 1 devices) tokens are exchanged all-to-all.

Under `jax.shard_map` over the whole mesh every device takes its own tokens' routing (computed outside, so the
router's health terms stay global means) and the experts' weights with their model dimension gathered, as FSDP
gathers dense weights (the in_specs leave `fsdp` out; the hidden width stays split over `tensor`). With N = 1 on
`expert` (data or fsdp parallelism) it runs the one-device dispatch on its own tokens: expert_math's grouped matmuls,
or capacity buffers its tokens compete for. Without this, GSPMD gathered the global batch's sorted assignments onto
every device and each device ran every token's expert matmuls: moe_1b at batch 64 compiled for 8 H100s with
mesh.data=8 ran 4.77x one eighth of the step's active FLOPs per device (docs/moe.md).

With N > 1 each device holds E/N experts (the 'expert' rule splits the weights; the batch is split over `expert`
too, parallel/mesh.py), sends each assignment (top-k copies of a token) to the device holding its expert, runs its
local experts on what it received (grouped matmuls dropless, batched matmuls on (experts, capacity, d_model) buffers
in capacity mode), sends the results back and combines them with the router weights. Dropless, the exchange is
this module's padded `all_to_all` or expert_ragged.py's `ragged_all_to_all` (model.expert_exchange, `exchange_of`).
An expert's hidden width stays split over `tensor`: each device's down projection is a partial sum over its slice,
summed with one psum over `tensor` at the end (exact up to float rounding).

Why shard_map: under jit GSPMD never produces this exchange. Given expert weights split over `expert` and tokens
split over the batch axes, it gives every device the routing of all tokens and all-reduces the outputs. Measured on
the compiled train step of tests/test_expert_dispatch.py (tiny Llama, 8 experts top-2, mesh fsdp=2 x expert=4, 8
CPU devices): before this module 3 all-to-alls, none a token exchange (GSPMD's resharding of (1, 1, 32, 2, 16)
slices of the combine's output and its gradient), 21 all-reduces and 31 all-gathers; with it 5 all-to-alls (the
forward's rows, their expert ids and the results back; the backward's transposes of the two float ones), 15
all-reduces and 16 all-gathers (benchmarks/bench_expert_dispatch.py prints the counts, BENCHMARKS.md "MoE dispatch").

Static shapes, and what they cost. XLA:CPU has no `ragged_all_to_all` ("HLO opcode `ragged-all-to-all` is not
supported by XLA:CPU ThunkEmitter", jax 0.10.2), so there the exchange is the fixed-size `all_to_all`:
- dropless: each device sends every peer a buffer of its A = T*K assignments' rows (only those routed there filled,
  the rest zeros), the worst case that keeps every token: N*A rows sent and received per device, N times the rows
  routed. Exact at any load. model.expert_buffer_factor f gives each peer's chunk ceil(f*A/N) places instead (about
  f*A rows received): a device's assignments to one peer past that drop, in token order.
- capacity: each device's tokens compete for C = ceil(factor * T*K / E) slots per expert among themselves (GShard's
  groups: the device's tokens are the group), so it sends E*C rows in all, factor * A, whatever N is. Dropped tokens
  can therefore differ from the one-device layer, where all tokens compete; when nothing drops the two are equal.
"""

import contextlib
import contextvars
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from parallel import mesh as mesh_lib
from trainer.models import expert_math, expert_ragged, row_permute

AXIS = 'expert'
TENSOR = 'tensor'  # The axis an expert's hidden width is split over in the shard_map (the default 'expert_mlp' rule).


_COUNTING = contextvars.ContextVar('expert_one_device_for_counting', default=False)


@contextlib.contextmanager
def one_device_for_counting():
  """Within, MoE layers run the one-device dispatch: the same math, but the dropless exchange's ragged_dot runs over
  a receive buffer with room for N times the routed rows, and a jaxpr cannot tell its empty rows from the rest, so
  trainer/observe/flops.py would count the experts' matmuls N times."""
  token = _COUNTING.set(True)
  try:
    yield
  finally:
    _COUNTING.reset(token)


def _send_dropless(x_TD, experts_TK, num_devices: int, local_experts: int, places: int):
  """Per-device buffers of the assignments routed to each device: (rows (N, P, D), local expert (N, P), each
  assignment's place in the flattened buffers (A,), N*P for a dropped one, and the assignment in each place (N*P,),
  A for none). P = `places` per peer: an assignment past its device's first P (in token order) drops. Unused places
  hold zeros and the local expert id E/N (none). Filled by gathers (trainer/models/row_permute.py)."""
  T, K = experts_TK.shape
  A, P = T * K, places
  experts_A = experts_TK.reshape(-1)
  device_A = experts_A // local_experts
  # Place within its device's buffer: its rank among the assignments bound to the same device, in token order.
  onehot_AN = jax.nn.one_hot(device_A, num_devices, dtype=jnp.int32)
  place_A = jnp.sum((jnp.cumsum(onehot_AN, axis=0) - onehot_AN) * onehot_AN, axis=-1)
  slot_A = jnp.where(place_A < P, device_A * P + place_A, num_devices * P)
  # The inverse: device n's place p holds the p-th of its assignments in token order (a stable sort by device).
  by_device_A = jnp.argsort(device_A, stable=True)
  count_N = jnp.sum(onehot_AN, axis=0)
  first_N = jnp.cumsum(count_N) - count_N
  device_S, place_S = jnp.divmod(jnp.arange(num_devices * P), P)  # S = N*P places, device-major.
  held_S = place_S < count_N[device_S]
  source_S = jnp.where(held_S, by_device_A[jnp.minimum(first_N[device_S] + place_S, A - 1)], A)
  rows_NPD = row_permute.take(row_permute.repeat(x_TD, K), source_S, slot_A).reshape(num_devices, P, -1)
  ids_NP = jnp.where(held_S, experts_A[jnp.minimum(source_S, A - 1)] % local_experts, local_experts)
  dropped = jnp.mean((place_A >= P).astype(jnp.float32))
  return rows_NPD, ids_NP.reshape(num_devices, P), slot_A, source_S, dropped


def _local_dropless(rows_RD, ids_R, gate_EDF, up_EDF, down_EFD, local_experts: int, kernel: str):
  """The received rows through their local experts, sorted by expert for the grouped matmuls, in received order."""
  order_R = jnp.argsort(ids_R, stable=True)  # Empty places (id E/N) sort last, outside every group.
  inverse_R = row_permute.inverse(order_R)
  group_sizes_E = expert_math.group_sizes(ids_R, local_experts)
  out_RD = expert_math.swiglu_ragged(row_permute.sort(rows_RD, order_R, inverse_R), gate_EDF, up_EDF, down_EFD,
                                     group_sizes_E, kernel)
  out_RD = jnp.where((ids_R[order_R] < local_experts)[:, None], out_RD, 0)  # Rows outside the groups: zero.
  return row_permute.unsort(out_RD, order_R, inverse_R)


def _dropless(x_TD, experts_TK, weights_TK, gate_EDF, up_EDF, down_EFD, kernel: str,
              buffer_factor: float | None = None):
  """((T, D), dropped fraction): each peer's chunk has room for all A assignments, or with `buffer_factor`
  ceil(factor * A / N) places (a receive buffer of about factor * A rows); those past it drop."""
  T, K = experts_TK.shape
  N = jax.lax.axis_size(AXIS)
  local = gate_EDF.shape[0]
  places = T * K if buffer_factor is None else math.ceil(buffer_factor * T * K / N)
  rows_NPD, ids_NP, slot_A, source_S, dropped = _send_dropless(x_TD, experts_TK, N, local, places)
  # Chunk j to device j; what arrives is stacked by source device.
  got_NPD = jax.lax.all_to_all(rows_NPD, AXIS, 0, 0)
  got_ids_NP = jax.lax.all_to_all(ids_NP, AXIS, 0, 0)
  out_RD = _local_dropless(got_NPD.reshape(-1, got_NPD.shape[-1]), got_ids_NP.reshape(-1), gate_EDF, up_EDF,
                           down_EFD, local, kernel)
  back_NPD = jax.lax.all_to_all(out_RD.reshape(got_NPD.shape), AXIS, 0, 0)  # Results home, by the same chunks.
  out_TKD = row_permute.take(back_NPD.reshape(-1, back_NPD.shape[-1]), slot_A, source_S).reshape(T, K, -1)
  return jnp.einsum('tkd,tk->td', out_TKD, weights_TK.astype(out_TKD.dtype)), dropped


def _with_capacity(x_TD, experts_TK, weights_TK, gate_EDF, up_EDF, down_EFD, capacity_factor: float):
  T, K = experts_TK.shape
  N = jax.lax.axis_size(AXIS)
  local = gate_EDF.shape[0]
  E = N * local
  C = expert_math.capacity_of(capacity_factor, T, K, E)
  slot_TK, kept_TK = expert_math.capacity_slots(experts_TK, E, C)
  slot_TK = jnp.where(kept_TK, slot_TK, C)  # Out of range: the scatter drops it, the gather fills 0.
  x_TKD = jnp.broadcast_to(x_TD[:, None, :], (T, K, x_TD.shape[-1]))
  buffer_ECD = jnp.zeros((E, C, x_TD.shape[-1]), x_TD.dtype).at[experts_TK, slot_TK].set(x_TKD, mode='drop')
  # Experts e of device j are rows j*E/N .. (j+1)*E/N - 1: chunk j of the leading axis.
  got_NeCD = jax.lax.all_to_all(buffer_ECD.reshape(N, local, C, -1), AXIS, 0, 0)
  got_eRD = got_NeCD.transpose(1, 0, 2, 3).reshape(local, N * C, -1)  # Per local expert, every source's slots.
  h_eRF = nn.silu(jnp.einsum('erd,edf->erf', got_eRD, gate_EDF)) * jnp.einsum('erd,edf->erf', got_eRD, up_EDF)
  out_eRD = jnp.einsum('erf,efd->erd', h_eRF, down_EFD)
  out_NeCD = out_eRD.reshape(local, N, C, -1).transpose(1, 0, 2, 3)
  out_ECD = jax.lax.all_to_all(out_NeCD, AXIS, 0, 0).reshape(E, C, -1)
  out_TKD = out_ECD.at[experts_TK, slot_TK].get(mode='fill', fill_value=0)
  out_TD = jnp.einsum('tkd,tk->td', out_TKD, weights_TK.astype(out_TKD.dtype))
  return out_TD, 1.0 - jnp.mean(kept_TK.astype(jnp.float32))


def splits(mesh: Mesh | None, tokens_shape: tuple[int, ...] | None = None) -> bool:
  """Whether the layer runs per device under shard_map: a mesh with more than one device (not while counting FLOPs)
  whose batch axes divide the batch of `tokens_shape` (B, L, ...) and whose context axis divides its length (a
  sampler's single row stays on the one-device dispatch under GSPMD)."""
  if mesh is None or _COUNTING.get() or mesh.size == 1:
    return False
  sizes = dict(mesh.shape)
  batch, length = tokens_shape[:2] if tokens_shape else (0, 0)
  return batch % math.prod(sizes.get(a, 1) for a in mesh_lib.BATCH_AXES) == 0 and length % sizes.get('context', 1) == 0


EXCHANGES = ('auto', 'padded', 'ragged')  # model.expert_exchange.
EXCHANGE_NAMES = {'auto': 'the platform\'s exchange', 'padded': 'padded all_to_all',
                  'ragged': 'ragged_all_to_all (trainer/models/expert_ragged.py)',
                  'emulated': 'ragged_all_to_all emulated on all_to_all (XLA:CPU has no ragged-all-to-all)'}


def exchange_of(requested: str, platform: str) -> str:
  """The dropless exchange over `expert` that runs: 'ragged', 'padded', or 'emulated' (ragged asked for on CPU, whose
  XLA has no ragged-all-to-all: the same offsets over a padded all_to_all). 'auto': ragged on NVIDIA GPUs, where it
  lowers (compiled for an H100, gradient included); padded elsewhere (on TPU not measured here)."""
  if requested == 'auto':
    return 'ragged' if platform == 'gpu' else 'padded'
  return 'emulated' if requested == 'ragged' and platform == 'cpu' else requested


def dispatch(x_BLD, experts_BLK, weights_BLK, gate_EDF, up_EDF, down_EFD, *, mesh: Mesh,
             capacity_factor: float | None, kernel: str = 'ragged_dot', exchange: str = 'padded',
             buffer_factor: float | None = None):
  """(output (B, L, D), dropped fraction or None): the experts' weighted outputs, each device running its own tokens;
  over `expert` (N > 1 devices) tokens travel to their experts' devices and back. Dropless, `buffer_factor` (None:
  room for every assignment) sizes the exchange's receive buffer; the fraction is then reported (0 at N = 1)."""
  tokens = PartitionSpec(mesh_lib.BATCH_AXES, 'context')
  weight_in = PartitionSpec(AXIS, None, TENSOR)  # The model dimension gathered (as fsdp does), the hidden width split.
  weight_out = PartitionSpec(AXIS, TENSOR, None)
  token_axes = mesh_lib.BATCH_AXES + ('context',)
  reported = bool(capacity_factor) or buffer_factor is not None

  def local(x_bld, experts_blk, weights_blk, gate, up, down):
    b, l, d = x_bld.shape
    args = (x_bld.reshape(b * l, d), experts_blk.reshape(b * l, -1), weights_blk.reshape(b * l, -1), gate, up, down)
    n = jax.lax.axis_size(AXIS)
    if capacity_factor:
      if n > 1:
        out_TD, dropped = _with_capacity(*args, capacity_factor)
      else:  # This device's tokens compete for its experts' capacity (GShard's groups), as over `expert`.
        k, experts = args[1].shape[1], gate.shape[0]
        out_TD, dropped = expert_math.with_capacity(
            *args, expert_math.capacity_of(capacity_factor, b * l, k, experts))
    elif n == 1:  # Every expert here: this device's tokens sorted and run on its own.
      out_TD, dropped = expert_math.dropless(*args, kernel), jnp.zeros((), jnp.float32)
    elif exchange in ('ragged', 'emulated'):
      out_TD, dropped = expert_ragged.dropless(*args, kernel, AXIS, emulate=exchange == 'emulated',
                                               buffer_factor=buffer_factor)
    else:
      out_TD, dropped = _dropless(*args, kernel, buffer_factor)
    # Every device's share of the batch is the same size; unreported, a constant (the output is replicated).
    dropped = jax.lax.pmean(dropped, token_axes) if reported else jnp.zeros((), jnp.float32)
    # Each device's hidden slice gives a partial down projection: summed over `tensor`.
    return jax.lax.psum(out_TD, TENSOR).reshape(b, l, d), dropped

  out_BLD, dropped = jax.shard_map(
      local, mesh=mesh, in_specs=(tokens, tokens, tokens, weight_in, weight_in, weight_out),
      out_specs=(tokens, PartitionSpec()))(x_BLD, experts_BLK, weights_BLK, gate_EDF, up_EDF, down_EFD)
  return out_BLD, dropped if reported else None
