"""All the glue between the launcher and this folder's models: one builder each, at most 10 lines.

Each model's own axis names that are not the launcher's go in the config,
as `parallel.extra_axis_rules` (RULES below); call conventions too (the
model.call_kwargs / packed_kwarg_names / unshifted_inputs keys, set in
tests/test_brought_models.py); nothing else is needed.
"""

import jax.numpy as jnp

from tests.third_party import (do_linen, gemma_nnx, lm1b_linen, meshy_linen, nnx_lm, prefix_linen, tunix_llama3,
                               vit_linen)
from trainer.memory import remat

# gemma_style's 'tp' and lm1b's 'kv' are in the default rules (parallel/vocabularies.py); prefix names the heads of
# its flat kernels 'kv', which the default keeps whole, and splits them with its own rule, which wins.
RULES = {'meshy': (('model', 'tensor'),), 'prefix': (('kv', 'tensor'), ('joined_kv', 'tensor')),
         'gemma_style': (), 'gemma_explicit': (), 'do': (), 'lm1b': (), 'vit': (), 'gemma': (), 'tunix_llama': ()}


def meshy(config, dtype):  # Its mesh axis 'data' is the launcher's; 'model' is mapped by a rule.
  m = config.model
  return meshy_linen.TransformerDo(meshy_linen.DoConfig(m.vocab_size, m.d_model, m.num_heads, m.num_layers,
                                                        dtype=dtype))


def prefix(config, shift=False):  # Takes no dtype: the launcher casts its parameters.
  m = config.model
  return prefix_linen.TransformerLM(prefix_linen.LMConfig(m.vocab_size, m.d_model, m.num_heads, m.num_layers,
                                                          m.mlp_dim, shift=shift))


def prefix_as_published(config):  # Shifts its inputs itself: the launcher's alignment probe refuses it.
  return prefix(config, shift=True)


def gemma_style(config, *, rngs, dtype, remat_policy, sharding=nnx_lm.ShardingConfig.fsdp_tp):
  m = config.model
  cfg = nnx_lm.TransformerConfig(m.vocab_size, m.d_model, m.num_heads, m.num_layers, m.mlp_dim, sharding())
  policy = False if remat_policy == 'none' else remat.checkpoint_policy(remat_policy)
  return nnx_lm.Transformer(cfg, rngs=rngs, dtype=dtype, remat_policy=policy)


def do(config, dtype):  # Names only the launcher's own mesh axis 'data': no rule needed.
  m = config.model
  return do_linen.TransformerDo(do_linen.DoConfig(m.d_model, m.num_heads, config.data.seq_len, m.num_layers,
                                                  m.vocab_size, m.mlp_dim, dtype=dtype))



def lm1b(config, dtype):  # Config keys do the rest: model.unshifted_inputs, model.packed_kwarg_names, packed_positions.
  m = config.model
  return lm1b_linen.TransformerLM(lm1b_linen.TransformerConfig(m.vocab_size, m.d_model, m.num_heads, m.num_layers,
                                                               m.d_model, m.mlp_dim, config.data.seq_len, dtype))


def vit(config, dtype):  # Its required train= comes from model.call_kwargs / model.eval_call_kwargs.
  m = config.model
  return vit_linen.VisionTransformer(vit_linen.ViTConfig(m.num_classes, m.patch_size, m.d_model, m.num_heads,
                                                         m.num_layers, m.mlp_dim, dtype=dtype))


def gemma_explicit(config, *, rngs, dtype, remat_policy):  # Refused: its out_sharding= needs Explicit mesh axes.
  return gemma_style(config, rngs=rngs, dtype=dtype, remat_policy=remat_policy,
                     sharding=nnx_lm.ShardingConfig.fsdp_tp_explicit)


# The decoding convention, model(tokens, positions, cache, attention_mask) -> (logits, cache): the launcher calls it
# so by its parameter names (trainer/models/call_convention.py); the glue only maps the config.
def gemma(config, *, rngs, dtype):  # flax's Gemma example: its own init_cache serves scripts/sample.py.
  m = config.model
  return gemma_nnx.Transformer(gemma_nnx.TransformerConfig(m.num_layers, m.vocab_size, m.d_model, m.mlp_dim, m.num_heads,
                                                           m.d_model // m.num_heads, m.num_heads, dtype), rngs=rngs)


def tunix_llama(config, *, rngs):  # No dtype: the launcher casts its parameters.
  m = config.model
  return _Llama3WithCache(tunix_llama3.ModelConfig(m.num_layers, m.vocab_size, m.d_model, m.mlp_dim, m.num_heads,
                                                   m.d_model // m.num_heads, m.num_kv_heads or m.num_heads), rngs=rngs)


class _Llama3WithCache(tunix_llama3.Llama3):  # tunix's sampler makes the cache; sample.py asks the model for one.
  def init_cache(self, cache_size: int, batch_size: int, dtype):
    c = self.config
    shape = (batch_size, cache_size, c.num_kv_heads, c.head_dim)
    return {f'layer_{i}': {'k': jnp.zeros(shape, dtype), 'v': jnp.zeros(shape, dtype),
                           'end_index': jnp.zeros((batch_size,), jnp.int32)} for i in range(c.num_layers)}
