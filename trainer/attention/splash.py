"""Splash attention, jax's Pallas/Mosaic flash-attention kernel for TPU, with segment ids for packed rows.

Shape letters: B batch, L sequence length, H query heads, G key/value heads (G divides H), K head dim.

The kernel works on one sequence, (H, L, K) queries and (G, L, K) keys/values with GQA native; it is vmapped over
the batch. It never materializes the (L, L) scores: blocks of queries and keys stream through VMEM, and blocks the
mask rules out (above the causal diagonal) are skipped.

Mosaic kernels are not auto-partitioned by GSPMD: under jit with a mesh the call is wrapped in `jax.shard_map`
over the axes that the logical rules give the batch ('batch') and the heads ('heads', 'kv_heads'), so each device
runs the kernel on its own rows and heads. Per-device strategies (shard_map, pmap) already hand the model its
local shards and call the kernel directly. Off TPU the kernel runs in Pallas interpret mode (slow, for tests).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

# Block sizes tried, largest first: MaxText's default for long sequences is 512; a block must be a multiple of the
# TPU's 128 lanes and divide the sequence length (checked by choice.splash_limit).
BLOCK_CANDIDATES = (512, 256, 128)


def _splash():
  """jax's splash-attention package, imported on first use: every launch imports this module, and the import took
  0.2-0.3 s of CPU on a machine that never runs the kernel (benchmarks/bench_launch_imports.py)."""
  from jax.experimental.pallas.ops.tpu import splash_attention  # pylint: disable=import-outside-toplevel
  return splash_attention


def segment_ids(q_ids, kv_ids):
  """Splash's SegmentIds for the queries' and the keys' document ids."""
  return _splash().SegmentIds(q_ids, kv_ids)


def block_sizes(seq_len: int):
  """Splash's BlockSizes for a row of `seq_len` (its largest block in BLOCK_CANDIDATES that divides it)."""
  block = next(b for b in BLOCK_CANDIDATES if seq_len % b == 0)
  return _splash().BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)


@functools.lru_cache(maxsize=64)
def kernel(q_len: int, kv_len: int, num_heads: int, *, causal: bool, offset: int = 0, interpret: bool = False):
  """Splash's kernel for (q_len, kv_len) scores over `num_heads` heads: causal with query i at key position
  `offset` + i, or full; one per process for each shape.

  Making one processes its mask on the host block by block (jax's splash_attention_mask_info), for the forward
  pass, dq and dkv, and a launch traces the step several times (shapes, FLOPs, memory, compile). jax keeps only the
  12 newest processed masks, and a row split over context=4 has 16 (two query chunks a device, four devices; the
  forward pass and dkv each), so every trace processed them all again: planning configs/llama_1b_long.py at 32,768
  tokens for v5p:2x2x4 processed masks 96 times (31 s on the 2-core CPU machine) where 16 (4 s) do, and their cost
  grows with the square of the row (BENCHMARKS.md "Long sequences").
  """
  splash = _splash()
  shape = (q_len, kv_len)
  mask = splash.CausalMask(shape, offset=offset) if causal else splash.FullMask(shape)
  # Called while a step is traced: the kernel's block maps (jnp arrays) would be that trace's values and leak into
  # the next one; made eagerly they are constants every trace can hold.
  with jax.ensure_compile_time_eval():
    return splash.make_splash_mha(splash.MultiHeadMask([mask] * num_heads), block_sizes=block_sizes(q_len),
                                  head_shards=1, q_seq_shards=1, interpret=interpret)


def _local_attention(q_BLHK, k_BLGK, v_BLGK, segment_ids_BL, *, causal: bool, interpret: bool):
  """The kernel over this device's rows and heads."""
  _, seq_len, num_heads, head_dim = q_BLHK.shape
  attend = kernel(seq_len, seq_len, num_heads, causal=causal, interpret=interpret)
  # The kernel does not scale the logits: queries take the 1/sqrt(K) here.
  q_BHLK = jnp.swapaxes(q_BLHK * jnp.asarray(head_dim ** -0.5, q_BLHK.dtype), 1, 2)
  k_BGLK, v_BGLK = jnp.swapaxes(k_BLGK, 1, 2), jnp.swapaxes(v_BLGK, 1, 2)
  if segment_ids_BL is None:
    out_BHLK = jax.vmap(attend)(q_BHLK, k_BGLK, v_BGLK)
  else:
    ids_BL = segment_ids_BL.astype(jnp.int32)
    out_BHLK = jax.vmap(lambda q, k, v, ids: attend(q, k, v, segment_ids=segment_ids(ids, ids)))(
        q_BHLK, k_BGLK, v_BGLK, ids_BL)
  return jnp.swapaxes(out_BHLK, 1, 2)


def attention(q_BLHK, k_BLGK, v_BLGK, *, causal: bool, segment_ids_BL=None, mesh: Mesh | None = None, rules=(),
              interpret: bool = False):
  """Softmax(q k^T / sqrt(K)) v by splash attention; sharded by hand over `mesh` when one is given."""
  local = functools.partial(_local_attention, causal=causal, interpret=interpret)
  if mesh is None:
    return local(q_BLHK, k_BLGK, v_BLGK, segment_ids_BL)
  q_spec = nn.logical_to_mesh_axes(('batch', 'length', 'heads', 'head_dim'), rules)
  kv_spec = nn.logical_to_mesh_axes(('batch', 'length', 'kv_heads', 'head_dim'), rules)
  # The kernel sees whole sequences and whole heads: only rows and heads are split.
  q_spec = jax.sharding.PartitionSpec(q_spec[0], None, q_spec[2], None)
  kv_spec = jax.sharding.PartitionSpec(kv_spec[0], None, kv_spec[2], None)
  ids_spec = jax.sharding.PartitionSpec(q_spec[0], None)
  if segment_ids_BL is None:
    fn = jax.shard_map(lambda q, k, v: local(q, k, v, None), mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec),
                       out_specs=q_spec, check_vma=False)
    return fn(q_BLHK, k_BLGK, v_BLGK)
  fn = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, ids_spec), out_specs=q_spec,
                     check_vma=False)
  return fn(q_BLHK, k_BLGK, v_BLGK, segment_ids_BL)
