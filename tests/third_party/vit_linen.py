"""A Linen Vision Transformer in the style of google-research/vision_transformer, as published.

Its call takes a required keyword, `__call__(self, inputs, *, train)` (dropout
on in training); patches come from a strided Conv, a class token is prepended
and a learned position table added; no parameter carries axis names.
"""

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  num_classes: int
  patch_size: int
  hidden_size: int
  num_heads: int
  num_layers: int
  mlp_dim: int
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32


class Encoder1DBlock(nn.Module):
  cfg: ViTConfig

  @nn.compact
  def __call__(self, x, *, deterministic):
    c = self.cfg
    y = nn.MultiHeadDotProductAttention(num_heads=c.num_heads, dtype=c.dtype, deterministic=deterministic,
                                        dropout_rate=c.dropout_rate)(nn.LayerNorm()(x), nn.LayerNorm()(x))
    x = x + nn.Dropout(c.dropout_rate)(y, deterministic=deterministic)
    y = nn.gelu(nn.Dense(c.mlp_dim, dtype=c.dtype)(nn.LayerNorm()(x)))
    y = nn.Dense(x.shape[-1], dtype=c.dtype)(nn.Dropout(c.dropout_rate)(y, deterministic=deterministic))
    return x + y


class VisionTransformer(nn.Module):
  cfg: ViTConfig

  @nn.compact
  def __call__(self, inputs, *, train):
    c = self.cfg
    p = c.patch_size
    x = nn.Conv(c.hidden_size, (p, p), strides=(p, p), padding='VALID', name='embedding')(inputs)
    n, h, w, d = x.shape
    x = x.reshape(n, h * w, d)
    cls = self.param('cls', nn.initializers.zeros, (1, 1, d))
    x = jnp.concatenate([jnp.tile(cls, (n, 1, 1)), x], axis=1)
    x = x + self.param('pos_embedding', nn.initializers.normal(0.02), (1, x.shape[1], d))
    x = nn.Dropout(c.dropout_rate)(x, deterministic=not train)
    for i in range(c.num_layers):
      x = Encoder1DBlock(c, name=f'encoderblock_{i}')(x, deterministic=not train)
    x = nn.LayerNorm(name='encoder_norm')(x)[:, 0]
    return nn.Dense(c.num_classes, kernel_init=nn.initializers.zeros, name='head')(x)
