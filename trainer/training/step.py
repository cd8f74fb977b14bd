"""The pure train and eval steps: `state, batch -> state, metrics`.

No mesh, no sharding, no I/O here: trainer/training/strategy.py decides how these run
over devices. The step is two halves so a strategy can take over the first:
`grads_and_metrics` (forward and backward on a batch) and `apply_gradients`
(the optimizer update). Every strategy runs the same loss and the same update.

The loss comes from the task (trainer/training/task.py): anything with
`loss(params, batch) -> (loss, metrics)`, a mean over `weight(batch)` units
(tokens, rows). Gradient accumulation lives in `grads_and_metrics`, so every
strategy gets it: the (local) batch is cut into `grad_accum_steps` microbatches
that `lax.scan` runs one after another, each weighted by its share of the
batch's units, summing float32 gradients; the result is the gradient of the
whole batch's mean loss, as one large step would give, even when padding is
spread unevenly over the microbatches.
"""

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import optax

from trainer.models import router_bias
from trainer.safety import guardrails
from trainer.training.state import TrainState

Batch = dict[str, jax.Array]  # LM: 'inputs', 'targets' (+ 'segment_ids', 'positions'); classifier: 'images', 'labels'.
Metrics = dict[str, jax.Array]


class LossTask(Protocol):
  """What the step needs from a task (trainer.training.task.Task is one)."""

  def loss(self, params, batch: Batch) -> tuple[jax.Array, Metrics]: ...  # Also `frozen=` when the state has one.

  def weight(self, batch: Batch) -> jax.Array: ...


GRADS_SCOPE = 'grads_and_metrics'


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """The static settings of the gradient computation, from `config.train`."""
  grad_accum_steps: int = 1  # Microbatches per step.

  @classmethod
  def from_config(cls, train_config) -> 'StepOptions':
    return cls(grad_accum_steps=train_config.grad_accum_steps)


def _microbatches(x: jax.Array, n: int) -> jax.Array:
  """(B, ...) -> (n, B/n, ...), microbatch j holding rows j, j+n, j+2n, ...

  Strided rather than contiguous: each device's contiguous shard of the batch
  then holds B/n/devices rows of every microbatch, so no rows move between devices.
  """
  return jnp.swapaxes(x.reshape((x.shape[0] // n, n) + x.shape[1:]), 0, 1)


def _loss_fn(task: LossTask, frozen):
  """The task's loss, given the frozen parameters it reads but never trains (DPO's reference) when there are any."""
  return task.loss if frozen is None else functools.partial(task.loss, frozen=frozen)


def grads_and_metrics(params, batch: Batch, task: LossTask, options: StepOptions = StepOptions(),
                      frozen=None) -> tuple[Any, Metrics]:
  """Gradients of the batch-mean loss, and the batch's metrics (means over the batch); `frozen`: parameters the
  loss reads without differentiating them (TrainState.reference_params)."""
  loss_fn = _loss_fn(task, frozen)

  def grad_fn(batch, scale=1.0):
    def scaled_loss(p):
      loss, metrics = loss_fn(p, batch)
      return scale * loss, jax.tree.map(lambda m: scale * m, metrics)
    (_, metrics), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
    return grads, metrics

  n = options.grad_accum_steps
  if n == 1:
    return grad_fn(batch)

  # Microbatch j's mean counts with its share w_j / W of the batch's units, so the
  # sum over microbatches is the whole batch's mean even when padding is uneven.
  total = jnp.maximum(task.weight(batch), 1e-9)

  def accumulate(totals, microbatch):
    grads_metrics = grad_fn(microbatch, task.weight(microbatch) / total)
    return jax.tree.map(lambda t, x: t + x.astype(jnp.float32), totals, grads_metrics), None

  micro = jax.tree.map(lambda x: _microbatches(x, n), batch)
  shapes = jax.eval_shape(grad_fn, jax.tree.map(lambda x: x[0], micro))
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)
  (grads, metrics), _ = jax.lax.scan(accumulate, zeros, micro)
  return jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params), metrics


def apply_gradients(state: TrainState, grads, metrics: Metrics, *, tx: optax.GradientTransformation,
                    schedule: optax.Schedule) -> tuple[TrainState, Metrics]:
  metrics = dict(metrics)
  next_bias = metrics.pop(router_bias.NEXT, None)  # model.router_bias_rate > 0: each MoE layer's bias after this step.
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = router_bias.apply_next(optax.apply_updates(state.params, updates), next_bias)
  metrics = dict(metrics, grad_norm=optax.tree.norm(grads), learning_rate=schedule(state.step),
                 grads_finite=guardrails.leaf_finite(grads))  # Names non-finite leaves on the host.
  metrics['param_norm'] = optax.tree.norm(params)  # Of the updated parameters.
  ema = state.ema_params
  if ema is not None:  # In float32 whatever the parameters' dtype: bfloat16 would round away (1 - decay) x update.
    ema = jax.tree.map(lambda e, p: state.ema_decay * e + (1 - state.ema_decay) * p.astype(jnp.float32), ema, params)
  return state.replace(step=state.step + 1, params=params, opt_state=opt_state, ema_params=ema), metrics


def train_step(state: TrainState, batch: Batch, *, task: LossTask, tx: optax.GradientTransformation,
               schedule: optax.Schedule, options: StepOptions = StepOptions()) -> tuple[TrainState, Metrics]:
  with jax.named_scope(GRADS_SCOPE):  # Where trainer/observe/flops.py finds the step's model FLOPs in its jaxpr.
    grads, metrics = grads_and_metrics(state.params, batch, task, options, state.reference_params)
  return apply_gradients(state, grads, metrics, tx=tx, schedule=schedule)


def eval_step(params, batch: Batch, frozen=None, *, task: LossTask) -> Metrics:
  _, metrics = _loss_fn(task, frozen)(params, batch)
  return {k: v for k, v in metrics.items() if k != router_bias.NEXT}
