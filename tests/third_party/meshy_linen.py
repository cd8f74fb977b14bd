"""A Linen decoder written for its own ('data', 'model') mesh, the way standalone research code is.

Parameters are boxed with `nn.with_partitioning` naming mesh axes (FSDP over
'data', tensor parallelism over 'model'); the LayerNorms' scales and biases
carry no names; activations are pinned to the batch axis with bare
PartitionSpecs, which need a mesh context while the model is traced.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class DoConfig:
  vocab: int
  width: int
  heads: int
  depth: int
  ffw_mult: int = 4
  dtype: Any = jnp.float32


def _init(*mesh_axes):
  return nn.with_partitioning(nn.initializers.xavier_uniform(), mesh_axes)


class Block(nn.Module):
  cfg: DoConfig

  @nn.compact
  def __call__(self, x_BLD):
    c = self.cfg
    head_dim = c.width // c.heads
    h = nn.LayerNorm(dtype=c.dtype)(x_BLD)
    qkv = nn.DenseGeneral((3, c.heads, head_dim), kernel_init=_init('data', None, 'model', None), use_bias=False,
                          dtype=c.dtype)(h)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    mask = nn.make_causal_mask(jnp.ones(x_BLD.shape[:2]))
    att = nn.dot_product_attention(q, k, v, mask=mask, dtype=c.dtype)
    x_BLD = x_BLD + nn.DenseGeneral(c.width, axis=(-2, -1), kernel_init=_init('model', None, 'data'), use_bias=False,
                                    dtype=c.dtype)(att)
    h = nn.LayerNorm(dtype=c.dtype)(x_BLD)
    h = nn.gelu(nn.Dense(c.width * c.ffw_mult, kernel_init=_init('data', 'model'), dtype=c.dtype)(h))
    x_BLD = x_BLD + nn.Dense(c.width, kernel_init=_init('model', 'data'), dtype=c.dtype)(h)
    return jax.lax.with_sharding_constraint(x_BLD, P('data', None, None))


class TransformerDo(nn.Module):
  cfg: DoConfig

  @nn.compact
  def __call__(self, tokens_BL):
    c = self.cfg
    embed = nn.Embed(c.vocab, c.width, embedding_init=nn.with_partitioning(nn.initializers.normal(0.02),
                                                                           ('model', 'data')))
    x = embed(tokens_BL).astype(c.dtype)
    x = jax.lax.with_sharding_constraint(x, P('data', None, None))
    for _ in range(c.depth):
      x = Block(c)(x)
    return embed.attend(nn.LayerNorm(dtype=c.dtype)(x).astype(jnp.float32))
