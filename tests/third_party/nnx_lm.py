"""An NNX language model in the style of Flax's Gemma example: its own sharding config of mesh-axis names.

`ShardingConfig` names axes ('fsdp', 'tp'); `fsdp_tp()` is the author's
layout for a mesh with those axes, `none()` replicates everything. The
constructor takes `dtype` and a `remat_policy` callable-or-None for its blocks,
and pins activations with bare PartitionSpecs when `shard_activations`.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
  emb_vd: tuple = (None, None)
  q_weight_dnh: tuple = (None, None, None)
  o_weight_nhd: tuple = (None, None, None)
  ffw_weight_df: tuple = (None, None)
  ffw_weight_fd: tuple = (None, None)
  act_btd: tuple | None = None
  out_btd: tuple | None = None  # The attention output einsum's out_sharding= (needs a mesh of Explicit axes).

  @staticmethod
  def fsdp_tp():
    return ShardingConfig(emb_vd=('tp', 'fsdp'), q_weight_dnh=('fsdp', 'tp', None), o_weight_nhd=('tp', None, 'fsdp'),
                          ffw_weight_df=('fsdp', 'tp'), ffw_weight_fd=('tp', 'fsdp'), act_btd=('fsdp', None, None))

  @staticmethod
  def fsdp_tp_explicit():  # For sharding in types: the author's mesh has jax.sharding.AxisType.Explicit axes.
    return dataclasses.replace(ShardingConfig.fsdp_tp(), act_btd=None, out_btd=('fsdp', None, None))


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  num_embed: int
  embed_dim: int
  num_heads: int
  num_layers: int
  hidden_dim: int
  shd: ShardingConfig = ShardingConfig()


def _param(rngs, shape, names, dtype=jnp.float32):
  return nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), shape, dtype), out_sharding=names)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int):
    self.scale = nnx.Param(jnp.zeros((dim,)))  # No names: a small vector.

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (normed * (1 + self.scale[...])).astype(x.dtype)


class Block(nnx.Module):
  def __init__(self, cfg: TransformerConfig, dtype, *, rngs: nnx.Rngs):
    d, n, h, f, s = cfg.embed_dim, cfg.num_heads, cfg.embed_dim // cfg.num_heads, cfg.hidden_dim, cfg.shd
    self.dtype, self.act, self.out = dtype, s.act_btd, s.out_btd
    self.pre_attn, self.pre_ffw = RMSNorm(d), RMSNorm(d)
    self.q, self.k, self.v = (_param(rngs, (d, n, h), s.q_weight_dnh) for _ in range(3))
    self.o = _param(rngs, (n, h, d), s.o_weight_nhd)
    self.up, self.down = _param(rngs, (d, f), s.ffw_weight_df), _param(rngs, (f, d), s.ffw_weight_fd)

  def __call__(self, x):
    w = lambda p: p[...].astype(self.dtype)
    h = self.pre_attn(x)
    q, k, v = (jnp.einsum('btd,dnh->btnh', h, w(p)) for p in (self.q, self.k, self.v))
    att = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    out = None if self.out is None else P(*self.out)
    x = x + jnp.einsum('btnh,nhd->btd', att, w(self.o), out_sharding=out)
    x = x + jax.nn.gelu(self.pre_ffw(x) @ w(self.up)) @ w(self.down)
    return x if self.act is None else jax.lax.with_sharding_constraint(x, P(*self.act))


class Transformer(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32, remat_policy=False):
    self.cfg, self.dtype, self.remat_policy = cfg, dtype, remat_policy
    self.embedder = nnx.Param(nnx.initializers.normal(cfg.embed_dim**-0.5)(rngs.params(), (cfg.num_embed, cfg.embed_dim)),
                              out_sharding=cfg.shd.emb_vd)
    self.blocks = nnx.List([Block(cfg, dtype, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.embed_dim)

  def __call__(self, tokens_BT):
    x = self.embedder[...][tokens_BT].astype(self.dtype) * jnp.sqrt(self.cfg.embed_dim).astype(self.dtype)
    for block in self.blocks:
      # remat_policy: False = no rematerialization; None or a jax.checkpoint policy = remat with it.
      x = block(x) if self.remat_policy is False else nnx.remat(lambda b, x: b(x), policy=self.remat_policy)(block, x)
    return self.final_norm(x) @ self.embedder[...].T.astype(self.dtype)
