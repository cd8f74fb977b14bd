"""A ViT image classifier in Flax NNX: patches, pre-LayerNorm encoder blocks, global average pooling, linear head.

Shape letters: B batch, H/W image height/width, C channels, P patches per image (the sequence), Q pixels per
patch (patch_size * patch_size * C), D d_model, N heads, K head dim, F mlp hidden, O classes.

Parameters carry logical axis names ('patch', 'embed', 'length', 'heads', 'head_dim', 'mlp', 'norm', 'classes',
and 'layers' for the stacked axis of scanned blocks) that the config's rules map to mesh axes. With a mesh (the
'jit' strategy) the key activations are pinned by logical names too; per-device strategies pass no mesh.

Blocks are scanned when `model.scan_layers`: `nnx.vmap` creates every block's parameters stacked on a leading
'layers' axis and `nnx.scan` runs one traced block over them, so compile time stays flat in depth. Remat wraps
each block, scanned or not.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from trainer import attention as attention_lib
from trainer.base.errors import UserError
from trainer.base.precision import compute_dtype
from trainer.data import arrays
from trainer.models import checkpoint_policies, layer_scan

# What each block keeps for the backward pass; everything else is recomputed there.
REMAT_POLICIES = checkpoint_policies.GENERIC
# Save-by-name policies keep activations the Llama blocks tag by name; this model tags none.
LLAMA_ONLY_POLICIES = ('save_qkv_proj', 'save_attention_and_mlp_hidden')


@dataclasses.dataclass(frozen=True)
class VitConfig:
  num_layers: int
  d_model: int
  num_heads: int
  mlp_dim: int
  num_classes: int
  patch_size: int
  image_shape: tuple[int, int, int]
  dtype: jnp.dtype = jnp.float32  # Compute dtype of matmuls; norms, softmax and logits stay float32.
  param_dtype: jnp.dtype = jnp.float32
  remat_policy: str = 'none'
  scan_layers: bool = False
  norm_eps: float = 1e-6
  attention: str = 'auto'  # The attention kernel (model.attention): 'auto', 'xla', 'cudnn' or 'splash'.
  mesh: Mesh | None = None  # Set to pin activation shardings under jit; None leaves them to the caller.
  rules: tuple = ()  # Logical axis rules for the activation constraints.

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def num_patches(self) -> int:
    height, width, _ = self.image_shape
    return (height // self.patch_size) * (width // self.patch_size)

  @property
  def patch_pixels(self) -> int:
    return self.patch_size * self.patch_size * self.image_shape[2]


def vit_config(config, mesh: Mesh | None = None, rules=()) -> VitConfig:
  """Reads and checks the ViT sizes of a launcher config; raises UserError naming the key and the fix."""
  m, shape = config.model, config.data.image_shape
  arrays.check_image_shape(shape)
  height, width, _ = shape
  for key in ('num_layers', 'd_model', 'num_heads', 'mlp_dim', 'patch_size'):
    if not isinstance(m[key], int) or m[key] < 1:
      raise UserError(f'model.{key}={m[key]!r} must be a positive integer.')
  if m.d_model % m.num_heads:
    suggestion = _divisor(m.d_model, m.num_heads)
    raise UserError(f'model.d_model={m.d_model} does not divide by model.num_heads={m.num_heads}; '
                    f'choose num_heads dividing d_model (e.g. --config.model.num_heads={suggestion}).')
  if height % m.patch_size or width % m.patch_size:
    raise UserError(f'data.image_shape={tuple(shape)} has height and width that do not divide by '
                    f'model.patch_size={m.patch_size}; choose a patch size dividing both, or resize the images.')
  if m.num_classes < 2:
    raise UserError(f'model.num_classes={m.num_classes} must be at least 2 for a classifier; set it to the number '
                    f'of distinct labels.')
  policy = config.train.remat_policy
  if policy in LLAMA_ONLY_POLICIES:
    raise UserError(f'train.remat_policy={policy!r} saves activations the Llama blocks tag by name, which the ViT '
                    f"does not have; choose one of {('none', *REMAT_POLICIES)}.")
  if policy != 'none' and policy not in REMAT_POLICIES:
    raise UserError(f"train.remat_policy={policy!r} is unknown; choose one of {('none', *REMAT_POLICIES)}.")
  # A named kernel that cannot run this model fails here, not in compile.
  attention_lib.check_config(config.model, config.data, config.train.compute_dtype, mesh)
  return VitConfig(
      num_layers=m.num_layers, d_model=m.d_model, num_heads=m.num_heads, mlp_dim=m.mlp_dim,
      num_classes=m.num_classes, patch_size=m.patch_size, image_shape=tuple(shape),
      dtype=compute_dtype(config.train.compute_dtype), param_dtype=jnp.dtype(config.train.param_dtype),
      remat_policy=policy, scan_layers=layer_scan.scans(m), attention=m.attention, mesh=mesh, rules=tuple(rules))


def _divisor(n: int, near: int) -> int:
  """The divisor of n closest to `near` (for the error message's suggestion)."""
  return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - near))


