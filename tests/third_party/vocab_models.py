"""One small decoder, in Linen and in NNX, whose parameters are named in the vocabulary of a public Flax codebase.

Each vocabulary is the names and layouts its source gives the same parts (written
here from the published code's conventions, not imported):
- 'flax_examples': lm1b/wmt, `nn.with_logical_partitioning` with ('embed', 'heads', 'kv') kernels;
- 't5x': flaxformer's flat kernels ('embed', 'joined_kv') and stacked gate/up ('embed', 'mlp_activations', 'mlp');
- 'maxtext': MaxText's decoders: DeepSeek-style low-rank attention ('embed', 'q_lora') -> ('q_lora', 'q_heads',
  'kv'), keys/values through 'kv_lora' and ('kv_heads', 'kv_head_dim'), gate/up ('embed', 'num_activations',
  'mlp'), experts ('exp', 'embed_no_exp', 'mlp'), norms ('norm',);
- 'tunix': mesh-axis names 'fsdp' and 'tp', heads first ('tp', 'fsdp', None), as its ShardingConfig;
- 'nanodo': `nn.with_partitioning` naming the mesh axis 'data' (its FSDP), norms unnamed;
- 'big_vision': unnamed parameters, activations constrained by the logical name 'act_batch'.

The builders (`linen_<vocabulary>`, `nnx_<vocabulary>`) are the glue: two lines each.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

# parameter -> (dims, names); dims: V vocab, D width, N heads, H head width, J = N*H, F mlp, R low rank, A gate/up,
# E experts. names None: an unnamed parameter.
_ATTN_LOGICAL = {'q': ('DNH', ('embed', 'heads', 'kv')), 'k': ('DNH', ('embed', 'heads', 'kv')),
                 'v': ('DNH', ('embed', 'heads', 'kv')), 'o': ('NHD', ('heads', 'kv', 'embed'))}
VOCABULARIES = {
    'flax_examples': {'embedding': ('VD', ('vocab', 'embed')), **_ATTN_LOGICAL,
                      'wi': ('DF', ('embed', 'mlp')), 'wo': ('FD', ('mlp', 'embed')), 'scale': ('D', ('embed',))},
    't5x': {'embedding': ('VD', ('vocab', 'embed')), 'q': ('DJ', ('embed', 'joined_kv')),
            'k': ('DJ', ('embed', 'joined_kv')), 'v': ('DJ', ('embed', 'joined_kv')),
            'o': ('JD', ('joined_kv', 'embed')), 'wi': ('DAF', ('embed', 'mlp_activations', 'mlp')),
            'wo': ('FD', ('mlp', 'embed')), 'scale': ('D', ('embed',))},
    'maxtext': {'embedding': ('VD', ('vocab', 'embed')), 'q_a': ('DR', ('embed', 'q_lora')),
                'q': ('RNH', ('q_lora', 'q_heads', 'kv')), 'kv_a': ('DR', ('embed', 'kv_lora')),
                'k': ('RNH', ('kv_lora', 'kv_heads', 'kv_head_dim')),
                'v': ('RNH', ('kv_lora', 'kv_heads', 'kv_head_dim')), 'o': ('NHD', ('heads', 'kv', 'embed')),
                'wi': ('DAF', ('embed', 'num_activations', 'mlp')), 'wo': ('FD', ('mlp', 'embed')),
                'wi_exp': ('EDF', ('exp', 'embed_no_exp', 'mlp')), 'wo_exp': ('EFD', ('exp', 'mlp', 'embed_no_exp')),
                'scale': ('D', ('norm',))},
    'tunix': {'embedding': ('VD', ('tp', 'fsdp')), 'q': ('NDH', ('tp', 'fsdp', None)),
              'k': ('NDH', ('tp', 'fsdp', None)), 'v': ('NDH', ('tp', 'fsdp', None)),
              'o': ('NHD', ('tp', None, 'fsdp')), 'wi': ('DF', ('fsdp', 'tp')), 'wo': ('FD', ('tp', 'fsdp')),
              'scale': ('D', ('tp',))},
    'nanodo': {'embedding': ('VD', (None, 'data')), 'q': ('DNH', ('data', None, None)),
               'k': ('DNH', ('data', None, None)), 'v': ('DNH', ('data', None, None)),
               'o': ('NHD', (None, None, 'data')), 'wi': ('DF', ('data', None)), 'wo': ('FD', (None, 'data')),
               'scale': ('D', None)},
    'big_vision': {'embedding': ('VD', None), 'q': ('DNH', None), 'k': ('DNH', None), 'v': ('DNH', None),
                   'o': ('NHD', None), 'wi': ('DF', None), 'wo': ('FD', None), 'scale': ('D', None)},
}
MESH_NAMED = ('tunix', 'nanodo')  # Name mesh axes (nn.with_partitioning), not logical axes.


def _shape(dims: str, sizes: dict) -> tuple[int, ...]:
  return tuple(sizes[d] for d in dims)


def _sizes(vocab_size, width, heads, mlp) -> dict:
  return {'V': vocab_size, 'D': width, 'N': heads, 'H': width // heads, 'J': width, 'F': mlp, 'R': width // 2,
          'A': 2, 'E': 2}


def forward(p: dict, tokens, heads: int, constrain):
  """The decoder on parameters `p` (arrays by name), whatever their layout; `constrain(x, names)` pins activations."""
  emb = p['embedding']
  x = constrain(emb[tokens], ('act_batch', None, None))
  b, t, d = x.shape
  h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * (1 + p['scale'])

  def project(name, src):
    w = p[name]
    if name in ('k', 'v') and 'kv_a' in p:
      return jnp.einsum('btr,rnh->btnh', src @ p['kv_a'], w)
    if name == 'q' and 'q_a' in p:
      return jnp.einsum('btr,rnh->btnh', src @ p['q_a'], w)
    if w.ndim == 2:  # Flat (embed, joined_kv).
      return (src @ w).reshape(b, t, heads, d // heads)
    return jnp.einsum('btd,ndh->btnh' if w.shape[0] == heads else 'btd,dnh->btnh', src, w)

  q, k, v = (project(n, h) for n in 'qkv')
  att = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  o = p['o']
  x = x + (att.reshape(b, t, d) @ o if o.ndim == 2 else jnp.einsum('btnh,nhd->btd', att, o))
  wi = p['wi']
  hidden = jax.nn.silu(h @ wi) if wi.ndim == 2 else jax.nn.silu(h @ wi[:, 0]) * (h @ wi[:, 1])
  x = x + hidden @ p['wo']
  if 'wi_exp' in p:  # Every expert, equally weighted: the names are the point, not the routing.
    x = x + jnp.einsum('btf,efd->btd', jnp.einsum('btd,edf->btf', h, p['wi_exp']), p['wo_exp']) / 2
  return x @ emb.T


class LinenLM(nn.Module):
  vocabulary: str
  vocab_size: int
  width: int
  heads: int
  mlp: int

  @nn.compact
  def __call__(self, tokens):
    sizes = _sizes(self.vocab_size, self.width, self.heads, self.mlp)
    box = nn.with_partitioning if self.vocabulary in MESH_NAMED else nn.with_logical_partitioning
    p = {}
    for name, (dims, names) in VOCABULARIES[self.vocabulary].items():
      init = nn.initializers.zeros if name == 'scale' else nn.initializers.normal(0.5 / 8)
      p[name] = self.param(name, init if names is None else box(init, names), _shape(dims, sizes))
    return forward(p, tokens, self.heads, nn.with_logical_constraint)


class NnxLM(nnx.Module):
  def __init__(self, vocabulary: str, vocab_size: int, width: int, heads: int, mlp: int, *, rngs: nnx.Rngs):
    sizes, self.heads = _sizes(vocab_size, width, heads, mlp), heads
    self.names = tuple(VOCABULARIES[vocabulary])
    for name, (dims, names) in VOCABULARIES[vocabulary].items():
      shape = _shape(dims, sizes)
      value = jnp.zeros(shape) if name == 'scale' else nnx.initializers.normal(0.5 / 8)(rngs.params(), shape)
      setattr(self, name, nnx.Param(value) if names is None else nnx.Param(value, out_sharding=names))

  def __call__(self, tokens):
    return forward({n: getattr(self, n)[...] for n in self.names}, tokens, self.heads, lambda x, names: x)


def _linen(vocabulary):
  def build(config):
    m = config.model
    return LinenLM(vocabulary, m.vocab_size, m.d_model, m.num_heads, m.mlp_dim)
  return build


def _nnx(vocabulary):
  def build(config, *, rngs):
    m = config.model
    return NnxLM(vocabulary, m.vocab_size, m.d_model, m.num_heads, m.mlp_dim, rngs=rngs)
  return build


for _v in VOCABULARIES:
  globals()[f'linen_{_v}'], globals()[f'nnx_{_v}'] = _linen(_v), _nnx(_v)
