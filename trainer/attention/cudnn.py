"""cuDNN's fused (flash) attention on NVIDIA GPUs, packed rows included.

Shape letters: B batch, L sequence length, H query heads, G key/value heads (G divides H), K head dim, M segments
per row at most.

Unpacked rows go through jax's public `jax.nn.dot_product_attention(implementation='cudnn')`. That API takes
sequence lengths (padding), not segment ids, so packed rows use jax's lower-level packed layout
(jax._src.cudnn.fused_attention_stablehlo.dot_product_attention with q/kv_seqlen [B, M] and q/kv_offsets
[B, M + 1]): each segment of a row is its own sequence to cuDNN, so attention never crosses documents. On an H100
with jax 0.11.2 that layout matched a float32 reference under GQA and ran fwd+bwd 6.6x (MHA) to 9.6x (GQA) faster
than XLA's masked attention (shared/GPU.md). cuDNN cannot run without a GPU, but jax lowers the whole train step
for CUDA on a CPU host (jax.export): tests/test_cuda_lowering.py checks there that the step reaches cuDNN's fused
calls and that no (L, L) scores are left.

The packed layout costs memory by M, the table's segments per row: jax hands cuDNN B * M sequences and keeps their
float32 softmax statistics, (B * M, H, L), for the backward pass. With M = L (the only bound that needs no knowledge
of the data) that is twice the bytes of the (B, H, L, L) bf16 scores the fused kernel exists to avoid: 8 GiB per
layer for llama_1b at batch 16 x 2048. So M comes from the data: data.max_documents_per_row, which trainer/data
checks over the whole dataset before compile.
"""

import re

import jax
import jax.numpy as jnp
from jax._src.cudnn import fused_attention_stablehlo as cudnn_lib

# jax 0.10.2 and 0.11.0 (_fix_seqlen_offsets) multiply the kv offsets by the QUERY heads times head dim, the
# query's stride per token: under GQA the keys/values have G < H heads, so every segment after a row's first reads
# the wrong keys. Fixed upstream in 2026-07; jax 0.11.2 measured right (shared/GPU.md). Before that, GQA + packing
# gets keys/values with each head repeated H/G times, so both strides are equal.
_GQA_OFFSETS_FIXED = tuple(map(int, re.match(r'(\d+)\.(\d+)\.(\d+)', jax.__version__).groups())) >= (0, 11, 2)


# The primitive of cuDNN's forward call as jax.checkpoint policies see it (both jax 0.10.2 and 0.11.2).
FORWARD_PRIMITIVE = cudnn_lib._dot_product_attention_fwd_p_wrapper  # pylint: disable=protected-access


def segments_to_packed(segment_ids_BL, max_segments: int):
  """Segment ids (B, L) -> (seqlens (B, M), offsets (B, M + 1)) of cuDNN's packed layout, M = max_segments.

  A segment is a run of equal ids (trainer/data/documents.py numbers them 1, 2, ... along a row; a padding run,
  e.g. of zeros, is a segment of its own). Row b's m-th run starts at offsets[b, m] and holds seqlens[b, m] tokens;
  entries past a row's last run are -1, as jax's packed API asks; offsets[b, M] is always -1. Runs past M are
  dropped, so M must be at least the most runs a row can hold.
  """
  batch, seq_len = segment_ids_BL.shape
  starts_BL = jnp.concatenate([jnp.ones((batch, 1), bool), segment_ids_BL[:, 1:] != segment_ids_BL[:, :-1]], axis=1)
  run_BL = jnp.cumsum(starts_BL, axis=1, dtype=jnp.int32) - 1  # Which run of its row each token is in.
  rows_BL = jnp.broadcast_to(jnp.arange(batch)[:, None], (batch, seq_len))
  seqlens_BM = jnp.zeros((batch, max_segments), jnp.int32).at[rows_BL, run_BL].add(1, mode='drop')
  seqlens_BM = jnp.where(seqlens_BM > 0, seqlens_BM, -1)
  positions_BL = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (batch, seq_len))
  where_BL = jnp.where(starts_BL, run_BL, max_segments + 1)  # Only run starts land in the table; others drop.
  offsets_BM1 = jnp.full((batch, max_segments + 1), -1, jnp.int32).at[rows_BL, where_BL].set(positions_BL,
                                                                                             mode='drop')
  offsets_BM1 = offsets_BM1.at[:, max_segments].set(-1)
  return seqlens_BM, offsets_BM1


def attention(q_BLHK, k_BLGK, v_BLGK, *, causal: bool, segment_ids_BL=None, max_segments: int | None = None):
  """Softmax(q k^T / sqrt(K)) v by cuDNN; within segments when `segment_ids_BL` is given.

  `max_segments` bounds the segments (runs of equal ids) per row; None takes L, which always holds (a row of L
  tokens has at most L runs) but costs (B * L, H, L) float32 statistics (module docstring).
  """
  if segment_ids_BL is None:
    return jax.nn.dot_product_attention(q_BLHK, k_BLGK, v_BLGK, is_causal=causal, implementation='cudnn')
  num_heads, kv_heads = q_BLHK.shape[2], k_BLGK.shape[2]
  if kv_heads != num_heads and not _GQA_OFFSETS_FIXED:
    k_BLGK = jnp.repeat(k_BLGK, num_heads // kv_heads, axis=2)
    v_BLGK = jnp.repeat(v_BLGK, num_heads // kv_heads, axis=2)
  seqlens_BM, offsets_BM1 = segments_to_packed(segment_ids_BL, max_segments or q_BLHK.shape[1])
  mask = cudnn_lib.MaskType.PADDING_CAUSAL if causal else cudnn_lib.MaskType.PADDING
  return cudnn_lib.dot_product_attention(
      q_BLHK, k_BLGK, v_BLGK, q_seqlen=seqlens_BM, kv_seqlen=seqlens_BM, q_offsets=offsets_BM1,
      kv_offsets=offsets_BM1, scale=q_BLHK.shape[-1] ** -0.5, mask_type=mask, qkv_layout='BTNH')
