"""A Linen decoder in the style of a compact research codebase: fused attention projections as nn.DenseGeneral.

Every kernel is boxed with `nn.with_partitioning` naming the launcher's own mesh
axes ('data' for FSDP-style splitting of the embedding dimension); a
DenseGeneral's initializer gets the flat 2-D kernel shape while its names are
one per dimension of the final 3-D or 4-D kernel. Causal attention, learned
token embeddings tied to the output, no constraints on activations.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DoConfig:
  D: int  # Model width.
  H: int  # Heads.
  L: int  # Sequence length.
  N: int  # Blocks.
  V: int  # Vocabulary.
  F: int  # MLP width.
  dtype: Any = jnp.float32
  remat: bool = False


def _named(*names):
  return nn.with_partitioning(nn.initializers.xavier_uniform(), names)


class Attention(nn.Module):
  cfg: DoConfig

  @nn.compact
  def __call__(self, x_BLD):
    c = self.cfg
    Dh = c.D // c.H
    qkv = nn.DenseGeneral((3, c.H, Dh), kernel_init=_named('data', None, None, None), use_bias=False,
                          dtype=c.dtype)(x_BLD)
    q_BLHK, k_BLHK, v_BLHK = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    mask = nn.make_causal_mask(jnp.ones(x_BLD.shape[:2]))
    out = nn.dot_product_attention(q_BLHK, k_BLHK, v_BLHK, mask=mask, dtype=c.dtype)
    return nn.DenseGeneral(c.D, axis=(-2, -1), kernel_init=_named(None, None, 'data'), use_bias=False,
                           dtype=c.dtype)(out)


class Block(nn.Module):
  cfg: DoConfig

  @nn.compact
  def __call__(self, x_BLD):
    c = self.cfg
    x_BLD = x_BLD + Attention(c)(nn.RMSNorm(dtype=c.dtype)(x_BLD))
    h = nn.gelu(nn.Dense(c.F, kernel_init=_named('data', None), dtype=c.dtype)(nn.RMSNorm(dtype=c.dtype)(x_BLD)))
    return x_BLD + nn.Dense(c.D, kernel_init=_named(None, 'data'), dtype=c.dtype)(h)


class TransformerDo(nn.Module):
  docfg: DoConfig

  @nn.compact
  def __call__(self, y_BL):
    c = self.docfg
    embed = nn.Embed(c.V, c.D, embedding_init=nn.with_partitioning(nn.initializers.normal(0.02), (None, 'data')))
    x_BLD = embed(y_BL).astype(c.dtype)
    block = nn.remat(Block) if c.remat else Block
    for _ in range(c.N):
      x_BLD = block(c)(x_BLD)
    return embed.attend(nn.RMSNorm(dtype=c.dtype)(x_BLD).astype(jnp.float32))
