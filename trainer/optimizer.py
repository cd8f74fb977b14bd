"""AdamW with linear warmup and cosine decay, clipped by global norm.

With the default float32 parameters Adam's moments are float32. optax keeps the
second moment in the parameters' dtype and the first in `train.adam_mu_dtype`:
a bfloat16 first moment saves a quarter of the optimizer state's memory; the
second moment, whose small values bfloat16 would round away, stays float32.
"""

import jax.numpy as jnp
import optax


def learning_rate_schedule(train_config) -> optax.Schedule:
  peak = train_config.learning_rate
  warmup = min(train_config.warmup_steps, train_config.steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(train_config.steps, warmup + 1),
      end_value=peak * train_config.end_learning_rate_ratio)


def build_optimizer(train_config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = learning_rate_schedule(train_config)
  adamw = optax.adamw(schedule, b1=train_config.adam_b1, b2=train_config.adam_b2,
                      weight_decay=train_config.weight_decay, mu_dtype=jnp.dtype(train_config.adam_mu_dtype))
  if train_config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(train_config.grad_clip_norm), adamw), schedule
  return adamw, schedule
