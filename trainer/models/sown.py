"""Loss terms and metrics a Linen model sows while it runs, gathered into the step's loss and metrics.

A layer calls `loss_term(self, name, value)` for a scalar to add to the loss
(already weighted) and `metric(self, name, value)` for a value to log; the
launcher applies Linen models with these two collections mutable
(trainer/models/adapters.py) and `add_to_loss` folds them into the objective's
(loss, metrics). The MoE layer's balancing and router z-losses travel this way
(trainer/models/moe.py), and so can a brought Linen model's own terms.

Scanned layers stack what they sow along the scan axis (the Llama scans with
these collections on axis 0), so a metric sown once per layer arrives as one
value per layer and is logged per layer: 'layers_3/mlp/load_max' for the 4th
scanned layer, 'block_3/mlp/load_max' when layers are unrolled. A metric named
'*_per_expert' keeps its last axis (one value per expert); it reaches the host
(trainer/observe/expert_load.py) but not the scalar log.
"""

import jax
import jax.numpy as jnp

from trainer.models import router_bias

LOSSES = 'aux_loss'  # Scalars added to the loss, weighted by the layer.
METRICS = 'aux_metrics'  # Values logged, never differentiated into the loss.
COLLECTIONS = (LOSSES, METRICS, router_bias.NEXT)  # NEXT: the router biases' next values, for the step.
PER_EXPERT = '_per_expert'


def loss_term(module, name: str, value) -> None:
  module.sow(LOSSES, name, value)


def metric(module, name: str, value) -> None:
  module.sow(METRICS, name, jax.lax.stop_gradient(value))


def _leaves(tree):
  """(path parts without sow's tuple index, value) for every sown array."""
  for path, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
    parts = [str(getattr(k, 'key', k)) for k in path if not isinstance(k, jax.tree_util.SequenceKey)]
    yield parts, value


def _per_layer(parts: list[str], value, trailing: int) -> dict[str, jax.Array]:
  """One entry per index of the leading (stacked) axes, the index appended to the first path part."""
  stacked = value.shape[:value.ndim - trailing]
  if not stacked:
    return {'/'.join(parts): value}
  flat = value.reshape((-1,) + value.shape[value.ndim - trailing:])
  return {'/'.join([f'{parts[0]}_{i}'] + parts[1:]): flat[i] for i in range(flat.shape[0])}


def add_to_loss(loss: jax.Array, metrics: dict, sown: dict) -> tuple[jax.Array, dict]:
  """`loss` plus every sown loss term; `metrics` plus each term's total by name and each sown metric per layer."""
  metrics = dict(metrics)
  for parts, value in _leaves(sown.get(LOSSES, {})):
    total = jnp.sum(value).astype(jnp.float32)
    loss = loss + total
    metrics[parts[-1]] = metrics.get(parts[-1], 0.0) + total
  for parts, value in _leaves(sown.get(METRICS, {})):
    metrics.update(_per_layer(parts, value, trailing=1 if parts[-1].endswith(PER_EXPERT) else 0))
  loads = [v for k, v in metrics.items() if k.endswith('/load_max')]
  if loads:  # The busiest expert of the busiest layer, as a multiple of its share: one number for the console.
    metrics['moe_load_max'] = jnp.max(jnp.stack(loads))
  if router_bias.NEXT in sown:  # Not a metric: trainer/training/step.py takes it out and writes it into the params.
    metrics[router_bias.NEXT] = router_bias.next_values(sown)
  return loss, metrics
