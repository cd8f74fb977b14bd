"""Expert parallelism: the MoE dispatch when the `expert` mesh axis has N > 1 devices, tokens exchanged all-to-all.

Each device holds E/N experts (the 'expert' rule splits the weights) and its own tokens (the batch is split over
`expert` too, parallel/mesh.py). Inside `jax.shard_map` every device takes its tokens' routing (computed outside,
so the router's health terms stay global means), sends each assignment (top-k copies of a token) to the device
holding its expert with `jax.lax.all_to_all` over `expert`, runs its local experts on what it received (grouped
matmuls dropless, batched matmuls on (experts, capacity, d_model) buffers in capacity mode), sends the results back
with the reverse all-to-all, and combines them with the router weights. An expert's hidden width stays split over
`tensor`: each device's down projection is a partial sum over its slice, summed with one psum over `tensor` at the
end (exact up to float rounding).

Why shard_map: under jit GSPMD never produces this exchange. Given expert weights split over `expert` and tokens
split over the batch axes, it gives every device the routing of all tokens and all-reduces the outputs. Measured on
the compiled train step of tests/test_expert_dispatch.py (tiny Llama, 8 experts top-2, mesh fsdp=2 x expert=4, 8
CPU devices): before this module 3 all-to-alls, none a token exchange (GSPMD's resharding of (1, 1, 32, 2, 16)
slices of the combine's output and its gradient), 21 all-reduces and 31 all-gathers; with it 5 all-to-alls (the
forward's rows, their expert ids and the results back; the backward's transposes of the two float ones), 15
all-reduces and 16 all-gathers (benchmarks/bench_expert_dispatch.py prints the counts, BENCHMARKS.md "MoE dispatch").

Static shapes, and what they cost. XLA:CPU has no `ragged_all_to_all` ("HLO opcode `ragged-all-to-all` is not
supported by XLA:CPU ThunkEmitter", jax 0.10.2), so the exchange is the fixed-size `all_to_all`:
- dropless: each device sends every peer a buffer of its A = T*K assignments' rows (only those routed there filled,
  the rest zeros), the worst case that keeps every token: N*A rows sent and received per device, N times the rows
  routed. Exact at any load.
- capacity: each device's tokens compete for C = ceil(factor * T*K / E) slots per expert among themselves (GShard's
  groups: the device's tokens are the group), so it sends E*C rows in all, factor * A, whatever N is. Dropped tokens
  can therefore differ from the one-device layer, where all tokens compete; when nothing drops the two are equal.
"""

import contextlib
import contextvars

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from parallel import mesh as mesh_lib
from trainer.models import expert_math

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


def size(mesh: Mesh | None) -> int:
  """Devices on the expert axis the dispatch exchanges tokens over; 1 without a mesh, and while counting FLOPs."""
  return 1 if mesh is None or _COUNTING.get() else dict(mesh.shape).get(AXIS, 1)


def _send_dropless(x_TD, experts_TK, num_devices: int, local_experts: int):
  """Per-device buffers of the assignments routed to each device: (rows (N, A, D), local expert (N, A), and each
  assignment's (device, place)). Unused places hold zeros and the local expert id E/N (none)."""
  T, K = experts_TK.shape
  A = T * K
  experts_A = experts_TK.reshape(-1)
  device_A = experts_A // local_experts
  # Place within its device's buffer: its rank among the assignments bound to the same device, in token order.
  onehot_AN = jax.nn.one_hot(device_A, num_devices, dtype=jnp.int32)
  place_A = jnp.sum((jnp.cumsum(onehot_AN, axis=0) - onehot_AN) * onehot_AN, axis=-1)
  rows_NAD = jnp.zeros((num_devices, A, x_TD.shape[-1]), x_TD.dtype).at[device_A, place_A].set(
      jnp.repeat(x_TD, K, axis=0))
  ids_NA = jnp.full((num_devices, A), local_experts, jnp.int32).at[device_A, place_A].set(experts_A % local_experts)
  return rows_NAD, ids_NA, device_A, place_A


def _local_dropless(rows_RD, ids_R, gate_EDF, up_EDF, down_EFD, local_experts: int):
  """The received rows through their local experts, sorted by expert for the grouped matmuls, in received order."""
  order_R = jnp.argsort(ids_R, stable=True)  # Empty places (id E/N) sort last, outside every group.
  group_sizes_E = jnp.sum(jax.nn.one_hot(ids_R, local_experts, dtype=jnp.int32), axis=0)
  out_RD = expert_math.swiglu_ragged(rows_RD[order_R], gate_EDF, up_EDF, down_EFD, group_sizes_E)
  out_RD = jnp.where((ids_R[order_R] < local_experts)[:, None], out_RD, 0)  # Rows outside the groups: zero.
  return out_RD[jnp.argsort(order_R)]


def _dropless(x_TD, experts_TK, weights_TK, gate_EDF, up_EDF, down_EFD):
  T, K = experts_TK.shape
  N = jax.lax.axis_size(AXIS)
  local = gate_EDF.shape[0]
  rows_NAD, ids_NA, device_A, place_A = _send_dropless(x_TD, experts_TK, N, local)
  # Chunk j to device j; what arrives is stacked by source device.
  got_NAD = jax.lax.all_to_all(rows_NAD, AXIS, 0, 0)
  got_ids_NA = jax.lax.all_to_all(ids_NA, AXIS, 0, 0)
  out_RD = _local_dropless(got_NAD.reshape(-1, got_NAD.shape[-1]), got_ids_NA.reshape(-1), gate_EDF, up_EDF,
                           down_EFD, local)
  back_NAD = jax.lax.all_to_all(out_RD.reshape(got_NAD.shape), AXIS, 0, 0)  # Results home, by the same chunks.
  out_TKD = back_NAD[device_A, place_A].reshape(T, K, -1)
  return jnp.einsum('tkd,tk->td', out_TKD, weights_TK.astype(out_TKD.dtype)), None


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


def dispatch(x_BLD, experts_BLK, weights_BLK, gate_EDF, up_EDF, down_EFD, *, mesh: Mesh,
             capacity_factor: float | None):
  """(output (B, L, D), dropped fraction or None): the experts' weighted outputs, tokens exchanged over `expert`."""
  tokens = PartitionSpec(mesh_lib.BATCH_AXES, 'context')
  weight_in = PartitionSpec(AXIS, None, TENSOR)  # The model dimension gathered (fsdp), the hidden width split.
  weight_out = PartitionSpec(AXIS, TENSOR, None)
  token_axes = mesh_lib.BATCH_AXES + ('context',)

  def local(x_bld, experts_blk, weights_blk, gate, up, down):
    b, l, d = x_bld.shape
    args = (x_bld.reshape(b * l, d), experts_blk.reshape(b * l, -1), weights_blk.reshape(b * l, -1), gate, up, down)
    if capacity_factor:
      out_TD, dropped = _with_capacity(*args, capacity_factor)
      dropped = jax.lax.pmean(dropped, token_axes)  # Every device's share of the batch is the same size.
    else:
      out_TD, dropped = _dropless(*args)
      dropped = jnp.zeros((), jnp.float32)
    # Each device's hidden slice gives a partial down projection: summed over `tensor`.
    return jax.lax.psum(out_TD, TENSOR).reshape(b, l, d), dropped

  out_BLD, dropped = jax.shard_map(
      local, mesh=mesh, in_specs=(tokens, tokens, tokens, weight_in, weight_in, weight_out),
      out_specs=(tokens, PartitionSpec()))(x_BLD, experts_BLK, weights_BLK, gate_EDF, up_EDF, down_EFD)
  return out_BLD, dropped if capacity_factor else None
