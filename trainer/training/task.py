"""The task interface: what the launcher needs from a model, and how it gets it from the config.

A user brings a model and the launcher brings everything else. The least a
user writes is one class (or a function returning one):

- how to build it from the config: `MyModel(config, rngs=...)` for Flax NNX,
  or `build(config) -> linen.Module` for Linen (modules are not rewritten);
- optionally, the axis names of its parameters, logical or mesh axes, as
  Flax writes them (parallel/param_names.py says how each kind is read, and
  what parameters without names get);
- its call: `model(inputs)` -> logits for `model.task='lm'`, where logits[t]
  scores targets[t] = inputs[t + 1] (the batch is already shifted: a model
  must not shift again), `model(images)` -> logits for 'classifier'.
- optional keywords its builder may take: `mesh`, `rules`, `pipeline` (under 'jit'; trainer/pipeline/),
  `dtype` (train.compute_dtype; else its float parameters are cast inside the
  step), `param_dtype`, `remat_policy` (else a warning says it does not apply). The loss, metrics and the batch's shapes come from
  the task (trainer/training/objectives.py); a class that defines
  `loss(self, batch) -> (loss, metrics)` uses its own loss instead (the loss is
  a mean over the task's weight: tokens for 'lm', rows for 'classifier').

`config.model.name` picks it: a registered short name (trainer/models/registry.py)
or an import path 'my_pkg.my_module:MyModel'. Everything about the model is
checked here, before any compile.
"""

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh

from parallel import context as context_lib
from parallel import param_names, sharding
from trainer import pipeline
from trainer.base import precision
from trainer.base.errors import UserError
from trainer.models import adapters, call_convention, lora, quantization, registry, sown
from trainer.training import objectives

Batch = objectives.Batch
Metrics = objectives.Metrics


@dataclasses.dataclass(frozen=True)
class Task:
  objective: objectives.Objective
  model: adapters.AdaptedModel
  custom_loss: bool  # The model's class defines `loss(self, batch)`.
  # Under 'jit', a brought model's own sharding constraints (a bare PartitionSpec, nn.with_logical_constraint)
  # are read against this mesh and these rules while it is traced; None under the per-device strategies.
  mesh: Mesh | None = None
  rules: tuple = ()
  # The compute dtype of a brought model whose builder takes no `dtype`: its float parameters are cast to it inside
  # the loss (float32 master weights and gradients stay in train.param_dtype); None when nothing is cast.
  cast_params_to: Any = None
  param_notes: dict[str, str] = dataclasses.field(default_factory=dict)  # How unnamed parameters were named.
  # A Linen model naming mesh axes this mesh lacks (mapped by rules) gets the physical-mesh context (see
  # physical_mesh_context): its bare PartitionSpecs work, its nn.with_logical_constraint calls do nothing.
  physical_context: bool = False
  # A brought model's names for the packed keywords and its constant keywords (model.call_kwargs), in training;
  # eval_convention is eval's (model.eval_call_kwargs), which for_eval() makes the task's.
  convention: call_convention.CallConvention = call_convention.CallConvention()
  eval_convention: call_convention.CallConvention = call_convention.CallConvention()
  # mesh.context: > 1 puts every row's tokens in the balanced order (parallel/context.py) before the model.
  context_parts: int = 1
  # model.lora_rank > 0 (trainer/models/lora.py): the base weights enter the loss behind stop_gradient, so the
  # backward pass computes no gradient for them (the optimizer keeps no state for them either).
  frozen_base: bool = False

  def for_eval(self) -> 'Task':
    """This task calling the model the way eval does."""
    return dataclasses.replace(self, convention=self.eval_convention)

  def bind(self, params):
    """The model bound to `params`, in the compute dtype (to be called inside `context()`)."""
    if self.cast_params_to is not None:
      dtype = self.cast_params_to
      params = jax.tree.map(lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)
    return self.convention.wrap(self.model.bind(params))

  def context(self):
    """Where the model runs: the mesh and rules its own sharding constraints name, under 'jit'."""
    if self.physical_context:
      return physical_mesh_context(self.mesh)
    return mesh_context(self.mesh, self.rules)

  def loss(self, params, batch: Batch, frozen=None) -> tuple[jax.Array, Metrics]:
    """(loss to minimize, metrics), both means over `weight(batch)`; `frozen`: the reference parameters of an
    objective that compares with one (train.objective='dpo'), bound and called like the model."""
    batch = self.balanced(batch)
    if self.frozen_base:
      if frozen is None and isinstance(self.objective, objectives.PreferenceOptimization):
        frozen = lora.reference(params)  # The reference is the frozen base: the adapters at zero, no second copy.
      params = lora.freeze_base(params)
    with self.context():
      model = self.bind(params)
      if self.custom_loss:
        return model.loss(batch)
      if frozen is not None:
        loss, metrics = self.objective.loss(model, batch, reference=self.bind(frozen))
      else:
        loss, metrics = self.objective.loss(model, batch)
      return sown.add_to_loss(loss, metrics, getattr(model, 'sown', {}))  # MoE balancing and z-losses.

  def balanced(self, batch: Batch) -> Batch:
    """The one place rows are reordered for the context split; each token's own position goes with it (RoPE)."""
    if self.context_parts == 1:
      return batch
    if 'positions' not in batch:  # Unpacked rows: a token's position is its place in the original row.
      batch = dict(batch, positions=jnp.broadcast_to(jnp.arange(batch['inputs'].shape[1]), batch['inputs'].shape))
    return context_lib.balance(batch, self.context_parts)

  def outputs(self, params, batch: Batch) -> jax.Array:
    """The model's own output on `batch` (logits), called the way the objective calls it, in the batch's order."""
    args, kwargs = self.objective.model_inputs(self.balanced(batch))
    with self.context():
      logits = self.bind(params)(*args, **kwargs)
    if self.context_parts == 1:
      return logits
    return logits[:, np.argsort(context_lib.order(logits.shape[1], self.context_parts))]  # Back to row order.

  def weight(self, batch: Batch) -> jax.Array:
    return self.objective.weight(batch)

  def batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
    return self.objective.batch_shapes()


