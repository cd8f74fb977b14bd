"""An NNX decoder in the style of Flax's Gemma example (examples/gemma: transformer.py, modules.py, layers.py).

Its call is the decoding convention: `Transformer(last_tokens, positions, cache, attention_mask) -> (logits,
new_cache)`, the mask [B, L, cache length] of what each token may attend to, the cache a dict of
`layer_i: {'k', 'v', 'end_index'}` made by `init_cache(cache_size, batch_size, dtype)` and written at
`end_index`; training passes `cache=None`. Gemma's parts, small: query and key/value einsums
(heads, embed, head_dim) and (2, kv_heads, embed, head_dim), RoPE, a gated GELU MLP, RMSNorm scales around 1,
embeddings scaled by sqrt(embed_dim) and tied to the output. Parameters named by its own axis names ('fsdp', 'tp').
"""

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

K_MASK = -2.3819763e38  # Gemma's large negative for masked logits.
LayerCache = dict[str, jax.Array]
Cache = dict[str, LayerCache]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  num_layers: int
  num_embed: int
  embed_dim: int
  hidden_dim: int
  num_heads: int
  head_dim: int
  num_kv_heads: int
  dtype: jnp.dtype = jnp.float32


def apply_rope(inputs, positions, max_wavelength: int = 10_000):
  """RoPE on [B, L, N, H] at positions [B, L], halves rotated together (Gemma's layout)."""
  first, second = jnp.split(inputs, 2, axis=-1)
  fraction = 2 * jnp.arange(inputs.shape[-1] // 2) / inputs.shape[-1]
  sinusoid = positions[..., None, None] / max_wavelength**fraction
  sin, cos = jnp.sin(sinusoid), jnp.cos(sinusoid)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(inputs.dtype)


class Einsum(nnx.Module):
  def __init__(self, shape, names, *, rngs: nnx.Rngs):
    self.w = nnx.Param(nnx.initializers.normal(shape[-2] ** -0.5)(rngs.params(), shape), out_sharding=names)

  def __call__(self, eqn: str, x):
    return jnp.einsum(eqn, x, self.w[...].astype(x.dtype))


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    self.scale = nnx.Param(jnp.zeros((dim,)))

  def __call__(self, x):
    var = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return (x * jax.lax.rsqrt(var + 1e-6) * (1 + self.scale[...])).astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.q_einsum = Einsum((cfg.num_heads, cfg.embed_dim, cfg.head_dim), ('tp', 'fsdp', None), rngs=rngs)
    self.kv_einsum = Einsum((2, cfg.num_kv_heads, cfg.embed_dim, cfg.head_dim), (None, 'tp', 'fsdp', None), rngs=rngs)
    self.attn_vec_einsum = Einsum((cfg.num_heads, cfg.head_dim, cfg.embed_dim), ('tp', None, 'fsdp'), rngs=rngs)
    self.head_dim = cfg.head_dim

  def __call__(self, x, segment_pos, cache: LayerCache | None, attn_mask) -> tuple[LayerCache | None, jax.Array]:
    query_proj = apply_rope(self.q_einsum('BTD,NDH->BTNH', x), segment_pos)
    key_proj, value_proj = self.kv_einsum('BSD,CKDH->CBSKH', x)
    key_proj = apply_rope(key_proj, segment_pos)
    if cache is not None:
      end_index = cache['end_index'][0]
      slice_indices = (0, end_index % cache['v'].shape[1], 0, 0)
      value_proj = jax.lax.dynamic_update_slice(cache['v'], value_proj, slice_indices)
      key_proj = jax.lax.dynamic_update_slice(cache['k'], key_proj, slice_indices)
    repeat = query_proj.shape[2] // key_proj.shape[2]
    keys, values = jnp.repeat(key_proj, repeat, axis=2), jnp.repeat(value_proj, repeat, axis=2)
    logits = jnp.einsum('BTNH,BSNH->BTNS', query_proj * self.head_dim**-0.5, keys)
    padded_logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
    probs = jax.nn.softmax(padded_logits.astype(jnp.float32), axis=-1).astype(keys.dtype)
    encoded = jnp.einsum('BTNS,BSNH->BTNH', probs, values)
    new_cache = None if cache is None else {'v': value_proj, 'k': key_proj,
                                            'end_index': cache['end_index'] + x.shape[1]}
    return new_cache, self.attn_vec_einsum('BTNH,NHD->BTD', encoded)

  def init_cache(self, cache_size: int, batch_size: int, num_kv_heads: int, dtype) -> LayerCache:
    shape = (batch_size, cache_size, num_kv_heads, self.head_dim)
    return {'v': jnp.zeros(shape, dtype), 'k': jnp.zeros(shape, dtype),
            'end_index': jnp.zeros((batch_size,), jnp.int32)}


class Block(nnx.Module):
  def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
    self.pre_attention_norm, self.pre_ffw_norm = RMSNorm(cfg.embed_dim, rngs=rngs), RMSNorm(cfg.embed_dim, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.gating_einsum = Einsum((2, cfg.hidden_dim, cfg.embed_dim), (None, 'tp', 'fsdp'), rngs=rngs)
    self.linear = Einsum((cfg.hidden_dim, cfg.embed_dim), ('tp', 'fsdp'), rngs=rngs)

  def __call__(self, x, segment_pos, cache, attn_mask):
    cache, attn_output = self.attn(self.pre_attention_norm(x), segment_pos, cache, attn_mask)
    x = x + attn_output
    gate, up = self.gating_einsum('BTD,CFD->CBTF', self.pre_ffw_norm(x))
    return cache, x + self.linear('BTF,FD->BTD', jax.nn.gelu(gate) * up)


class Transformer(nnx.Module):
  def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.input_embedding = nnx.Param(nnx.initializers.normal(config.embed_dim**-0.5)(rngs.params(), (config.num_embed, config.embed_dim)),
                                     out_sharding=('tp', 'fsdp'))
    self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
    self.final_norm = RMSNorm(config.embed_dim, rngs=rngs)

  def __call__(self, last_tokens, positions, cache: Cache | None, attention_mask) -> tuple[jax.Array, Cache | None]:
    cfg = self.config
    table = self.input_embedding[...].astype(cfg.dtype)
    x = table[last_tokens] * jnp.sqrt(cfg.embed_dim).astype(cfg.dtype)
    new_cache = None if cache is None else {}
    for i, layer in enumerate(self.layers):
      layer_name = f'layer_{i}'
      layer_cache, x = layer(x, positions, cache[layer_name] if cache else None, attention_mask)
      if cache is not None:
        new_cache[layer_name] = layer_cache
    return self.final_norm(x) @ table.T, new_cache

  def init_cache(self, cache_size: int, batch_size: int, dtype=jnp.bfloat16) -> Cache:
    return {f'layer_{i}': layer.attn.init_cache(cache_size, batch_size, self.config.num_kv_heads, dtype)
            for i, layer in enumerate(self.layers)}
