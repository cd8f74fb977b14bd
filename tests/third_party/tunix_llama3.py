"""An NNX Llama 3 in the style of google/tunix's (tunix/models/llama3/model.py).

`Llama3(config, rngs=)`, called `model(input_tokens, positions, cache, attention_mask, skip_lm_head=False) ->
(logits, new_cache)`: the decoding convention. The cache is `layer_i: {'k', 'v', 'end_index'}`, written at
`end_index`; tunix's sampler makes it, the model has no `init_cache` (the glue adds one: tests/third_party/glue.py).
Its parts: `Einsum` modules ('BTD,DNH->BTNH', grouped key/value heads), RoPE, SwiGLU through `nnx.Linear` kernels
named with `nnx.with_partitioning`, RMSNorm weights, tied or separate output, a `ShardingConfig` of its mesh axes
'fsdp' and 'tp'.
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

K_MASK = -2.3819763e38
LayerCache = dict[str, jax.Array]
Cache = dict[str, LayerCache]


@dataclasses.dataclass(slots=True, frozen=True)
class ShardingConfig:
  emb_vd: tuple = ('tp', 'fsdp')
  emb_dv: tuple = ('fsdp', 'tp')
  q_weight_dnh: tuple = ('fsdp', 'tp', None)
  kv_weight_dnh: tuple = ('fsdp', 'tp', None)
  o_weight_nhd: tuple = ('tp', None, 'fsdp')
  ffw_weight_df: tuple = ('fsdp', 'tp')
  ffw_weight_fd: tuple = ('tp', 'fsdp')
  rms_norm_weight: tuple = ('tp',)


@dataclasses.dataclass(slots=True, frozen=True)
class ModelConfig:
  num_layers: int
  vocab_size: int
  embed_dim: int
  hidden_dim: int
  num_heads: int
  head_dim: int
  num_kv_heads: int
  rope_theta: int = 500_000
  norm_eps: float = 1e-5
  weight_tying: bool = False
  shd_config: ShardingConfig = ShardingConfig()


class Einsum(nnx.Module):
  def __init__(self, einsum_str: str, shape, *, rngs: nnx.Rngs, sharding):
    self.einsum_str, self.shape = einsum_str, shape
    self.w = nnx.Param(nnx.initializers.normal(shape[0] ** -0.5)(rngs.params(), shape), out_sharding=sharding)

  def __call__(self, x):
    return jnp.einsum(self.einsum_str, x, self.w[...])


def apply_rope(inputs, positions, head_dim: int, rope_theta: int):
  fraction = 2 * jnp.arange(0, head_dim // 2, dtype=jnp.float32) / head_dim
  sinusoid_inp = (positions[..., jnp.newaxis] / rope_theta**fraction)[..., jnp.newaxis, :]
  sin, cos = jnp.sin(sinusoid_inp), jnp.cos(sinusoid_inp)
  first_half, second_half = jnp.split(inputs, 2, axis=-1)
  out = jnp.concatenate([first_half * cos - second_half * sin, second_half * cos + first_half * sin], axis=-1)
  return out.astype(inputs.dtype)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, norm_eps: float, rngs: nnx.Rngs, shd_config: ShardingConfig):
    self.w = nnx.Param(nnx.initializers.ones_init()(rngs.params(), dim), out_sharding=shd_config.rms_norm_weight)
    self.norm_eps = norm_eps

  def __call__(self, x):
    rms = jnp.sqrt(jnp.mean(jnp.astype(x, jnp.float32) ** 2, axis=-1, keepdims=True) + self.norm_eps)
    return jnp.astype(self.w[...] * x / rms, x.dtype)


class Attention(nnx.Module):
  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c, s = config, config.shd_config
    self.config = config
    self.q_proj = Einsum('BTD,DNH->BTNH', (c.embed_dim, c.num_heads, c.head_dim), rngs=rngs, sharding=s.q_weight_dnh)
    self.k_proj = Einsum('BSD,DKH->BSKH', (c.embed_dim, c.num_kv_heads, c.head_dim), rngs=rngs,
                         sharding=s.kv_weight_dnh)
    self.v_proj = Einsum('BSD,DKH->BSKH', (c.embed_dim, c.num_kv_heads, c.head_dim), rngs=rngs,
                         sharding=s.kv_weight_dnh)
    self.o_proj = Einsum('BTNH,NHD->BTD', (c.num_heads, c.head_dim, c.embed_dim), rngs=rngs, sharding=s.o_weight_nhd)

  def __call__(self, x, segment_pos, cache: LayerCache | None, attn_mask) -> tuple[LayerCache | None, jax.Array]:
    c = self.config
    query_proj = apply_rope(self.q_proj(x), segment_pos, c.head_dim, c.rope_theta)
    key_proj = apply_rope(self.k_proj(x), segment_pos, c.head_dim, c.rope_theta)
    value_proj = self.v_proj(x)
    if cache is not None:
      end_index = cache['end_index'][0]
      slice_indices = (0, end_index % cache['v'].shape[1], 0, 0)
      value_proj = jax.lax.dynamic_update_slice(cache['v'], value_proj, slice_indices)
      key_proj = jax.lax.dynamic_update_slice(cache['k'], key_proj, slice_indices)
    b, t, qh, d = query_proj.shape
    _, s, kh, _ = key_proj.shape
    query_proj = query_proj.reshape((b, t, kh, qh // kh, d))  # GQA.
    attn = jnp.einsum('BTHGD,BSHD->BHGTS', query_proj, key_proj) * d**-0.5
    attn = attn.reshape((b, qh, t, s))
    if attn_mask is not None:
      attn = jnp.where(jnp.expand_dims(attn_mask, -3), attn, K_MASK)
    attn = jax.nn.softmax(attn.astype(jnp.float32), axis=-1).astype(key_proj.dtype)
    attn = attn.reshape((b, kh, qh // kh, t, s))
    qkv = jnp.einsum('BHGTS,BSHD->BTHGD', attn, value_proj).reshape((b, t, qh, d))
    new_cache = None if cache is None else {'v': value_proj, 'k': key_proj, 'end_index': cache['end_index'] + t}
    return new_cache, self.o_proj(qkv)


class MLP(nnx.Module):
  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    s, init = config.shd_config, nnx.initializers.lecun_normal()
    linear = lambda i, o, names: nnx.Linear(i, o, use_bias=False, rngs=rngs,
                                            kernel_init=nnx.with_partitioning(init, names))
    self.gate_proj = linear(config.embed_dim, config.hidden_dim, s.ffw_weight_df)
    self.up_proj = linear(config.embed_dim, config.hidden_dim, s.ffw_weight_df)
    self.down_proj = linear(config.hidden_dim, config.embed_dim, s.ffw_weight_fd)

  def __call__(self, x):
    return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    norm = lambda: RMSNorm(config.embed_dim, norm_eps=config.norm_eps, rngs=rngs, shd_config=config.shd_config)
    self.input_layernorm, self.post_attention_layernorm = norm(), norm()
    self.attn, self.mlp = Attention(config, rngs=rngs), MLP(config, rngs=rngs)

  def __call__(self, x, segment_pos, cache, attn_mask):
    cache, attn_output = self.attn(self.input_layernorm(x), segment_pos, cache, attn_mask)
    attn_output += x
    return cache, attn_output + self.mlp(self.post_attention_layernorm(attn_output))


class Llama3(nnx.Module):
  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.input_embedding = nnx.Param(nnx.initializers.normal()(rngs.params(), (config.vocab_size, config.embed_dim)),
                                     out_sharding=config.shd_config.emb_vd)
    self.layers = nnx.List([DecoderLayer(config, rngs=rngs) for _ in range(config.num_layers)])
    self.final_norm = RMSNorm(config.embed_dim, norm_eps=config.norm_eps, rngs=rngs, shd_config=config.shd_config)
    if not config.weight_tying:
      self.lm_head = Einsum('BTD,DV->BTV', (config.embed_dim, config.vocab_size), rngs=rngs,
                            sharding=config.shd_config.emb_dv)

  def __call__(self, input_tokens, positions, cache: Cache | None, attention_mask,
               skip_lm_head: bool = False) -> tuple[jax.Array, Cache | None]:
    new_cache = None if cache is None else {}
    x = self.input_embedding[...][(input_tokens,)]
    for i, layer in enumerate(self.layers):
      layer_name = f'layer_{i}'
      layer_cache, x = layer(x, positions, cache[layer_name] if cache else None, attention_mask)
      if cache is not None:
        new_cache[layer_name] = layer_cache
    x = self.final_norm(x)
    if skip_lm_head:
      return x, new_cache
    logits = x @ self.input_embedding[...].T if self.config.weight_tying else self.lm_head(x)
    return jnp.astype(logits, jnp.float32), new_cache
