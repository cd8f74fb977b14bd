"""The pure train and eval steps: `state, batch -> state, metrics`.

No mesh, no sharding, no I/O here: parallel/strategy.py decides how these run
over devices, and the same functions serve every strategy.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from trainer.state import TrainState

Batch = dict[str, jax.Array]  # 'inputs' and 'targets', both int32 (B, L).


def loss_fn(params, batch: Batch, apply_fn: Callable[..., jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Mean next-token cross entropy in float32."""
  logits_BLV = apply_fn({'params': params}, batch['inputs'])
  losses_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch['targets'])
  loss = jnp.mean(losses_BL)
  return loss, {'loss': loss}


def train_step(state: TrainState, batch: Batch, *, apply_fn, tx: optax.GradientTransformation,
               schedule: optax.Schedule) -> tuple[TrainState, dict[str, Any]]:
  (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, apply_fn)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, grad_norm=optax.global_norm(grads), learning_rate=schedule(state.step))
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params, batch: Batch, *, apply_fn) -> dict[str, jax.Array]:
  _, metrics = loss_fn(params, batch, apply_fn)
  return metrics
