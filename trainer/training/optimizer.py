"""The optimizer and learning-rate schedule named by `train.optimizer` and `train.schedule`, clipped by global norm.

Every optimizer is optax's own: 'adamw', 'adafactor', 'lion', 'muon' (Muon on
weight matrices, AdamW on the rest; trainer/training/param_groups.py says which is which)
and 'sgd' (momentum, optionally Nesterov; its weight decay is the classic L2
term added to the gradient). Weight decay skips rank-1 parameters and those
matching `train.weight_decay_exclude`.

With the default float32 parameters Adam's moments are float32. optax keeps the
second moment in the parameters' dtype and the first in `train.adam_mu_dtype`:
a bfloat16 first moment saves a quarter of the optimizer state's memory; the
second moment, whose small values bfloat16 would round away, stays float32.
Despite its name the key sets the first moment (momentum) of every optimizer
that keeps one (Lion's, SGD's, Muon's), so a preset that asks for a bfloat16
first moment can switch optimizer by one flag; Adafactor keeps none.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from trainer.base.errors import UserError
from trainer.models import lora
from trainer.training import param_groups

OPTIMIZERS = ('adamw', 'adafactor', 'lion', 'muon', 'sgd')
SCHEDULES = ('cosine', 'linear', 'constant', 'wsd', 'rsqrt')
DECAY_SHAPES = ('linear', '1-sqrt')
# The keys only some optimizers read; set on another optimizer they would be silently ignored.
OWN_KEYS = {
    'adam_b1': ('adamw', 'muon'), 'adam_b2': ('adamw', 'muon'),
    'adafactor_min_dim_size_to_factor': ('adafactor',), 'adafactor_decay_rate': ('adafactor',),
    'lion_b1': ('lion',), 'lion_b2': ('lion',),
    'muon_beta': ('muon',), 'muon_ns_steps': ('muon',), 'muon_consistent_rms': ('muon',),
    'sgd_momentum': ('sgd',), 'sgd_nesterov': ('sgd',),
}


def validate(train_config, defaults) -> None:
  """One line for an unknown name, or a key of another optimizer set away from its default."""
  if train_config.optimizer not in OPTIMIZERS:
    raise UserError(f'train.optimizer={train_config.optimizer!r} is not one of {", ".join(OPTIMIZERS)}.')
  if train_config.schedule not in SCHEDULES:
    raise UserError(f'train.schedule={train_config.schedule!r} is not one of {", ".join(SCHEDULES)}.')
  if train_config.decay_shape not in DECAY_SHAPES:
    raise UserError(f'train.decay_shape={train_config.decay_shape!r} is not one of {", ".join(DECAY_SHAPES)}.')
  if not 0 < train_config.decay_fraction <= 1:
    raise UserError(f'train.decay_fraction={train_config.decay_fraction} must be in (0, 1].')
  if not 0 <= train_config.ema_decay < 1:
    raise UserError(f'train.ema_decay={train_config.ema_decay} must be in [0, 1) (0 = no average; 0.999 is typical).')
  for key, owners in OWN_KEYS.items():
    if train_config.optimizer not in owners and train_config[key] != defaults[key]:
      raise UserError(f'train.{key}={train_config[key]!r} applies only to train.optimizer={" or ".join(owners)}, '
                      f'not {train_config.optimizer!r}: remove it or change train.optimizer.')


def unused_first_moment_dtype(train_config, defaults) -> str | None:
  """A note when `train.adam_mu_dtype` is set but the optimizer keeps no first moment to store in it."""
  t = train_config
  if t.adam_mu_dtype == defaults.adam_mu_dtype:
    return None
  if t.optimizer == 'adafactor' or (t.optimizer == 'sgd' and not t.sgd_momentum):
    return (f'train.adam_mu_dtype={t.adam_mu_dtype!r} is unused: train.optimizer={t.optimizer!r}'
            f'{" with train.sgd_momentum=0" if t.optimizer == "sgd" else ""} keeps no first moment.')
  return None


def learning_rate_schedule(train_config) -> optax.Schedule:
  """Linear warmup from 0 to train.learning_rate, then the named decay to end_learning_rate_ratio x peak."""
  peak = train_config.learning_rate
  end = peak * train_config.end_learning_rate_ratio
  steps = train_config.steps
  warmup = min(train_config.warmup_steps, steps)
  if train_config.schedule == 'cosine':
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=peak, warmup_steps=warmup,
                                              decay_steps=max(steps, warmup + 1), end_value=end)
  ramp = optax.linear_schedule(0.0, peak, warmup) if warmup else optax.constant_schedule(peak)
  if train_config.schedule == 'linear':
    after = optax.linear_schedule(peak, end, max(steps - warmup, 1))
  elif train_config.schedule == 'constant':
    after = optax.constant_schedule(peak)
  elif train_config.schedule == 'rsqrt':
    # peak * sqrt(warmup / step): continuous at the end of warmup.
    after = lambda count: peak * jnp.sqrt(max(warmup, 1) / jnp.maximum(count + max(warmup, 1), 1))
  else:  # 'wsd': the decay's start depends only on steps, so a longer run stays stable longer.
    decay = max(round(train_config.decay_fraction * steps), 1)
    stable = max(steps - decay - warmup, 0)
    if train_config.decay_shape == 'linear':
      tail = optax.linear_schedule(peak, end, decay)
    else:  # '1-sqrt' (Hägele et al. 2024): end + (peak - end) * (1 - sqrt(t / decay)).
      tail = lambda count: end + (peak - end) * (1 - jnp.sqrt(jnp.clip(count / decay, 0.0, 1.0)))
    after = optax.join_schedules([optax.constant_schedule(peak), tail], [stable])
  return optax.join_schedules([ramp, after], [warmup])


def describe(train_config) -> str:
  """The optimizer and its schedule in one line for the console: what a run trains with, without opening the config."""
  t = train_config
  decay = 'constant' if t.schedule == 'constant' else f'{t.schedule} to {t.end_learning_rate_ratio:g}x'
  if t.schedule == 'rsqrt':
    decay = 'rsqrt'
  clip = f'gradients clipped to global norm {t.grad_clip_norm:g}' if t.grad_clip_norm > 0 else 'no gradient clipping'
  return (f'Optimizer: {t.optimizer}, learning rate {t.learning_rate:g} after {min(t.warmup_steps, t.steps)} warmup '
          f'steps, then {decay} over {t.steps} steps; weight decay {t.weight_decay:g}; {clip}')


def schedule_change(saved_train: dict, train_config, step: int) -> tuple[float, float] | None:
  """(saved, new) learning rate for the update after `step` if the config's schedule moves it, else None.

  Extending train.steps recomputes a cosine decay, so the learning rate jumps at the
  resume step (300 -> 400 steps: 3.0e-4 becomes 7.6e-4 at step 301 of the default
  job); a warmup-stable-decay schedule still in its stable phase does not move.
  """
  saved = ml_collections.ConfigDict({**train_config.to_dict(), **saved_train})
  before, after = float(learning_rate_schedule(saved)(step)), float(learning_rate_schedule(train_config)(step))
  return None if abs(after - before) <= 1e-6 * max(abs(before), 1e-30) else (before, after)


def _base(train_config, schedule, infos):
  t = train_config
  if infos is None:  # No parameter tree given (unit tests of the step): decay every matrix by rank alone.
    decay_mask = None
  else:
    decay_mask = param_groups.tree_of(infos, lambda info: param_groups.decays(info, t.weight_decay_exclude))
  mu_dtype = jnp.dtype(t.adam_mu_dtype)
  if t.optimizer == 'adamw':
    return optax.adamw(schedule, b1=t.adam_b1, b2=t.adam_b2, weight_decay=t.weight_decay, mu_dtype=mu_dtype,
                       mask=decay_mask)
  if t.optimizer == 'adafactor':
    # optax adds Adafactor's decay after the learning-rate scaling (at a constant 0.1 the tiny LM's
    # loss rose within 30 steps): scaled here by the schedule, so it means AdamW's lr x weight_decay.
    decay_rate = (lambda count: t.weight_decay * schedule(count)) if t.weight_decay else None
    return optax.adafactor(schedule, min_dim_size_to_factor=t.adafactor_min_dim_size_to_factor,
                           decay_rate=t.adafactor_decay_rate, weight_decay_rate=decay_rate,
                           weight_decay_mask=decay_mask)
  if t.optimizer == 'lion':
    return optax.lion(schedule, b1=t.lion_b1, b2=t.lion_b2, mu_dtype=mu_dtype, weight_decay=t.weight_decay,
                      mask=decay_mask)
  if t.optimizer == 'muon':
    # consistent_rms scales each orthogonalized update to AdamW's typical RMS, so one
    # train.learning_rate serves both the Muon and the AdamW parameters.
    dimensions = None if infos is None else param_groups.tree_of(infos, param_groups.muon_dimensions)
    return optax.contrib.muon(schedule, ns_steps=t.muon_ns_steps, beta=t.muon_beta, weight_decay=t.weight_decay,
                              weight_decay_mask=decay_mask, mu_dtype=mu_dtype, adam_b1=t.adam_b1,
                              adam_b2=t.adam_b2, adam_weight_decay=t.weight_decay,
                              muon_weight_dimension_numbers=dimensions, consistent_rms=t.muon_consistent_rms)
  decay = optax.add_decayed_weights(t.weight_decay, decay_mask) if t.weight_decay else optax.identity()
  return optax.chain(decay, optax.sgd(schedule, momentum=t.sgd_momentum or None, nesterov=t.sgd_nesterov,
                                           accumulator_dtype=mu_dtype))


def decaying_params(train_config, abstract_params) -> dict[str, bool]:
  """'/'-joined parameter path -> whether weight decay applies to it (the sharding table's 'decay' column)."""
  frozen = lora.has_adapters(abstract_params)  # LoRA: only the adapters are updated, hence decayed.
  return {path: param_groups.decays(info, train_config.weight_decay_exclude) and train_config.weight_decay > 0
          and not (frozen and not lora.is_adapter(path.split('/')))
          for path, info in param_groups.describe(abstract_params).items()}


def build_optimizer(train_config, abstract_params=None) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The clipped optimizer and its schedule.

  Args:
    train_config: `config.train`.
    abstract_params: the model's abstract parameters with their logical-axis boxes
      (`AdaptedModel.abstract_boxed`): which leaves decay and which are Muon's
      matrices is read from their paths, ranks and axis names.
  """
  schedule = learning_rate_schedule(train_config)
  infos = None if abstract_params is None else param_groups.describe(abstract_params)
  tx = _base(train_config, schedule, infos)
  if train_config.grad_clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(train_config.grad_clip_norm), tx)
  if abstract_params is not None and lora.has_adapters(abstract_params):
    # LoRA: the optimizer (and its clipping) sees only the adapters; the frozen base gets no state and no update.
    tx = optax.multi_transform({'adapter': tx, 'frozen': optax.set_to_zero()}, lora.labels)
  return tx, schedule


def fit_state_axes(boxed_opt_state):
  """Logical axes for optimizer-state leaves whose rank differs from their parameter's.

  optax maps its init over the parameters' boxes, so every state leaf inherits
  its parameter's axis names, even Adafactor's factored second moments, which
  have one axis fewer: `v_row` drops the last axis, `v_col` the one before it,
  and their names follow. Any other leaf whose rank disagrees (Adafactor's (1,)
  placeholders) is left unnamed, hence replicated.
  """
  def fit(path, leaf):
    if not isinstance(leaf, nn.meta.AxisMetadata):
      return leaf
    if not hasattr(leaf.value, 'shape'):  # Muon's MaskedNode where a parameter belongs to the other partition.
      return leaf.value
    names, shape = tuple(leaf.names), leaf.value.shape
    if len(names) == len(shape) + 1:
      dropped = len(names) - (2 if 'v_col' in jax.tree_util.keystr(path) else 1)
      names = names[:dropped] + names[dropped + 1:]
    if len(names) != len(shape):
      return leaf.value
    # A length-1 axis (a placeholder, whatever its parameter was) is never split.
    return leaf.replace(names=tuple(None if size == 1 else n for n, size in zip(names, shape)))
  return jax.tree_util.tree_map_with_path(fit, boxed_opt_state, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
