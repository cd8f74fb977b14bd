"""A Llama-style decoder LM: pre-RMSNorm blocks, rotary positions, SwiGLU MLP, untied head.

Shape letters: B batch, L sequence length, D d_model, H heads, K head dim,
F mlp hidden, V vocabulary. Parameters carry logical axis names ('embed',
'heads', 'head_dim', 'mlp', 'vocab', 'norm') that config rules map to mesh axes;
so do the key activations ('batch', 'length', ...), as sharding constraints,
when the config gives the model a mesh (the 'jit' strategy: per-device
strategies run the model on local shards, where constraints do not apply).
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

REMAT_POLICIES = {
    'full': None,  # Save nothing: recompute the whole block in the backward pass.
    'dots_saveable': jax.checkpoint_policies.dots_saveable,
    'dots_with_no_batch_dims_saveable': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  num_layers: int
  d_model: int
  num_heads: int
  mlp_dim: int
  vocab_size: int
  rope_max_wavelength: float = 10_000.0
  norm_eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32  # Compute dtype of matmuls; norms, softmax and logits stay float32.
  param_dtype: jnp.dtype = jnp.float32
  remat_policy: str = 'none'
  mesh: Mesh | None = None  # Set to pin activation shardings under jit; None leaves them to the caller.
  rules: tuple = ()  # Logical axis rules for the activation constraints.

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


def constrain(x, axes: tuple[str, ...], cfg: LlamaConfig):
  """Pins an activation's sharding by logical names; a no-op without a mesh."""
  if cfg.mesh is None:
    return x
  return nn.with_logical_constraint(x, axes, rules=cfg.rules, mesh=cfg.mesh)


def _init(axes: tuple[str, ...], stddev: float | None = None):
  base = nn.initializers.lecun_normal() if stddev is None else nn.initializers.normal(stddev)
  return nn.with_logical_partitioning(base, axes)


class RMSNorm(nn.Module):
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x_BLD):
    scale = self.param('scale', nn.with_logical_partitioning(nn.initializers.ones, ('norm',)),
                       (x_BLD.shape[-1],), self.cfg.param_dtype)
    x = x_BLD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.cfg.norm_eps)
    return (x * scale.astype(jnp.float32)).astype(self.cfg.dtype)


def rope(x_BLHK, positions_BL, max_wavelength: float):
  """Rotates channel pairs (first half, second half) by position-dependent angles."""
  half = x_BLHK.shape[-1] // 2
  freq = max_wavelength ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle_BLK = positions_BL[..., None].astype(jnp.float32) * freq
  sin, cos = jnp.sin(angle_BLK)[:, :, None, :], jnp.cos(angle_BLK)[:, :, None, :]
  x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BLHK.dtype)


class Attention(nn.Module):
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL=None):
    cfg = self.cfg
    dense = lambda name, axes: nn.DenseGeneral(
        (cfg.num_heads, cfg.head_dim), use_bias=False, kernel_init=_init(axes),
        dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name)
    q_BLHK = dense('query', ('embed', 'heads', 'head_dim'))(x_BLD)
    k_BLHK = dense('key', ('embed', 'heads', 'head_dim'))(x_BLD)
    v_BLHK = dense('value', ('embed', 'heads', 'head_dim'))(x_BLD)
    qkv_axes = ('batch', 'length', 'heads', 'head_dim')
    q_BLHK = constrain(rope(q_BLHK, positions_BL, cfg.rope_max_wavelength), qkv_axes, cfg)
    k_BLHK = constrain(rope(k_BLHK, positions_BL, cfg.rope_max_wavelength), qkv_axes, cfg)
    v_BLHK = constrain(v_BLHK, qkv_axes, cfg)
    # jax.nn.dot_product_attention takes the fused cuDNN path on GPU when it can.
    # Packed rows: a token attends only to earlier tokens of its own document (segment).
    mask_B1LL = None if segment_ids_BL is None else segment_ids_BL[:, None, :, None] == segment_ids_BL[:, None, None, :]
    out_BLHK = jax.nn.dot_product_attention(q_BLHK, k_BLHK, v_BLHK, mask=mask_B1LL, is_causal=True)
    return nn.DenseGeneral(
        cfg.d_model, axis=(-2, -1), use_bias=False, kernel_init=_init(('heads', 'head_dim', 'embed')),
        dtype=cfg.dtype, param_dtype=cfg.param_dtype, name='out')(out_BLHK)


class Mlp(nn.Module):
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x_BLD):
    cfg = self.cfg
    dense = lambda features, axes, name: nn.Dense(
        features, use_bias=False, kernel_init=_init(axes), dtype=cfg.dtype,
        param_dtype=cfg.param_dtype, name=name)
    gate_BLF = dense(cfg.mlp_dim, ('embed', 'mlp'), 'gate')(x_BLD)
    up_BLF = dense(cfg.mlp_dim, ('embed', 'mlp'), 'up')(x_BLD)
    hidden_BLF = constrain(nn.silu(gate_BLF) * up_BLF, ('batch', 'length', 'mlp'), cfg)
    return dense(cfg.d_model, ('mlp', 'embed'), 'down')(hidden_BLF)


class Block(nn.Module):
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL=None):
    x_BLD = x_BLD + Attention(self.cfg, name='attention')(RMSNorm(self.cfg, name='attention_norm')(x_BLD), positions_BL,
                                                          segment_ids_BL)
    x_BLD = x_BLD + Mlp(self.cfg, name='mlp')(RMSNorm(self.cfg, name='mlp_norm')(x_BLD))
    return constrain(x_BLD, ('batch', 'length', 'embed'), self.cfg)


class Embed(nn.Module):
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, tokens_BL):
    cfg = self.cfg
    table_VD = self.param('embedding', _init(('vocab', 'embed'), stddev=1.0), (cfg.vocab_size, cfg.d_model),
                          cfg.param_dtype)
    # Gathered whole before the lookup, as FSDP does for every weight: a gather from a
    # table split over two mesh axes makes GSPMD replicate it anyway, less efficiently.
    table_VD = constrain(table_VD, (None, None), cfg)
    return jnp.take(table_VD, tokens_BL, axis=0).astype(cfg.dtype)


class Llama(nn.Module):
  """tokens (B, L) int32 -> logits (B, L, V) float32.

  Packed rows pass `segment_ids` (B, L) (attention stays within a segment) and
  `positions` (B, L) (each token's offset in its document, for RoPE).
  """
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, tokens_BL, segment_ids=None, positions=None):
    cfg = self.cfg
    positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape) if positions is None else positions
    x_BLD = Embed(cfg, name='embed')(tokens_BL)
    x_BLD = constrain(x_BLD, ('batch', 'length', 'embed'), cfg)
    block = Block
    if cfg.remat_policy != 'none':
      block = nn.remat(Block, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=True)
    for i in range(cfg.num_layers):
      x_BLD = block(cfg, name=f'block_{i}')(x_BLD, positions_BL, segment_ids)
    x_BLD = RMSNorm(cfg, name='final_norm')(x_BLD)
    logits_BLV = nn.Dense(
        cfg.vocab_size, use_bias=False, kernel_init=_init(('embed', 'vocab')),
        dtype=cfg.dtype, param_dtype=cfg.param_dtype, name='head')(x_BLD)
    return constrain(logits_BLV, ('batch', 'length', 'vocab'), cfg).astype(jnp.float32)