@contextlib.contextmanager
def mesh_context(mesh: Mesh | None, rules: Sequence):
  """While tracing: a model's bare PartitionSpecs and nn.with_logical_constraint read this mesh and these rules."""
  if mesh is None:
    yield
    return
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(tuple(rules)):
    yield


@contextlib.contextmanager
def physical_mesh_context(mesh: Mesh | None):
  """Bare PartitionSpecs read `mesh`, and Flax does not pin parameters to their names.

  Under jax.sharding.use_abstract_mesh, Flax 0.12 pins each nn.with_partitioning
  parameter to its names as mesh axes whenever it unboxes one (at init, and in
  every apply, where Linen re-runs the initializer abstractly to check shapes),
  which fails for a name only a rule maps ('model'). Under the older
  `with mesh:` context Flax sees no mesh and jax still resolves bare
  PartitionSpecs (test_brought_models.py). The launcher shards parameters itself.
  """
  if mesh is None:
    yield
    return
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', DeprecationWarning)  # `with mesh:`, which jax 0.10 still honours.
    with mesh:
      yield


def build_task(config, mesh: Mesh | None = None, rules: Sequence = ()) -> Task:
  """Resolves `model.name`, builds the model abstractly and names every parameter's axes (parallel/param_names.py).

  Under the 'jit' strategy `mesh` and `rules` also go to model builders that
  take them (activation sharding constraints); the per-device strategies run
  the model on local shards, with neither.
  """
  name = config.model.name
  rules = tuple(rules) or sharding.rules_from_config(config.parallel)
  made_for = registry.registered_task(name)
  if made_for is not None and made_for != config.model.task:
    raise UserError(f"model.name={name!r} is a {made_for!r} model but model.task={config.model.task!r}; "
                    f"set --config.model.task={made_for}.")
  # The built-in Llama quantizes its own layers (by name); any other model through its dots (brought_provider).
  quantize = config.train.get('quantization') if name != 'llama' else None
  quantization.check(quantize, mesh.devices.flat[0] if mesh is not None else jax.devices()[0])
  objective = objectives.for_config(config.model, config.data, config.train)
  builder = registry.resolve(name)
  under_jit = config.parallel.strategy == 'jit'
  keywords = {'mesh': mesh if under_jit else None, 'rules': tuple(rules),
              'pipeline': pipeline.from_config(config.train, mesh) if under_jit else None}  # Only to builders naming it.
  cast_to = None
  if made_for is None:  # Built-in models read train.* themselves; a brought one gets them as keywords it takes.
    keywords, cast_to = _brought_model_keywords(config, builder, keywords)
  # A Linen model is initialized by tracing its call on the global batch, under jit for every strategy.
  init_context = functools.partial(physical_mesh_context, mesh if made_for is None else None)
  convention = eval_convention = call_convention.CallConvention()
  if made_for is None:
    convention = call_convention.CallConvention.from_config(config.model)
    eval_convention = call_convention.CallConvention.from_config(config.model, evaluating=True)
  args, packed = objectives.example_inputs(objective)
  model = adapters.adapt(builder, config, (args, convention.keywords(packed)), keywords, init_context, quantize)
  if made_for is None and call_convention.takes_decoding_call(model.module_class):  # flax Gemma, tunix: by their call.
    convention, eval_convention = (dataclasses.replace(c, decoding=True) for c in (convention, eval_convention))
  mesh_shape = dict(mesh.shape) if mesh is not None else {'fsdp': 1}
  foreign = param_names.names_foreign_mesh_axes(model.abstract_boxed)
  unnamed = config.parallel.get('unnamed_params', 'auto')  # A run's config.json from before the key has none.
  boxed, notes = param_names.name_params(model.abstract_boxed, rules, mesh_shape, unnamed, name, model.framework)
  model = dataclasses.replace(model, abstract_boxed=boxed)
  custom_loss = callable(getattr(model.module_class, 'loss', None))
  if custom_loss and isinstance(objective, objectives.PreferenceOptimization):
    raise UserError(f"train.objective='dpo' computes the loss from the model's logits, but model.name={name!r} "
                    f"computes its own (a `loss` method): set --config.train.objective=task, or drop the method.")
  _require_chunkable_model(config, model, custom_loss)
  return Task(objective, model, custom_loss=custom_loss,
              mesh=mesh if under_jit and made_for is None else None, rules=tuple(rules), cast_params_to=cast_to,
              param_notes=notes, physical_context=foreign, convention=convention, eval_convention=eval_convention,
              context_parts=mesh.shape.get(context_lib.AXIS, 1) if under_jit and mesh is not None else 1,
              frozen_base=lora.enabled(config.model))


