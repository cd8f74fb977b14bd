"""The KV cache of an attention layer while decoding: keys and values kept between calls in a Linen collection.

Shape letters: B batch, L positions of this call, S cache slots, G key/value heads, K head dim.

The first call (the prefill) stores its whole window's keys and values: its length is the cache's, and slot s holds
position s. Each later call writes its tokens' keys and values into the slots of their positions and attends to the
slots up to each query's position (trainer/attention `cached_attention`), so slots past it, stale or never written
(the prefill's padding), are never read. Keys are stored after RoPE: a position's rotation never changes.
"""

import jax.numpy as jnp

COLLECTION = 'cache'


def filled(module) -> bool:
  """Whether `module` has a cache from an earlier call (else this call is the prefill)."""
  return module.has_variable(COLLECTION, 'cached_key')


def fill(module, k_BLGK, v_BLGK) -> None:
  """The prefill's keys and values become `module`'s cache, of the prefill's length."""
  module.variable(COLLECTION, 'cached_key', lambda: k_BLGK)
  module.variable(COLLECTION, 'cached_value', lambda: v_BLGK)


def update(module, k_BLGK, v_BLGK, positions_BL):
  """(keys, values) (B, S, G, K) of the whole cache, with this call's written into the slots of `positions_BL`."""
  batch_B1 = jnp.arange(k_BLGK.shape[0])[:, None]
  out = []
  for name, new_BLGK in (('cached_key', k_BLGK), ('cached_value', v_BLGK)):
    cached = module.variable(COLLECTION, name)
    cached.value = cached.value.at[batch_B1, positions_BL].set(new_BLGK.astype(cached.value.dtype))
    out.append(cached.value)
  return tuple(out)
