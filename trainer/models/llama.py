"""A Llama-style decoder LM: pre-RMSNorm blocks, rotary positions, SwiGLU MLP,
grouped-query attention, and an untied head or one tied to the embedding table.

Shape letters: B batch, L sequence length, D d_model, H query heads, G key/value
heads (G divides H; G = H is plain multi-head attention), K head dim, F mlp
hidden, V vocabulary. Parameters carry logical axis names ('embed', 'heads',
'kv_heads', 'head_dim', 'mlp', 'vocab', 'norm', and 'layers' for the stacked axis
of scanned blocks) that config rules map to mesh axes;
so do the key activations ('batch', 'length', ...), as sharding constraints,
when the config gives the model a mesh (the 'jit' strategy: per-device
strategies run the model on local shards, where constraints do not apply).

Blocks are scanned when `scan_layers` (model.scan_layers, 'auto': above 4 layers; trainer/models/layer_scan.py):
one block is traced and compiled once and run `num_layers` times over parameters stacked on a leading 'layers'
axis, so compile time does not grow with depth. Rematerialization wraps each
block, scanned or not; the names given to activations with `checkpoint_name`
below are what the save-by-name policies keep.

Decoding (scripts/sample.py) runs `for_decoding(model)`: the same parameters, with each attention layer keeping
its keys and values in a 'cache' collection (trainer/models/kv_cache.py) so a new token runs alone against them.
Training never sets `decode`, so its step is the one traced before the cache existed.

`build(config, mesh, rules)` is the launcher's entry point (registered as
'llama'): it checks the model's config keys and returns the Linen module.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import logging
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh

from trainer import attention as attention_lib
from trainer import pipeline as pipeline_lib
from trainer.base.errors import UserError
from trainer.base.precision import compute_dtype
from trainer.models import checkpoint_policies, kv_cache, layer_scan, lora, quantization, sown
from trainer.models import moe as moe_lib

# What each block keeps for the backward pass; everything else is recomputed there.
REMAT_POLICIES = {
    **checkpoint_policies.GENERIC,
    # Save by name: the q/k/v projections (tagged in Attention), so the backward pass
    # recomputes the MLP and the attention core but not the three input projections.
    'save_qkv_proj': jax.checkpoint_policies.save_only_these_names('query_proj', 'key_proj', 'value_proj'),
    # Save by name: the attention output (before its out projection) and the MLP's down-projection
    # input, the two tensors whose recomputation costs the most (the attention core, the MLP's up/gate).
    # A fused kernel's forward returns the attention output with its softmax statistics: both are kept, or
    # its backward would run the forward again.
    'save_attention_and_mlp_hidden': jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_only_these_names('attention_out', 'mlp_hidden'),
        attention_lib.fused_forward_saveable),
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  num_layers: int
  d_model: int
  num_heads: int
  mlp_dim: int
  vocab_size: int
  num_kv_heads: int = 0  # Key/value heads of grouped-query attention, dividing num_heads; 0 = num_heads.
  head_dim_override: int = 0  # model.head_dim: each head's width; 0 = d_model // num_heads.
  tie_embeddings: bool = False  # Logits from the embedding table (transposed) instead of a separate head.
  rope_max_wavelength: float = 10_000.0
  # Llama 3.1+'s long-context RoPE frequencies (model.rope_scaling): 'none' or 'llama3' with its four numbers.
  rope_scaling: str = 'none'
  rope_scaling_factor: float = 8.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_positions: int = 8192
  qkv_bias: bool = False  # Biases on the query, key and value projections (Qwen2); the output projection has none.
  qk_norm: bool = False  # RMSNorm over each query and key head's channels before RoPE (Qwen3).
  norm_eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32  # Compute dtype of matmuls; norms, softmax and logits stay float32.
  param_dtype: jnp.dtype = jnp.float32
  remat_policy: str = 'none'
  scan_layers: bool = True  # One scanned block over stacked parameters; False unrolls num_layers blocks.
  attention: str = 'auto'  # The attention kernel (model.attention): 'auto', 'xla', 'cudnn' or 'splash'.
  context_scheme: str = 'auto'  # How attention crosses mesh.context (model.context_scheme): 'all-gather', 'ring'.
  max_segments: int | None = None  # Packed rows: the most documents a row holds (data.max_documents_per_row).
  mesh: Mesh | None = None  # Set to pin activation shardings under jit; None leaves them to the caller.
  rules: tuple = ()  # Logical axis rules for the activation constraints.
  # Mixture of experts (trainer/models/moe.py): None = every block has the dense MLP.
  moe: moe_lib.MoeConfig | None = None
  moe_interval: int = 1  # Every moe_interval-th block (blocks k-1, 2k-1, ...) is an MoE block.
  shared_expert: bool = False  # MoE blocks also run a dense MLP of moe.expert_mlp_dim on every token.
  # mesh.pipeline > 1 (trainer/pipeline/): the scanned blocks run as this circular schedule; None = in one scan.
  pipeline: pipeline_lib.Schedule | None = None
  decode: bool = False  # Attention keeps keys/values in the 'cache' collection (for_decoding); never in training.

  @property
  def head_dim(self) -> int:
    return self.head_dim_override or self.d_model // self.num_heads

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads or self.num_heads

  def is_moe(self, layer: int) -> bool:
    return self.moe is not None and (layer + 1) % self.moe_interval == 0

  @property
  def scans_groups(self) -> bool:
    """Scanned with MoE every k-th layer (k > 1): the scanned unit is a BlockGroup of k blocks."""
    return self.scan_layers and self.moe is not None and self.moe_interval > 1


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


def rope_frequencies(head_dim: int, cfg: LlamaConfig) -> jax.Array:
  """Angle per position of each of the head_dim / 2 channel pairs (radians), with cfg.rope_scaling applied.

  'llama3' (Llama 3.1+): pairs whose wavelength is longer than the original context / low_freq_factor turn
  `factor` times slower, those shorter than original context / high_freq_factor stay, and those between blend
  the two linearly in (original context / wavelength).
  """
  half = head_dim // 2
  freq = cfg.rope_max_wavelength ** (-jnp.arange(half, dtype=jnp.float32) / half)
  if cfg.rope_scaling == 'none':
    return freq
  turns_in_context = cfg.rope_original_max_positions * freq / (2 * jnp.pi)  # Full turns over the original context.
  blend = (turns_in_context - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
  blend = jnp.clip(blend, 0.0, 1.0)  # 0: long wavelengths, all slowed; 1: short ones, unchanged.
  return freq * (blend + (1.0 - blend) / cfg.rope_scaling_factor)


def rope(x_BLHK, positions_BL, freq_K):
  """Rotates channel pairs (channel i with channel i + head_dim / 2: Hugging Face's `rotate_half` layout) by
  position x freq_K[i]."""
  angle_BLK = positions_BL[..., None].astype(jnp.float32) * freq_K
  sin, cos = jnp.sin(angle_BLK)[:, :, None, :], jnp.cos(angle_BLK)[:, :, None, :]
  x1, x2 = jnp.split(x_BLHK.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BLHK.dtype)


class Attention(nn.Module):
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL=None):
    cfg = self.cfg
    dense = lambda heads, name, axes: nn.DenseGeneral(
        (heads, cfg.head_dim), use_bias=cfg.qkv_bias, kernel_init=_init(axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),
        dtype=cfg.dtype, param_dtype=cfg.param_dtype, name=name)
    q_BLHK = checkpoint_name(dense(cfg.num_heads, 'query', ('embed', 'heads', 'head_dim'))(x_BLD), 'query_proj')
    k_BLGK = checkpoint_name(dense(cfg.kv_heads, 'key', ('embed', 'kv_heads', 'head_dim'))(x_BLD), 'key_proj')
    v_BLGK = checkpoint_name(dense(cfg.kv_heads, 'value', ('embed', 'kv_heads', 'head_dim'))(x_BLD), 'value_proj')
    if cfg.qk_norm:  # One (head_dim,) scale each for queries and keys, shared by their heads.
      q_BLHK, k_BLGK = RMSNorm(cfg, name='query_norm')(q_BLHK), RMSNorm(cfg, name='key_norm')(k_BLGK)
    kv_axes = ('batch', 'length', 'kv_heads', 'head_dim')
    freq_K = rope_frequencies(cfg.head_dim, cfg)
    q_BLHK = constrain(rope(q_BLHK, positions_BL, freq_K), ('batch', 'length', 'heads', 'head_dim'), cfg)
    k_BLGK = constrain(rope(k_BLGK, positions_BL, freq_K), kv_axes, cfg)
    v_BLGK = constrain(v_BLGK, kv_axes, cfg)
    if cfg.decode and kv_cache.filled(self):  # New positions against the cached ones.
      k_BSGK, v_BSGK = kv_cache.update(self, k_BLGK, v_BLGK, positions_BL)
      out_BLHK = attention_lib.cached_attention(q_BLHK, k_BSGK, v_BSGK, positions_BL)
    else:
      if cfg.decode:  # The prefill: its window's keys and values become the cache.
        kv_cache.fill(self, k_BLGK, v_BLGK)
      # Packed rows: a token attends only to earlier tokens of its own document (segment), on every kernel.
      out_BLHK = attention_lib.dot_product_attention(q_BLHK, k_BLGK, v_BLGK, causal=True,
                                                     segment_ids_BL=segment_ids_BL, kernel=cfg.attention,
                                                     mesh=cfg.mesh, rules=cfg.rules, max_segments=cfg.max_segments,
                                                     context_scheme=cfg.context_scheme)
    out_BLHK = checkpoint_name(out_BLHK, 'attention_out')
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
    hidden_BLF = checkpoint_name(hidden_BLF, 'mlp_hidden')
    return dense(cfg.d_model, ('mlp', 'embed'), 'down')(hidden_BLF)


class Block(nn.Module):
  """One pre-norm block, shaped for `nn.scan`: `(x, per-token arrays...) -> (x, None)`.

  Every argument after `x_BLD` is the same for every layer (broadcast through the
  scan): the positions, and the per-token `segment_ids_BL` of packed sequences
  (None when sequences are not packed).
  """
  cfg: LlamaConfig
  moe: bool = False  # The MLP is a mixture of experts (cfg.moe).

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL=None):
    cfg = self.cfg
    x_BLD = x_BLD + Attention(cfg, name='attention')(RMSNorm(cfg, name='attention_norm')(x_BLD), positions_BL,
                                                     segment_ids_BL)
    h_BLD = RMSNorm(cfg, name='mlp_norm')(x_BLD)
    if not self.moe:
      return constrain(x_BLD + Mlp(cfg, name='mlp')(h_BLD), ('batch', 'length', 'embed'), cfg), None
    y_BLD = moe_lib.MoeMlp(cfg.moe, mesh=cfg.mesh, name='moe')(h_BLD)
    if cfg.shared_expert:
      y_BLD = y_BLD + Mlp(dataclasses.replace(cfg, mlp_dim=cfg.moe.expert_mlp_dim), name='shared_expert')(h_BLD)
    return constrain(x_BLD + y_BLD, ('batch', 'length', 'embed'), cfg), None


class BlockGroup(nn.Module):
  """cfg.moe_interval blocks, the last one MoE: the unit scanned when only some layers are MoE."""
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, x_BLD, positions_BL, segment_ids_BL=None):
    for j in range(self.cfg.moe_interval):
      x_BLD, _ = Block(self.cfg, moe=self.cfg.is_moe(j), name=f'block_{j}')(x_BLD, positions_BL, segment_ids_BL)
    return x_BLD, None


def block_stack(cfg: LlamaConfig):
  """The Block (or BlockGroup) class to instantiate: rematerialized per `cfg.remat_policy`, scanned if
  `cfg.scan_layers`."""
  block = BlockGroup if cfg.scans_groups else Block
  if cfg.remat_policy != 'none':
    # Inside a scan the loop already keeps XLA from merging recomputation into the forward pass.
    block = nn.remat(block, policy=REMAT_POLICIES[cfg.remat_policy], prevent_cse=not cfg.scan_layers)
  if cfg.scan_layers:
    # What layers sow (MoE loss terms and metrics) is stacked per layer, like the parameters.
    # Decoding stacks each layer's KV cache the same way.
    stacked = ('params', *sown.COLLECTIONS, *((kv_cache.COLLECTION,) if cfg.decode else ()))
    block = nn.scan(block, variable_axes={c: 0 for c in stacked},
                    split_rngs={'params': True}, in_axes=(nn.broadcast, nn.broadcast),
                    length=cfg.num_layers // (cfg.moe_interval if cfg.scans_groups else 1),
                    metadata_params={nn.PARTITION_NAME: 'layers'})
  return block


# The stddev of the logits at initialization, whatever the width. Logits are final_norm(x) (unit RMS) times the
# head, so a head of stddev s gives logits of stddev s*sqrt(D), and the expected loss at step 0 is about
# ln(V) + (s*sqrt(D))**2 / 2. GPT-2's and Llama's 0.02 gives 0.55 at GPT-2's width (768) but 0.9 at Llama 1B's
# (2048); the former 1/sqrt(D) gave 1.0 everywhere (gpt2_124m started at 11.31 against ln(50304) = 10.83, llama_1b
# at 12.27 against 11.76). At 0.4 every width starts within 0.08 of ln(V), i.e. near-uniform predictions.
LOGIT_INIT_STDDEV = 0.4


def head_stddev(cfg: LlamaConfig) -> float:
  """Init stddev of the output head (or of the tied table): logits start with stddev LOGIT_INIT_STDDEV."""
  return LOGIT_INIT_STDDEV / cfg.d_model ** 0.5


class Embed(nn.Module):
  """The token embedding table: `__call__` looks tokens up, `attend` turns hidden states into logits (tied head)."""
  cfg: LlamaConfig

  def setup(self):
    cfg = self.cfg
    # A tied table is also the output head, so it starts at the head's scale (see head_stddev); the pre-norm
    # blocks do not mind the small input scale (GPT-2's tied table starts at 0.02 too). An untied table starts at
    # 1, as MaxText's embeddings do: the inputs then have unit scale, like the block outputs added to them.
    stddev = head_stddev(cfg) if cfg.tie_embeddings else 1.0
    self.embedding = self.param('embedding', _init(('vocab', 'embed'), stddev=stddev), (cfg.vocab_size, cfg.d_model),
                                cfg.param_dtype)

  def __call__(self, tokens_BL):
    # Gathered whole before the lookup, as FSDP does for every weight: a gather from a
    # table split over two mesh axes makes GSPMD replicate it anyway, less efficiently.
    table_VD = constrain(self.embedding, (None, None), self.cfg)
    return jnp.take(table_VD, tokens_BL, axis=0).astype(self.cfg.dtype)

  def head_DV(self):
    """The tied output head in the compute dtype: the table transposed, left in its ('vocab', 'embed') sharding."""
    return self.embedding.astype(self.cfg.dtype).T


class Head(nn.Module):
  """The untied output head: a (D, V) 'kernel' under 'head', the path and init nn.Dense(name='head') gives."""
  cfg: LlamaConfig

  def setup(self):
    cfg = self.cfg
    self.kernel = self.param('kernel', _init(('embed', 'vocab'), stddev=head_stddev(cfg)),
                             (cfg.d_model, cfg.vocab_size), cfg.param_dtype)

  def head_DV(self):
    return self.kernel.astype(self.cfg.dtype)


class Llama(nn.Module):
  """tokens (B, L) int32 -> logits (B, L, V) float32.

  Packed rows pass `segment_ids` (B, L) (attention stays within a segment) and
  `positions` (B, L) (each token's offset in its document, for RoPE). With
  `hidden_and_head=True` it returns the final hidden states (B, L, D) and the
  output head (D, V), both in the compute dtype, instead of the logits: the
  objective then computes the loss a chunk of positions at a time
  (train.loss_chunks), never holding all (B, L, V) logits.
  """
  cfg: LlamaConfig

  @nn.compact
  def __call__(self, tokens_BL, segment_ids=None, positions=None, hidden_and_head: bool = False):
    cfg = self.cfg
    positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape) if positions is None else positions
    embed = Embed(cfg, name='embed')
    x_BLD = embed(tokens_BL)
    x_BLD = constrain(x_BLD, ('batch', 'length', 'embed'), cfg)
    block = block_stack(cfg)
    if cfg.scan_layers and cfg.pipeline is not None and not self.is_initializing():
      x_BLD = _pipelined(cfg, self.variables['params']['layers'], x_BLD, positions_BL, segment_ids)
    elif cfg.scan_layers:
      every_moe = {} if cfg.scans_groups or cfg.moe is None else {'moe': True}  # A group says which itself.
      x_BLD, _ = block(cfg, name='layers', **every_moe)(x_BLD, positions_BL, segment_ids)
    else:
      for i in range(cfg.num_layers):
        x_BLD, _ = block(cfg, moe=cfg.is_moe(i), name=f'block_{i}')(x_BLD, positions_BL, segment_ids)
    x_BLD = RMSNorm(cfg, name='final_norm')(x_BLD)
    head_DV = embed.head_DV() if cfg.tie_embeddings else Head(cfg, name='head').head_DV()
    if hidden_and_head:
      return x_BLD, head_DV
    logits_BLV = jnp.einsum('bld,dv->blv', x_BLD, head_DV)
    return constrain(logits_BLV, ('batch', 'length', 'vocab'), cfg).astype(jnp.float32)


def _pipelined(cfg: LlamaConfig, stacked, x_BLD, positions_BL, segment_ids_BL):
  """The scanned blocks' output run as cfg.pipeline's stages, over the parameters nn.scan created (same layout)."""
  block_cfg = dataclasses.replace(cfg, pipeline=None)

  def layer(params, x, positions, segment_ids):
    # Run inside the schedule's shard_map (pipeline axis manual): the blocks' sharding constraints name the
    # context's abstract mesh; the concrete mesh, its pipeline axis not manual, is refused there.
    # (Counting FLOPs, the schedule runs the layers in a plain scan, outside any shard_map: the concrete mesh.)
    abstract = jax.sharding.get_abstract_mesh()
    staged = cfg.mesh is not None and pipeline_lib.AXIS in abstract.manual_axes
    inner = dataclasses.replace(block_cfg, mesh=abstract) if staged else block_cfg
    block = Block(inner, parent=None)  # Unbound: applied to each layer's parameters, not a child of the Llama.
    return block.apply({'params': params}, x, positions, segment_ids)[0]
  batch_axes = next((axes for name, axes in cfg.rules if name == 'batch'), None)
  # 'full' is the policy None (jax.checkpoint's default: save nothing), which pipeline.run reads as no remat.
  policy = None if cfg.remat_policy == 'none' else (REMAT_POLICIES[cfg.remat_policy]
                                                    or jax.checkpoint_policies.nothing_saveable)
  return pipeline_lib.run(layer, stacked, x_BLD, (positions_BL, segment_ids_BL), cfg.pipeline, cfg.mesh,
                          batch_axes=batch_axes, remat_policy=policy)


def for_decoding(model: Llama) -> Llama:
  """`model` for generation with a KV cache; it takes `model`'s parameters.

  `apply({'params': p}, window_1L, mutable=['cache'])` runs the window as training does (the prefill) and returns
  (logits, {'cache': ...}) holding its keys and values, one slot per position; then
  `apply({'params': p, 'cache': cache}, tokens_1L, positions=positions_1L, mutable=['cache'])` runs only the new
  tokens, writing their slots and attending to slots up to their positions. No remat: nothing is differentiated.
  """
  # type(model): a LoRA model (trainer/models/lora.py) is Qwix's subclass of the Llama; its adapters decode too.
  return type(model)(dataclasses.replace(model.cfg, decode=True, remat_policy='none', pipeline=None))


ROPE_SCALINGS = ('none', 'llama3')


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise UserError(message)


def check_config(config) -> None:
  """Raises UserError, naming the key and the fix, for model settings this model cannot build."""
  m = config.model
  head_dim = m.get('head_dim', 0)  # A run's config.json from before the key has none: d_model / num_heads.
  _require(isinstance(head_dim, int) and head_dim >= 0,
           f'model.head_dim={head_dim!r} must be a width in channels, or 0 for d_model / num_heads.')
  if not head_dim:
    _require(m.d_model % m.num_heads == 0, f'model.d_model={m.d_model} must divide by model.num_heads={m.num_heads} '
                                           f'(or set model.head_dim).')
  head_dim = head_dim or m.d_model // m.num_heads
  _require(head_dim % 2 == 0, f'the head dim {head_dim} (model.head_dim, or model.d_model/model.num_heads) must be '
                              f'even for RoPE; change model.d_model, model.num_heads or model.head_dim.')
  _require(isinstance(m.num_kv_heads, int) and m.num_kv_heads >= 0 and m.num_heads % (m.num_kv_heads or 1) == 0,
           f'model.num_kv_heads={m.num_kv_heads!r} must divide model.num_heads={m.num_heads} '
           f'(or be 0 for one key/value head per query head).')
  if config.data.source == 'text':  # Byte-level: every byte value is a token.
    _require(m.vocab_size >= 256,
             f'model.vocab_size={m.vocab_size} is too small for byte-level text; use at least 256.')
  _require(m.get('rope_scaling', 'none') in ROPE_SCALINGS,
           f"model.rope_scaling={m.get('rope_scaling')!r}: choose one of {ROPE_SCALINGS}.")
  moe_lib.check_config(m, layer_scan.scans(m))
  policies = ('none',) + tuple(REMAT_POLICIES)
  _require(config.train.remat_policy in policies,
           f'train.remat_policy={config.train.remat_policy!r}: choose one of {policies}.')


def build(config, mesh: Mesh | None = None, rules=()) -> Llama:
  """The Llama of `config` (the whole launcher config), checked first; with a mesh its activations are constrained.

  Raises:
    UserError: a model setting this model cannot build, naming the key and the fix.
  """
  check_config(config)  # Mesh fit (e.g. fewer kv heads than the tensor axis) is parallel/sharding.check_divisible's.
  # A named kernel that cannot run this model fails here, not in compile.
  attention_lib.check_config(config.model, config.data, config.train.compute_dtype, mesh)
  m = config.model
  moe_fields = moe_lib.llama_fields(m, compute_dtype(config.train.compute_dtype), jnp.dtype(config.train.param_dtype))
  if moe_fields:
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    moe_fields['moe'] = moe_lib.for_platform(moe_fields['moe'], platform)  # The experts' kernel of the devices.
    logging.info(moe_lib.dispatch_note(moe_fields['moe'], platform))
  mode = config.train.get('quantization')  # A run's config.json from before the key has none.
  quantization.check(mode, mesh.devices.flat[0] if mesh is not None else jax.devices()[0])
  if mode and lora.enabled(m):  # Two Qwix providers on one model: quantize_model replaces the first, never stacks.
    raise UserError(f'train.quantization={mode!r} with model.lora_rank={m.lora_rank}: quantized LoRA is not supported '
                    f'yet (Qwix intercepts a model\'s matmuls through one provider, its LoRA or its quantized '
                    f'training, not both); set train.quantization=None, or model.lora_rank=0.')
  model = quantization.quantize(Llama(LlamaConfig(
      num_layers=m.num_layers, d_model=m.d_model, num_heads=m.num_heads, mlp_dim=m.mlp_dim,
      head_dim_override=m.get('head_dim', 0),
      vocab_size=m.vocab_size, num_kv_heads=m.num_kv_heads, tie_embeddings=m.tie_embeddings,
      rope_max_wavelength=m.rope_max_wavelength, norm_eps=m.norm_eps, qkv_bias=m.get('qkv_bias', False),
      qk_norm=m.get('qk_norm', False),
      # A run's config.json from before these keys has none: plain RoPE.
      rope_scaling=m.get('rope_scaling', 'none'), rope_scaling_factor=m.get('rope_scaling_factor', 8.0),
      rope_low_freq_factor=m.get('rope_low_freq_factor', 1.0), rope_high_freq_factor=m.get('rope_high_freq_factor', 4.0),
      rope_original_max_positions=m.get('rope_original_max_positions', 8192),
      dtype=compute_dtype(config.train.compute_dtype), param_dtype=jnp.dtype(config.train.param_dtype),
      remat_policy=config.train.remat_policy, scan_layers=layer_scan.scans(m), attention=m.attention,
      context_scheme=m.get('context_scheme', 'auto'),
      max_segments=config.data.max_documents_per_row if config.data.packing else None, mesh=mesh, rules=tuple(rules),
      pipeline=pipeline_lib.from_config(config.train, mesh), **moe_fields)), mode)
  return lora.wrap(model, m) if lora.enabled(m) else model  # model.lora_rank > 0: adapters on model.lora_targets.
