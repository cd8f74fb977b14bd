"""AdamW with linear warmup and cosine decay, clipped by global norm.

With the default float32 parameters Adam's moments are float32. optax keeps the
second moment in the parameters' dtype and the first in `train.adam_mu_dtype`:
a bfloat16 first moment saves a quarter of the optimizer state's memory; the
second moment, whose small values bfloat16 would round away, stays float32.
"""

import jax.numpy as jnp
import ml_collections
import optax


def learning_rate_schedule(train_config) -> optax.Schedule:
  peak = train_config.learning_rate
  warmup = min(train_config.warmup_steps, train_config.steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=warmup,
      decay_steps=max(train_config.steps, warmup + 1),
      end_value=peak * train_config.end_learning_rate_ratio)


def schedule_change(saved_train: dict, train_config, step: int) -> tuple[float, float] | None:
  """(saved, new) learning rate for the update after `step` if the config's schedule moves it, else None.

  Extending train.steps recomputes a cosine decay, so the learning rate jumps at the
  resume step (300 -> 400 steps: 3.0e-4 becomes 7.6e-4 at step 301 of the default
  job); a warmup-stable-decay schedule still in its stable phase does not move.
  """
  saved = ml_collections.ConfigDict({**train_config.to_dict(), **saved_train})
  before, after = float(learning_rate_schedule(saved)(step)), float(learning_rate_schedule(train_config)(step))
  return None if abs(after - before) <= 1e-6 * max(abs(before), 1e-30) else (before, after)


def build_optimizer(train_config) -> tuple[optax.GradientTransformation, optax.Schedule]:
  schedule = learning_rate_schedule(train_config)
  adamw = optax.adamw(schedule, b1=train_config.adam_b1, b2=train_config.adam_b2,
                      weight_decay=train_config.weight_decay, mu_dtype=jnp.dtype(train_config.adam_mu_dtype))
  if train_config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(train_config.grad_clip_norm), adamw), schedule
  return adamw, schedule
