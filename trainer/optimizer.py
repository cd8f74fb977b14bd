"""AdamW with linear warmup and cosine decay, clipped by global norm."""

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
                      weight_decay=train_config.weight_decay)
  if train_config.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(train_config.grad_clip_norm), adamw), schedule
  return adamw, schedule