def _require_chunkable_model(config, model: adapters.AdaptedModel, custom_loss: bool) -> None:
  """train.loss_chunks > 1 needs the objective's loss and a model that can hand it hidden states and its head."""
  chunks = config.train.get('loss_chunks', 1)
  if chunks == 1:
    return
  if custom_loss:
    raise UserError(f'train.loss_chunks={chunks} slices the objective\'s loss, but model.name={config.model.name!r} '
                    f'computes its own (a `loss` method): set --config.train.loss_chunks=1 and chunk inside it.')
  if not adapters.takes_keyword(model.module_class.__call__, 'hidden_and_head'):
    raise UserError(f'train.loss_chunks={chunks} needs a model whose __call__ takes hidden_and_head=True and then '
                    f'returns (hidden states (B, L, D), output head (D, V)); {model.class_name} '
                    f'(model.name={config.model.name!r}) does not: set --config.train.loss_chunks=1 '
                    f'(docs/bring_your_own_model.md).')


def _brought_model_keywords(config, builder, keywords: dict) -> tuple[dict, Any]:
  """The keywords a brought model's builder takes for train.compute_dtype / param_dtype / remat_policy, and the
  dtype to cast its parameters to when it takes no `dtype`; logs how each setting reaches the model."""
  name, train = config.model.name, config.train
  dtype = jnp.dtype(precision.compute_dtype(train.compute_dtype))
  keywords = dict(keywords, dtype=dtype, param_dtype=jnp.dtype(train.param_dtype), remat_policy=train.remat_policy)
  cast_to = None
  if adapters.takes_keyword(builder, 'dtype'):
    logging.info('train.compute_dtype=%s: model.name=%r computes in %s (passed as its builder\'s dtype= keyword; '
                 'parameters stay %s).', train.compute_dtype, name, dtype.name, train.param_dtype)
  elif dtype != jnp.float32:
    cast_to = dtype
    logging.info('train.compute_dtype: model.name=%r takes no dtype= keyword, so its float parameters are cast to %s '
                 'inside the step (master weights and gradients stay %s).', name, dtype.name, train.param_dtype)
  if adapters.takes_keyword(builder, 'remat_policy') and train.remat_policy != 'none':
    logging.info('train.remat_policy=%r: applied by model.name=%r itself (passed as its builder\'s remat_policy= '
                 'keyword; the launcher does not rematerialize it again).', train.remat_policy, name)
  elif train.remat_policy != 'none':
    logging.warning('train.remat_policy=%r does not apply to model.name=%r: its builder takes no remat_policy= '
                    'keyword (docs/bring_your_own_model.md). It trains without rematerialization.',
                    train.remat_policy, name)
  return keywords, cast_to
