"""Exact attention when the sequence is split over the `context` mesh axis: all-gather of keys and values.

Shape letters: B batch, L sequence length (l: this device's part, L / C), H query heads, G key/value heads, K head dim.

Each device holds l = L / C tokens of every row, in the balanced order of parallel/context.py. Inside a shard_map
over the whole mesh, each device gathers the keys, values and segment ids of the full row over `context` (tiled:
device r's part lands at r*l) and attends with its own queries against all of them. Masks are built from each
token's *original* position (`context.order`), never from its place in the balanced row, so causality and packed
documents are exact however the row was reordered. The backward pass of the gather is a reduce-scatter of the
key/value gradients, which jax derives.

Why all-gather and not a ring (ppermute of key/value blocks with an online softmax): the gathered keys and values
of one layer are G/H of the query's size times L, small next to the activations the split saves (for llama_1b,
8 key/value heads of 64 = 1 KiB a token in bfloat16), and one collective that XLA overlaps with the projections is
simpler than C - 1 dependent steps; it is MaxText's default on TPU for the same reason. A ring pays off when even
the gathered keys/values of a layer no longer fit, far beyond 128k tokens at these widths.

The per-device block uses XLA's attention with an explicit (l, L) mask: the fused kernels take static masks (causal
from position 0), and a device's queries here are two chunks from different places of the row.
"""

import jax
import jax.numpy as jnp
import flax.linen as nn
from jax.sharding import Mesh, PartitionSpec

from parallel import context as context_lib

SCHEME = 'all-gather'  # Of keys/values over the context axis; recorded in the run manifest.
KERNEL = 'xla'  # The per-device block: XLA's attention with an explicit mask (see the module docstring).


def _local(q_BlHK, k_BlGK, v_BlGK, ids_Bl, *, causal: bool, seq_len: int, parts: int):
  """This device's queries against the whole row's keys and values (gathered over `context`)."""
  axis = context_lib.AXIS
  gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
  k_BLGK, v_BLGK = gather(k_BlGK), gather(v_BlGK)
  where_L = jnp.asarray(context_lib.order(seq_len, parts), jnp.int32)  # Original position at each place.
  local = seq_len // parts
  where_l = jax.lax.dynamic_slice_in_dim(where_L, jax.lax.axis_index(axis) * local, local)
  mask_B1lL = jnp.ones((1, 1, local, seq_len), bool)
  if causal:
    mask_B1lL = mask_B1lL & (where_L[None, :] <= where_l[:, None])[None, None]
  if ids_Bl is not None:
    ids_BL = gather(ids_Bl)
    mask_B1lL = mask_B1lL & (ids_Bl[:, None, :, None] == ids_BL[:, None, None, :])
  return jax.nn.dot_product_attention(q_BlHK, k_BLGK, v_BLGK, mask=mask_B1lL, implementation='xla')


def attention(q_BLHK, k_BLGK, v_BLGK, *, causal: bool, segment_ids_BL, mesh: Mesh, rules):
  """Softmax(q k^T / sqrt(K)) v of rows in the balanced order, split over mesh axis `context`; same order out."""
  parts, seq_len = mesh.shape[context_lib.AXIS], q_BLHK.shape[1]
  q_axes = nn.logical_to_mesh_axes(('batch', 'length', 'heads', 'head_dim'), rules)
  kv_axes = nn.logical_to_mesh_axes(('batch', 'length', 'kv_heads', 'head_dim'), rules)
  # Rows and heads stay split as the rules say; the sequence is split over `context`, the head dim is whole.
  q_spec = PartitionSpec(q_axes[0], context_lib.AXIS, q_axes[2], None)
  kv_spec = PartitionSpec(kv_axes[0], context_lib.AXIS, kv_axes[2], None)
  ids_spec = PartitionSpec(q_axes[0], context_lib.AXIS)

  def local(q, k, v, ids=None):
    return _local(q, k, v, ids, causal=causal, seq_len=seq_len, parts=parts)

  if segment_ids_BL is None:
    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec)(
        q_BLHK, k_BLGK, v_BLGK)
  return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, ids_spec), out_specs=q_spec)(
      q_BLHK, k_BLGK, v_BLGK, segment_ids_BL)
