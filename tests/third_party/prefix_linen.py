"""A Linen language model in the style of Flax's examples: logical names that cover only the leading dimensions.

A `DenseGeneral` kernel (embed, heads, head_dim) is named ('embed', 'kv'):
Flax's convention is that names cover the leading dimensions and the rest are
whole. The model shifts its inputs right itself (it is trained on targets it
is given unshifted), unless `shift=False`; it takes no `positions`.
"""

import dataclasses

import flax.linen as nn
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LMConfig:
  vocab_size: int
  emb_dim: int
  num_heads: int
  num_layers: int
  mlp_dim: int
  shift: bool = True


def _named(*names, init=nn.initializers.lecun_normal()):
  return nn.with_logical_partitioning(init, names)


def shift_right(x, axis=1):
  pad = [(0, 0)] * x.ndim
  pad[axis] = (1, 0)
  return jnp.pad(x, pad)[:, :-1]


class DecoderLayer(nn.Module):
  config: LMConfig

  @nn.compact
  def __call__(self, x, mask):
    c = self.config
    head_dim = c.emb_dim // c.num_heads
    h = nn.LayerNorm()(x)
    q, k, v = (nn.DenseGeneral((c.num_heads, head_dim), kernel_init=_named('embed', 'kv'), use_bias=False)(h)
               for _ in range(3))
    att = nn.dot_product_attention(q, k, v, mask=mask)
    x = x + nn.DenseGeneral(c.emb_dim, axis=(-2, -1), kernel_init=_named('joined_kv', 'embed'), use_bias=False)(att)
    h = nn.LayerNorm(scale_init=_named('embed', init=nn.initializers.ones))(x)
    h = nn.relu(nn.Dense(c.mlp_dim, kernel_init=_named('embed', 'mlp'))(h))
    return x + nn.Dense(c.emb_dim, kernel_init=_named('mlp', 'embed'))(h)


class TransformerLM(nn.Module):
  config: LMConfig

  @nn.compact
  def __call__(self, inputs):
    c = self.config
    y = shift_right(inputs) if c.shift else inputs
    x = nn.Embed(c.vocab_size, c.emb_dim, embedding_init=_named('vocab', 'embed', init=nn.initializers.normal(1.0)))(y)
    mask = nn.make_causal_mask(inputs)
    for _ in range(c.num_layers):
      x = DecoderLayer(c)(x, mask)
    return nn.Dense(c.vocab_size, kernel_init=_named('embed', 'vocab'))(nn.LayerNorm()(x))
