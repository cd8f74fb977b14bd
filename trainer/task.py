"""The task interface: what the launcher needs from a model, and how it gets it from the config.

A user brings a model and the launcher brings everything else. The least a
user writes is one class (or a function returning one):

- how to build it from the config: `MyModel(config, rngs=...)` for Flax NNX,
  or `build(config) -> linen.Module` for Linen (modules are not rewritten);
- the logical axis names of its parameters (`nnx.with_partitioning`,
  `nn.with_logical_partitioning`), which `parallel.logical_axis_rules` map to
  mesh axes;
- its call: `model(inputs)` -> logits for `model.task='lm'`, `model(images)`
  -> logits for 'classifier'. The loss, metrics and the batch's shapes come from
  the task (trainer/objectives.py); a class that defines
  `loss(self, batch) -> (loss, metrics)` uses its own loss instead (the loss is
  a mean over the task's weight: tokens for 'lm', rows for 'classifier').

`config.model.name` picks it: a registered short name (trainer/models/registry.py)
or an import path 'my_pkg.my_module:MyModel'. Everything about the model is
checked here, before any compile.
"""

import dataclasses
from collections.abc import Sequence

import flax.linen as nn
import jax

from parallel import sharding
from trainer import objectives
from trainer.errors import UserError
from trainer.models import adapters, registry

Batch = objectives.Batch
Metrics = objectives.Metrics


@dataclasses.dataclass(frozen=True)
class Task:
  objective: objectives.Objective
  model: adapters.AdaptedModel
  custom_loss: bool  # The model's class defines `loss(self, batch)`.

  def loss(self, params, batch: Batch) -> tuple[jax.Array, Metrics]:
    """(loss to minimize, metrics), both means over `weight(batch)`."""
    model = self.model.bind(params)
    if self.custom_loss:
      return model.loss(batch)
    return self.objective.loss(model, batch)

  def weight(self, batch: Batch) -> jax.Array:
    return self.objective.weight(batch)

  def batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
    return self.objective.batch_shapes()


def build_task(config, mesh=None, rules: Sequence = ()) -> Task:
  """Resolves `model.name`, builds the model abstractly and checks its parameters' logical axes against `rules`.

  `mesh` goes to model builders that take one (activation sharding constraints
  under the 'jit' strategy); `rules` are also what every parameter name must be in.
  """
  name = config.model.name
  made_for = registry.registered_task(name)
  if made_for is not None and made_for != config.model.task:
    raise UserError(f"model.name={name!r} is a {made_for!r} model but model.task={config.model.task!r}; "
                    f"set --config.model.task={made_for}.")
  objective = objectives.for_config(config)
  builder = registry.resolve(name)
  model = adapters.adapt(builder, config, objectives.example_inputs(objective), mesh, rules)
  check_axis_names(model, name, rules)
  return Task(objective, model, custom_loss=callable(getattr(model.module_class, 'loss', None)))


def check_axis_names(model: adapters.AdaptedModel, name: str, rules: Sequence) -> None:
  """Every parameter names each of its dimensions, with names the rules know; else one error listing them."""
  is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
  leaves = jax.tree_util.tree_flatten_with_path(model.abstract_boxed, is_leaf=is_box)[0]
  unnamed = [f'{sharding.path_name(p)} {tuple(leaf.shape)}' for p, leaf in leaves if not is_box(leaf)]
  if unnamed:
    how = ('nnx.with_partitioning(init, names) on its initializer' if model.framework == 'nnx'
           else 'nn.with_logical_partitioning(init, names) on its initializer')
    raise UserError(f'model.name={name!r}: {len(unnamed)} parameter(s) have no logical axis names: '
                    f'{", ".join(unnamed[:6])}{" ..." if len(unnamed) > 6 else ""}. Name every dimension with {how}, '
                    f"e.g. ('embed', 'mlp'); parallel.logical_axis_rules maps the names to mesh axes.")
  known = {rule[0] for rule in rules}
  for p, box in leaves:
    names, where = tuple(box.names), sharding.path_name(p)
    if len(names) != len(box.value.shape):
      raise UserError(f'model.name={name!r}: parameter {where} has shape {tuple(box.value.shape)} but '
                      f'{len(names)} axis names {names}; give one name (or None) per dimension.')
    missing = [n for n in names if n is not None and n not in known]
    if rules and missing:
      raise UserError(f'model.name={name!r}: parameter {where} uses logical axis name(s) {missing} that '
                      f'parallel.logical_axis_rules does not map; add e.g. ({missing[0]!r}, None) (replicated) or '
                      f"({missing[0]!r}, 'tensor') to the rules in your config.")
