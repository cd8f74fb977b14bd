"""Exact attention when the sequence is split over the `context` mesh axis: an all-gather or a ring of keys/values.

Shape letters: B batch, L sequence length (l: this device's part, L / C), H query heads, G key/value heads, K head dim.

Each device holds l = L / C tokens of every row, in the balanced order of parallel/context.py. Inside a shard_map
over the whole mesh, two schemes (model.context_scheme) bring each device's queries the whole row's keys/values:

- 'all-gather': gather the keys, values and segment ids of the full row over `context` (tiled: device r's part
  lands at r*l) and attend with the local queries against all of them; the backward pass of the gather is a
  reduce-scatter of the key/value gradients, which jax derives.
- 'ring': C steps; at each the device attends to the block it holds, passes it on with `ppermute` (sent before the
  block computes, so the transfer can overlap it), and merges the part with an online softmax (running max and sum,
  float32). Under the balanced order every causal block off the diagonal is exactly half visible, and the ring
  computes that half only; each block's scores are recomputed in the backward pass (jax.checkpoint), so a device
  holds one (l, l/2) block of scores at a time. Plain jax autodiff: the ppermutes transpose to the reverse ring.

Masks are built from each token's *original* position (`context.order`), never from its place in the balanced row,
so causality and packed documents are exact however the row was reordered.

Why 'auto' takes the all-gather where splash runs its blocks and the ring elsewhere, measured side by side
(BENCHMARKS.md "Long sequences"): with XLA blocks the all-gather computes the full (l, L) scores, the masked half
included, and keeps them for the backward pass; the ring computes the visible half and keeps none.
- CPU step time (`python benchmarks/bench_context.py --steps=3 --seq_len=1024`: 2 shared, loaded cores, 8 fake
  devices, the default LM at batch 8 x 1024, float32, 3 alternating rounds; two runs): ring / all-gather 0.56 and
  0.72 at context 2, 0.63 and 0.73 at context 4.
- Per-chip temporaries planned for v5p:2x2x4 (libtpu 0.0.51, XLA blocks for both, tests/test_context_plan.py's
  one-layer config: 4 x 16,384 tokens, fsdp 4 x context 4, bfloat16): ring 1,815,003,136 bytes, all-gather
  6,724,534,272 (0.27x). The all-gather with splash blocks needs 279,281,664 (that test), less than either.
Splash already skips the masked blocks and never holds scores, so on TPU the all-gather keeps its single collective,
which XLA overlaps with the projections (MaxText's default there too); the ring would save it only the gathered
keys/values, small at grouped-query widths (llama_1b: 1 KiB a token in bfloat16). Not measured: interconnect time
on any accelerator (none lent), and GPUs, where 'auto' takes the ring on the same FLOP and memory argument as CPU.

The all-gather's per-device block: on TPU, splash attention (what 'auto' picks there) once per query chunk against
the whole row in its original order, with a causal mask offset to the chunk's start. Offsets are static in splash's
masks and differ per device, so a `lax.switch` on the device's index holds one static pair per device; blocks above
the diagonal are skipped, which is where the balanced order pays (parallel/context.py: causal_work). Elsewhere (CPU,
and GPUs for now: cuDNN's masks are causal from position 0 only), XLA's attention with an explicit (l, L) mask built
from original positions. The ring's blocks are its own einsums; it runs no fused kernel.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from parallel import context as context_lib
from trainer.attention import splash
from trainer.attention.choice import SPLASH_LANES, SPLASH_TPU_HEAD_DIM_MULTIPLE
from trainer.base.errors import UserError

SCHEMES = ('auto', 'all-gather', 'ring')  # model.context_scheme; the one that runs is recorded in the run manifest.
RING_BLOCK = 'blocks of XLA einsums merged by an online softmax, causal halves skipped'


def scheme_for(setting: str, kernel_setting: str, platform: str, seq_len: int, parts: int,
               head_dim: int) -> tuple[str, str, str]:
  """(scheme, per-device kernel, why) for model.context_scheme=`setting` and model.attention=`kernel_setting`.

  'auto' is the rule of the module docstring's "Why": the all-gather where splash runs its blocks, else the ring.
  """
  if setting not in SCHEMES:
    raise UserError(f'model.context_scheme={setting!r} is not a scheme; choose one of {SCHEMES}.')
  if setting == 'ring':
    if kernel_setting in ('splash', 'cudnn'):
      raise UserError(f"model.context_scheme='ring' computes its own blocks and cannot run "
                      f"model.attention={kernel_setting!r}: set model.attention to 'auto' or 'xla', or "
                      f"model.context_scheme to 'all-gather'.")
    return 'ring', 'xla', f'named in the config; {RING_BLOCK}'
  kernel, why = kernel_for(platform, kernel_setting, seq_len, parts, head_dim)
  if setting == 'all-gather':
    return 'all-gather', kernel, f'named in the config; {why}'
  if kernel == 'splash':
    return 'all-gather', kernel, f'splash skips masked blocks and holds no scores; {why}'
  return 'ring', 'xla', f'faster than the all-gather with XLA blocks ({why}); {RING_BLOCK}'


def kernel_for(platform: str, setting: str, seq_len: int, parts: int, head_dim: int) -> tuple[str, str]:
  """(per-device kernel, why) for attention across `parts` devices; 'splash' or 'xla' (see the module docstring)."""
  chunk = seq_len // context_lib.chunks(parts)
  if setting == 'cudnn':
    raise UserError(f"model.attention='cudnn' cannot run across mesh.context={parts}: its masks are causal from "
                    f"position 0 only, and each device holds two chunks from different places of the row. Set "
                    f"model.attention to 'auto' or 'xla'.")
  if setting == 'splash' or (setting == 'auto' and platform == 'tpu'):
    if chunk % SPLASH_LANES == 0 and (platform != 'tpu' or head_dim % SPLASH_TPU_HEAD_DIM_MULTIPLE == 0):
      return 'splash', f'splash per chunk of {chunk} tokens against the gathered row'
    failed = (f'splash needs chunks (data.seq_len / 2 / mesh.context = {chunk}) that are a multiple of '
              f'{SPLASH_LANES} and, on TPU, a head dim that is a multiple of {SPLASH_TPU_HEAD_DIM_MULTIPLE}')
    if setting == 'splash':
      raise UserError(f"model.attention='splash' cannot run across mesh.context={parts}: {failed}. Set "
                      f"model.attention to 'auto' (or 'xla'), or change data.seq_len.")
    return 'xla', f'fell back: {failed}'
  return 'xla', 'explicit position masks' + (' (cuDNN masks are causal from position 0 only)'
                                             if platform == 'gpu' else '')


def _splash_local(q_BlHK, k_BLGK, v_BLGK, ids_Bl, ids_BL, *, causal: bool, seq_len: int, parts: int,
                  interpret: bool):
  """Splash once per query chunk against the row in original order; one static mask pair per device index."""
  chunk, heads = seq_len // context_lib.chunks(parts), q_BlHK.shape[2]
  original = np.argsort(context_lib.order(seq_len, parts))  # Balanced places of the tokens in original order.
  k_BLGK, v_BLGK = k_BLGK[:, original], v_BLGK[:, original]
  ids_BL = None if ids_BL is None else ids_BL[:, original].astype(jnp.int32)
  q_BHlK = jnp.swapaxes(q_BlHK * jnp.asarray(q_BlHK.shape[-1] ** -0.5, q_BlHK.dtype), 1, 2)
  k_BGLK, v_BGLK = jnp.swapaxes(k_BLGK, 1, 2), jnp.swapaxes(v_BLGK, 1, 2)

  def run(first: int, q_BHcK, ids_Bc):
    # A full mask has no offset: one kernel serves every chunk of a non-causal row.
    kernel = splash.kernel(chunk, seq_len, heads, causal=causal, offset=first if causal else 0, interpret=interpret)
    if ids_BL is None:
      return jax.vmap(kernel)(q_BHcK, k_BGLK, v_BGLK)
    return jax.vmap(lambda q, k, v, qi, ki: kernel(q, k, v, segment_ids=splash.segment_ids(qi, ki)))(
        q_BHcK, k_BGLK, v_BGLK, ids_Bc.astype(jnp.int32), ids_BL)

  def branch(device: int):  # Device r holds chunks r and 2C-1-r (parallel/context.py).
    firsts = [chunk * i for i in (device, context_lib.chunks(parts) - 1 - device)]

    def compute(q_BHlK, ids_Bl):
      halves = [run(first, q_BHlK[:, :, i * chunk:(i + 1) * chunk],
                    None if ids_Bl is None else ids_Bl[:, i * chunk:(i + 1) * chunk]) for i, first in enumerate(firsts)]
      return jnp.concatenate(halves, axis=2)
    return compute

  if causal:
    out_BHlK = jax.lax.switch(jax.lax.axis_index(context_lib.AXIS), [branch(r) for r in range(parts)], q_BHlK, ids_Bl)
  else:  # Every chunk sees the whole row: one mask for every device.
    out_BHlK = branch(0)(q_BHlK, ids_Bl)
  return jnp.swapaxes(out_BHlK, 1, 2)


NEG = -1e30  # A masked score: finite, so a query that sees no key of a block gives exp(NEG - NEG) = 1, never NaN.


def _block(q_BlGRK, k_BsGK, v_BsGK, mask_Bls):
  """One key/value block's part of this device's attention, unnormalized: (max, sum, accumulated values), float32.

  R: query heads per key/value head. Scores in float32 whatever the compute dtype; the max is a stabilizer the
  result does not depend on (it cancels between `sum` and `acc`), so no gradient flows through it."""
  scale = q_BlGRK.shape[-1] ** -0.5
  s_BGRls = jnp.einsum('blgrk,bsgk->bgrls', q_BlGRK, k_BsGK, preferred_element_type=jnp.float32) * scale
  if mask_Bls is not None:
    s_BGRls = jnp.where(mask_Bls[:, None, None], s_BGRls, NEG)
  m_BGRl = jax.lax.stop_gradient(jnp.max(s_BGRls, axis=-1))
  p_BGRls = jnp.exp(s_BGRls - m_BGRl[..., None])
  if mask_Bls is not None:  # A fully masked row would otherwise count each of its keys once (exp(0)).
    p_BGRls = jnp.where(mask_Bls[:, None, None], p_BGRls, 0)
  # Probabilities in the values' dtype, accumulated in float32, as XLA's and the fused kernels' attention do.
  acc_BGRlK = jnp.einsum('bgrls,bsgk->bgrlk', p_BGRls.astype(v_BsGK.dtype), v_BsGK, preferred_element_type=jnp.float32)
  return m_BGRl, jnp.sum(p_BGRls, axis=-1), acc_BGRlK


# Flash attention's trade: each block's scores are recomputed in the backward pass instead of kept, so a device holds
# one (l, l) block of scores at a time rather than (l, L) for the whole row, which is the ring's point.
_block_remat = jax.checkpoint(_block)


def _merge(run, part):
  """The online softmax: two partial (max, sum, acc) of the same queries over disjoint keys, as one."""
  (m0, s0, a0), (m1, s1, a1) = run, part
  m = jnp.maximum(m0, m1)
  w0, w1 = jnp.exp(m0 - m), jnp.exp(m1 - m)
  return m, s0 * w0 + s1 * w1, a0 * w0[..., None] + a1 * w1[..., None]


def _ring_local(q_BlHK, k_BlGK, v_BlGK, ids_Bl, *, causal: bool, seq_len: int, parts: int):
  """This device's queries against every device's keys/values, one block a step, passed around the ring.

  Step s holds the block of device j = r - s (mod C). Under the balanced order device r holds chunks (r, 2C-1-r),
  so for causal rows the blocks off the diagonal are half visible and half not, wholly: j < r, every query of r sees
  j's first chunk and none of its second; j > r, r's second chunk sees both of j's chunks and r's first sees
  neither. Each off-diagonal step computes that half only (a `lax.cond` on the device index), exactly, with no
  position mask; only the diagonal step (s = 0) masks by original position. Segment ids travel with the block.
  """
  axis, local = context_lib.AXIS, seq_len // parts
  chunk = local // 2
  (batch, _, heads, head_dim), kv_heads = q_BlHK.shape, k_BlGK.shape[2]
  q_BlGRK = q_BlHK.reshape(batch, local, kv_heads, heads // kv_heads, head_dim)
  me = jax.lax.axis_index(axis)
  where_L = jnp.asarray(context_lib.order(seq_len, parts), jnp.int32)
  where_l = jax.lax.dynamic_slice_in_dim(where_L, me * local, local)
  ring = [(i, (i + 1) % parts) for i in range(parts)]

  def segments(q_ids, k_ids):
    return None if q_ids is None else q_ids[:, :, None] == k_ids[:, None, :]

  def empty(rows):  # No key seen yet: merging it with any part gives that part.
    shape = (batch, kv_heads, heads // kv_heads, rows)
    return jnp.full(shape, NEG, jnp.float32), jnp.zeros(shape, jnp.float32), jnp.zeros(shape + (head_dim,), jnp.float32)

  def earlier(k, v, ids):  # j < r: all of r's queries against j's first chunk.
    return _block_remat(q_BlGRK, k[:, :chunk], v[:, :chunk],
                        None if ids is None else segments(ids_Bl, ids[:, :chunk]))

  def later(k, v, ids):  # j > r: r's second chunk against all of j; r's first chunk sees nothing of it.
    half = _block_remat(q_BlGRK[:, chunk:], k, v, None if ids is None else segments(ids_Bl[:, chunk:], ids))
    return tuple(jnp.concatenate([e, h], axis=3) for e, h in zip(empty(chunk), half))

  k, v, ids = k_BlGK, v_BlGK, ids_Bl
  run = empty(local)
  for step in range(parts):
    if step + 1 < parts:  # Sent before this step's block computes, so the transfer can overlap it.
      k_next, v_next, ids_next = jax.lax.ppermute((k, v, ids), axis, ring)
    if step == 0:
      mask = segments(ids_Bl, ids)
      if causal:
        seen = (where_l[None, :] <= where_l[:, None])[None]
        mask = seen if mask is None else mask & seen
      part = _block_remat(q_BlGRK, k, v, mask)
    elif causal:
      part = jax.lax.cond(me >= step, earlier, later, k, v, ids)
    else:
      part = _block_remat(q_BlGRK, k, v, segments(ids_Bl, ids))
    run = _merge(run, part)
    if step + 1 < parts:
      k, v, ids = k_next, v_next, ids_next
  _, total_BGRl, acc_BGRlK = run
  out_BGRlK = acc_BGRlK / jnp.where(total_BGRl > 0, total_BGRl, 1)[..., None]  # Every token sees itself: > 0.
  return jnp.moveaxis(out_BGRlK, 3, 1).reshape(q_BlHK.shape).astype(q_BlHK.dtype)


def _local(q_BlHK, k_BlGK, v_BlGK, ids_Bl, *, causal: bool, seq_len: int, parts: int, kernel: str,
           interpret: bool):
  """This device's queries against the whole row's keys and values (gathered over `context`)."""
  axis = context_lib.AXIS
  gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
  k_BLGK, v_BLGK = gather(k_BlGK), gather(v_BlGK)
  if kernel == 'splash':
    return _splash_local(q_BlHK, k_BLGK, v_BLGK, ids_Bl, None if ids_Bl is None else gather(ids_Bl), causal=causal,
                         seq_len=seq_len, parts=parts, interpret=interpret)
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


def attention(q_BLHK, k_BLGK, v_BLGK, *, causal: bool, segment_ids_BL, mesh: Mesh, rules, kernel: str = 'xla',
              scheme: str = 'all-gather', interpret: bool = False):
  """Softmax(q k^T / sqrt(K)) v of rows in the balanced order, split over mesh axis `context`; same order out.

  `scheme`: 'all-gather' or 'ring' (scheme_for decides). `kernel`: all-gather's per-device block, 'xla' or 'splash'
  (kernel_for decides; `interpret` runs splash off TPU); the ring computes its blocks itself.
  """
  parts, seq_len = mesh.shape[context_lib.AXIS], q_BLHK.shape[1]
  q_axes = nn.logical_to_mesh_axes(('batch', 'length', 'heads', 'head_dim'), rules)
  kv_axes = nn.logical_to_mesh_axes(('batch', 'length', 'kv_heads', 'head_dim'), rules)
  # Rows and heads stay split as the rules say; the sequence is split over `context`, the head dim is whole.
  q_spec = PartitionSpec(q_axes[0], context_lib.AXIS, q_axes[2], None)
  kv_spec = PartitionSpec(kv_axes[0], context_lib.AXIS, kv_axes[2], None)
  ids_spec = PartitionSpec(q_axes[0], context_lib.AXIS)

  def local(q, k, v, ids=None):
    if scheme == 'ring':
      return _ring_local(q, k, v, ids, causal=causal, seq_len=seq_len, parts=parts)
    return _local(q, k, v, ids, causal=causal, seq_len=seq_len, parts=parts, kernel=kernel, interpret=interpret)

  # Mosaic kernels carry no varying-axes types: splash runs unchecked, as trainer/attention/splash.py does.
  sharded = functools.partial(jax.shard_map, mesh=mesh, out_specs=q_spec,
                              check_vma=scheme == 'ring' or kernel != 'splash')
  if segment_ids_BL is None:
    return sharded(local, in_specs=(q_spec, kv_spec, kv_spec))(q_BLHK, k_BLGK, v_BLGK)
  return sharded(local, in_specs=(q_spec, kv_spec, kv_spec, ids_spec))(q_BLHK, k_BLGK, v_BLGK, segment_ids_BL)