def constrain(x, axes: tuple[str, ...], cfg: VitConfig):
  """Pins an activation's sharding by logical names; a no-op without a mesh (as in llama.py)."""
  if cfg.mesh is None:
    return x
  return nn.with_logical_constraint(x, axes, rules=cfg.rules, mesh=cfg.mesh)


def _dense(cfg: VitConfig, einsum: str, kernel_shape, kernel_axes, bias_axes, in_axis, out_axis, rngs, *,
           kernel_init=None, dtype=None) -> nnx.Einsum:
  """A projection whose kernel and bias both carry logical names; fan-in counted over `in_axis`."""
  init = kernel_init or nnx.initializers.lecun_normal(in_axis=in_axis, out_axis=out_axis)
  bias_shape = tuple(kernel_shape[a] for a in range(len(kernel_shape)) if kernel_axes[a] in bias_axes)
  return nnx.Einsum(einsum, kernel_shape, bias_shape, dtype=dtype or cfg.dtype, param_dtype=cfg.param_dtype,
                    kernel_init=init, bias_init=nnx.initializers.zeros, rngs=rngs,
                    kernel_metadata={'out_sharding': kernel_axes}, bias_metadata={'out_sharding': bias_axes})


class LayerNorm(nnx.Module):
  """LayerNorm computed in float32 whatever the compute dtype; returns `out_dtype` (default the compute dtype)."""

  def __init__(self, cfg: VitConfig, features: int, out_dtype=None):
    self.scale = nnx.Param(jnp.ones((features,), cfg.param_dtype), out_sharding=('norm',))
    self.bias = nnx.Param(jnp.zeros((features,), cfg.param_dtype), out_sharding=('norm',))
    self.eps, self.out_dtype = cfg.norm_eps, out_dtype or cfg.dtype

  def __call__(self, x):
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    x = (x - mean) * jax.lax.rsqrt(var + self.eps)
    return (x * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(self.out_dtype)


class Attention(nnx.Module):
  """Non-causal multi-head self-attention over the patches."""

  def __init__(self, cfg: VitConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    d, n, k = cfg.d_model, cfg.num_heads, cfg.head_dim
    qkv = lambda: _dense(cfg, 'BPD,DNK->BPNK', (d, n, k), ('embed', 'heads', 'head_dim'), ('heads', 'head_dim'),
                         0, (1, 2), rngs)
    self.query, self.key, self.value = qkv(), qkv(), qkv()
    self.out = _dense(cfg, 'BPNK,NKD->BPD', (n, k, d), ('heads', 'head_dim', 'embed'), ('embed',), (0, 1), 2, rngs)

  def __call__(self, x_BPD):
    axes = ('batch', 'length', 'heads', 'head_dim')
    q_BPNK = constrain(self.query(x_BPD), axes, self.cfg)
    k_BPNK = constrain(self.key(x_BPD), axes, self.cfg)
    v_BPNK = constrain(self.value(x_BPD), axes, self.cfg)
    out_BPNK = attention_lib.dot_product_attention(q_BPNK, k_BPNK, v_BPNK, causal=False, kernel=self.cfg.attention,
                                                   mesh=self.cfg.mesh, rules=self.cfg.rules)
    return self.out(out_BPNK)


class Mlp(nnx.Module):
  def __init__(self, cfg: VitConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.up = _dense(cfg, 'BPD,DF->BPF', (cfg.d_model, cfg.mlp_dim), ('embed', 'mlp'), ('mlp',), 0, 1, rngs)
    self.down = _dense(cfg, 'BPF,FD->BPD', (cfg.mlp_dim, cfg.d_model), ('mlp', 'embed'), ('embed',), 0, 1, rngs)

  def __call__(self, x_BPD):
    hidden_BPF = constrain(jax.nn.gelu(self.up(x_BPD)), ('batch', 'length', 'mlp'), self.cfg)
    return self.down(hidden_BPF)


class Block(nnx.Module):
  """One pre-LayerNorm encoder block: x + attention(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: VitConfig, rngs: nnx.Rngs):
    self.cfg = cfg
    self.attention_norm = LayerNorm(cfg, cfg.d_model)
    self.attention = Attention(cfg, rngs)
    self.mlp_norm = LayerNorm(cfg, cfg.d_model)
    self.mlp = Mlp(cfg, rngs)

  def __call__(self, x_BPD):
    x_BPD = x_BPD + self.attention(self.attention_norm(x_BPD))
    x_BPD = x_BPD + self.mlp(self.mlp_norm(x_BPD))
    return constrain(x_BPD, ('batch', 'length', 'embed'), self.cfg)


def _apply_block(block: Block, x_BPD):
  return block(x_BPD)


class ViT(nnx.Module):
  """Images (B, H, W, C) float32 -> class logits (B, num_classes) float32.

  Built by the launcher as `ViT(config, rngs=nnx.Rngs(seed), mesh=mesh, rules=rules)` from the whole config:
  sizes from `model.*`, image shape from `data.image_shape`, dtypes and remat from `train.*`.
  """

  def __init__(self, config, *, rngs: nnx.Rngs, mesh: Mesh | None = None, rules=()):
    cfg = self.cfg = vit_config(config, mesh, rules)
    self.patch_embed = _dense(cfg, 'BPQ,QD->BPD', (cfg.patch_pixels, cfg.d_model), ('patch', 'embed'), ('embed',),
                              0, 1, rngs)
    self.position_embed = nnx.Param(
        nnx.initializers.normal(0.02)(rngs.params(), (cfg.num_patches, cfg.d_model), cfg.param_dtype),
        out_sharding=('length', 'embed'))
    if cfg.scan_layers:
      self.blocks = _stacked_blocks(cfg, rngs)
    else:
      self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
    self.final_norm = LayerNorm(cfg, cfg.d_model, out_dtype=jnp.float32)
    # A zero head starts every class at equal odds (loss log(num_classes)), as big_vision's ViT does.
    self.head = _dense(cfg, 'BD,DO->BO', (cfg.d_model, cfg.num_classes), ('embed', 'classes'), ('classes',), 0, 1,
                       rngs, kernel_init=nnx.initializers.zeros, dtype=jnp.float32)

  def __call__(self, images_BHWC):
    cfg = self.cfg
    batch, height, width, channels = images_BHWC.shape
    if (height, width, channels) != cfg.image_shape:
      raise UserError(f'the model was built for data.image_shape={cfg.image_shape} but got images of shape '
                      f'{(height, width, channels)}; set data.image_shape to the images\' shape.')
    p = cfg.patch_size
    # Patchify by reshape: (B, H/p, p, W/p, p, C) -> (B, H/p, W/p, p, p, C) -> (B, P, Q), row-major patches.
    x = images_BHWC.astype(cfg.dtype).reshape(batch, height // p, p, width // p, p, channels)
    patches_BPQ = x.transpose(0, 1, 3, 2, 4, 5).reshape(batch, cfg.num_patches, cfg.patch_pixels)
    x_BPD = self.patch_embed(patches_BPQ) + self.position_embed[...].astype(cfg.dtype)
    x_BPD = constrain(x_BPD, ('batch', 'length', 'embed'), cfg)
    block_fn = _apply_block
    if cfg.remat_policy != 'none':
      # Inside a scan CSE cannot merge recomputation across iterations, so prevent_cse only costs there.
      block_fn = nnx.remat(_apply_block, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
      x_BPD = _scan_blocks(block_fn, self.blocks, x_BPD)
    else:
      for block in self.blocks:
        x_BPD = block_fn(block, x_BPD)
    pooled_BD = jnp.mean(x_BPD.astype(jnp.float32), axis=1)  # Global average pooling over patches.
    return self.head(self.final_norm(pooled_BD)).astype(jnp.float32)


def _stacked_blocks(cfg: VitConfig, rngs: nnx.Rngs) -> Block:
  """num_layers blocks as one Block whose parameters are stacked on a leading 'layers' axis."""

  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
  def make(rngs: nnx.Rngs) -> Block:
    return Block(cfg, rngs)

  return make(rngs)


def _scan_blocks(block_fn, blocks: Block, x_BPD):
  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
  def run(block: Block, x_BPD):
    return block_fn(block, x_BPD)

  return run(blocks, x_BPD)
