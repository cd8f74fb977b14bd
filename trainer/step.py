"""The pure train and eval steps: `state, batch -> state, metrics`.

No mesh, no sharding, no I/O here: parallel/strategy.py decides how these run
over devices. The step is two halves so a strategy can take over the first:
`grads_and_metrics` (forward and backward on a batch) and `apply_gradients`
(the optimizer update). Every strategy runs the same loss and the same update.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from trainer.state import TrainState

Batch = dict[str, jax.Array]  # 'inputs' and 'targets', both int32 (B, L).
Metrics = dict[str, jax.Array]


def loss_fn(params, batch: Batch, apply_fn: Callable[..., jax.Array]) -> tuple[jax.Array, Metrics]:
  """Mean next-token cross entropy in float32."""
  logits_BLV = apply_fn({'params': params}, batch['inputs'])
  losses_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch['targets'])
  loss = jnp.mean(losses_BL)
  return loss, {'loss': loss}


def grads_and_metrics(params, batch: Batch, apply_fn) -> tuple[Any, Metrics]:
  """Gradients of the batch-mean loss, and the batch's metrics (means over the batch)."""
  (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, apply_fn)
  return grads, metrics


def apply_gradients(state: TrainState, grads, metrics: Metrics, *, tx: optax.GradientTransformation,
                    schedule: optax.Schedule) -> tuple[TrainState, Metrics]:
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, grad_norm=optax.global_norm(grads), learning_rate=schedule(state.step))
  metrics['param_norm'] = optax.tree.norm(params)  # Of the updated parameters (optax.global_norm is deprecated).
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def train_step(state: TrainState, batch: Batch, *, apply_fn, tx: optax.GradientTransformation,
               schedule: optax.Schedule) -> tuple[TrainState, Metrics]:
  grads, metrics = grads_and_metrics(state.params, batch, apply_fn)
  return apply_gradients(state, grads, metrics, tx=tx, schedule=schedule)


def eval_step(params, batch: Batch, *, apply_fn) -> Metrics:
  _, metrics = loss_fn(params, batch, apply_fn)
  return metrics
