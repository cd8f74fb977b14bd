"""A Linen decoder-only LM in the style of Flax's lm1b example, as published: the launcher is not in its mind.

- It is trained on rows it shifts right itself (`shift_right`, segment-aware),
  so logits[t] score inputs[t];
- packed rows come as `inputs_segmentation=` and `inputs_positions=`;
- a learned position table of `max_len` rows, indexed by the positions given
  (a position past it reads NaN: `jnp.take`'s fill for out-of-range indices);
- attention kernels (embed, heads, head_dim) named by three logical names, the
  MLP's two; logits through a final Dense named ('embed', 'vocab').
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  vocab_size: int
  emb_dim: int = 32
  num_heads: int = 2
  num_layers: int = 2
  qkv_dim: int = 32
  mlp_dim: int = 64
  max_len: int = 32
  dtype: Any = jnp.float32


def _logical(*names, init=nn.initializers.xavier_uniform()):
  return nn.with_logical_partitioning(init, names)


def shift_right(x, segmentation=None):
  """[0, x[0], ..., x[L-2]] per row; with segmentation, 0 at the first token of every segment too."""
  shifted = jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]
  if segmentation is not None:
    shifted = jnp.where(segmentation == jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1], shifted, 0)
  return shifted


class AddPositionEmbs(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, inputs_positions=None):
    c = self.config
    table = self.param('pos_embedding', _logical(None, None, 'embed', init=nn.initializers.normal(0.02)),
                       (1, c.max_len, c.emb_dim))
    if inputs_positions is None:
      return x + table[:, :x.shape[1]]
    return x + jnp.take(table[0], inputs_positions, axis=0, mode='fill', fill_value=jnp.nan)


class DecoderBlock(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, x, mask):
    c = self.config
    h = nn.LayerNorm(dtype=c.dtype)(x)
    h = nn.MultiHeadDotProductAttention(num_heads=c.num_heads, qkv_features=c.qkv_dim, dtype=c.dtype,
                                        kernel_init=_logical('embed', 'heads', 'kv'), use_bias=False)(h, mask=mask)
    x = x + h
    h = nn.LayerNorm(dtype=c.dtype)(x)
    h = nn.relu(nn.Dense(c.mlp_dim, dtype=c.dtype, kernel_init=_logical('embed', 'mlp'))(h))
    return x + nn.Dense(c.emb_dim, dtype=c.dtype, kernel_init=_logical('mlp', 'embed'))(h)


class TransformerLM(nn.Module):
  config: TransformerConfig

  @nn.compact
  def __call__(self, inputs, inputs_positions=None, inputs_segmentation=None):
    c = self.config
    y = shift_right(inputs, inputs_segmentation)
    embedding_init = _logical('vocab', 'embed', init=nn.initializers.normal(1.0))
    x = nn.Embed(c.vocab_size, c.emb_dim, embedding_init=embedding_init)(y)
    x = AddPositionEmbs(c)(x.astype(c.dtype), inputs_positions)
    mask = nn.make_causal_mask(inputs)
    if inputs_segmentation is not None:
      mask = nn.combine_masks(mask, nn.make_attention_mask(inputs_segmentation, inputs_segmentation, jnp.equal))
    for _ in range(c.num_layers):
      x = DecoderBlock(c)(x, mask)
    return nn.Dense(c.vocab_size, dtype=c.dtype, kernel_init=_logical('embed', 'vocab'))(nn.LayerNorm()(x))
