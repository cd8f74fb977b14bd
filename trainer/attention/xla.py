"""XLA's dot-product attention: runs on every platform, materializing the (B, H, L, L) scores.

Shape letters: B batch, L sequence length, H query heads, G key/value heads (G divides H), K head dim.
"""

import jax
import jax.numpy as jnp


def attention(q_BLHK, k_BLGK, v_BLGK, *, causal: bool, segment_ids_BL=None):
  """Softmax(q k^T / sqrt(K)) v, within segments when `segment_ids_BL` is given, causal or not."""
  mask_B1LL = None
  if segment_ids_BL is not None:  # A token attends only to tokens of its own segment (document).
    mask_B1LL = segment_ids_BL[:, None, :, None] == segment_ids_BL[:, None, None, :]
  # With G < H jax shares each key/value head among H/G query heads itself (no repeated copies of k and v).
  return jax.nn.dot_product_attention(q_BLHK, k_BLGK, v_BLGK, mask=mask_B1LL, is_causal=causal,
                                      implementation='xla')


def attention_to_positions(q_BLHK, k_BSGK, v_BSGK, positions_BL):
  """Softmax(q k^T / sqrt(K)) v of queries at `positions_BL` against S key/value slots, slot s holding position s:
  each query attends to the slots up to its own position."""
  mask_B1LS = jnp.arange(k_BSGK.shape[1])[None, None, None, :] <= positions_BL[:, None, :, None]
  return jax.nn.dot_product_attention(q_BLHK, k_BSGK, v_BSGK, mask=mask_B1LS, implementation='xla')
