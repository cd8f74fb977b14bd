"""The pure train and eval steps: `state, batch -> state, metrics`.

No mesh, no sharding, no I/O here: parallel/strategy.py decides how these run
over devices. The step is two halves so a strategy can take over the first:
`grads_and_metrics` (forward and backward on a batch) and `apply_gradients`
(the optimizer update). Every strategy runs the same loss and the same update.

Gradient accumulation lives in `grads_and_metrics`, so every strategy gets it:
the (local) batch is cut into `grad_accum_steps` microbatches that `lax.scan`
runs one after another, summing float32 gradients; the result is the gradient
of the mean loss over the whole batch, as one large step would give.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from trainer import guardrails
from trainer.state import TrainState

Batch = dict[str, jax.Array]  # 'inputs', 'targets' (+ 'segment_ids', 'positions' when packed), int32 (B, L).
Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """The static settings of the loss and the gradient computation, from `config.train`."""
  grad_accum_steps: int = 1  # Microbatches per step.
  z_loss_weight: float = 0.0  # Weight of mean(logsumexp(logits)^2) added to the loss; 0 = off.

  @classmethod
  def from_config(cls, train_config) -> 'StepOptions':
    return cls(grad_accum_steps=train_config.grad_accum_steps, z_loss_weight=float(train_config.z_loss_weight))


def token_weights(batch: Batch) -> jax.Array:
  """1.0 for tokens that count in the loss, 0.0 for padding (segment id 0 in packed batches)."""
  if 'segment_ids' in batch:
    return (batch['segment_ids'] != 0).astype(jnp.float32)
  return jnp.ones(batch['targets'].shape, jnp.float32)


def loss_fn(params, batch: Batch, apply_fn: Callable[..., jax.Array], z_loss_weight: float = 0.0,
            num_tokens: jax.Array | None = None) -> tuple[jax.Array, Metrics]:
  """Next-token cross entropy in float32 over non-padding tokens, plus the optional z-loss.

  Sums are divided by `num_tokens` (default: this batch's non-padding tokens), so
  microbatches given the whole batch's count add up to the whole batch's mean.
  The 'loss' metric is the cross entropy alone, so runs with and without z-loss compare.
  """
  logits_BLV = apply_fn({'params': params}, batch['inputs'], segment_ids=batch.get('segment_ids'),
                        positions=batch.get('positions'))
  losses_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch['targets'])
  weights_BL = token_weights(batch)
  if num_tokens is None:
    num_tokens = jnp.maximum(jnp.sum(weights_BL), 1.0)
  loss = jnp.sum(losses_BL * weights_BL) / num_tokens
  if not z_loss_weight:
    return loss, {'loss': loss}
  z_loss = z_loss_weight * jnp.sum(jnp.square(jax.nn.logsumexp(logits_BLV, axis=-1)) * weights_BL) / num_tokens
  return loss + z_loss, {'loss': loss, 'z_loss': z_loss}


def _microbatches(x: jax.Array, n: int) -> jax.Array:
  """(B, ...) -> (n, B/n, ...), microbatch j holding rows j, j+n, j+2n, ...

  Strided rather than contiguous: each device's contiguous shard of the batch
  then holds B/n/devices rows of every microbatch, so no rows move between devices.
  """
  return jnp.swapaxes(x.reshape((x.shape[0] // n, n) + x.shape[1:]), 0, 1)


def grads_and_metrics(params, batch: Batch, apply_fn,
                      options: StepOptions = StepOptions()) -> tuple[Any, Metrics]:
  """Gradients of the batch-mean loss, and the batch's metrics (means over the batch)."""
  def grad_fn(batch, num_tokens=None):
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, apply_fn, options.z_loss_weight,
                                                                     num_tokens)
    return grads, metrics

  n = options.grad_accum_steps
  if n == 1:
    return grad_fn(batch)

  # Every microbatch divides by the whole batch's token count, so the sum of their
  # gradients is the whole batch's mean even when padding is spread unevenly.
  num_tokens = jnp.maximum(jnp.sum(token_weights(batch)), 1.0)

  def accumulate(totals, microbatch):
    return jax.tree.map(lambda t, x: t + x.astype(jnp.float32), totals, grad_fn(microbatch, num_tokens)), None

  micro = jax.tree.map(lambda x: _microbatches(x, n), batch)
  shapes = jax.eval_shape(grad_fn, jax.tree.map(lambda x: x[0], micro), num_tokens)
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
  (grads, metrics), _ = jax.lax.scan(accumulate, zeros, micro)
  return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), metrics


def apply_gradients(state: TrainState, grads, metrics: Metrics, *, tx: optax.GradientTransformation,
                    schedule: optax.Schedule) -> tuple[TrainState, Metrics]:
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  metrics = dict(metrics, grad_norm=optax.tree.norm(grads), learning_rate=schedule(state.step),
                 grads_finite=guardrails.leaf_finite(grads))  # Names non-finite leaves on the host.
  metrics['param_norm'] = optax.tree.norm(params)  # Of the updated parameters.
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def train_step(state: TrainState, batch: Batch, *, apply_fn, tx: optax.GradientTransformation,
               schedule: optax.Schedule, options: StepOptions = StepOptions()) -> tuple[TrainState, Metrics]:
  grads, metrics = grads_and_metrics(state.params, batch, apply_fn, options)
  return apply_gradients(state, grads, metrics, tx=tx, schedule=schedule)


def eval_step(params, batch: Batch, *, apply_fn) -> Metrics:
  _, metrics = loss_fn(params, batch, apply_fn)
  return metrics
