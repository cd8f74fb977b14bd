"""How the pure train and eval steps run over the mesh: 'jit', 'shard_map' or 'pmap'.

Every strategy runs the same `trainer.training.step` functions (the same loss, the same
optimizer update) on the same TrainState, laid out on the devices the same way,
so checkpoints move between strategies; and each gives the loop what it expects:
a train step with `lower(state, batch).compile()` whose compiled form maps
`(state, global batch)` to `(state, replicated metrics)`, and an eval step
`(params, global batch) -> replicated metrics`.

- 'jit': NamedShardings for the state and batch go to the compiler, and GSPMD
  partitions the whole step, choosing the communication itself.
- 'shard_map': the forward and backward pass are written per device with every
  collective spelled out (parameter all_gather over the axes that shard it,
  gradient psum_scatter back to that layout and psum over the other axes); the
  optimizer update stays outside, under jit, where optax's global-norm clipping
  sees the true global gradient.
- 'pmap': classic data parallelism: parameters replicated, each device's
  gradients pmean'd, every device applying the same update. (In jax 0.10,
  jax.pmap is itself a jit of a shard_map over a one-axis mesh: the step body
  is still never partitioned by GSPMD.)

Every train step donates the state, so its buffers are reused for the new state.
"""

import functools
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallel import sharding
from trainer.training import step as step_lib

STRATEGIES = ('jit', 'shard_map', 'pmap')
PMAP_AXIS = 'devices'  # pmap's one axis: every device of the mesh, in mesh order.


def partition_train_step(strategy: str, mesh: Mesh, state_shardings: Any, batch_shardings: Any, *,
                         task: step_lib.LossTask, tx: optax.GradientTransformation,
                         schedule: optax.Schedule, options: step_lib.StepOptions = step_lib.StepOptions()) -> Any:
  """The train step for `strategy`, to be lowered and compiled ahead of time with the state's shardings.

  `batch_shardings` is a dict like the batch: each key's NamedSharding (rows split over the batch axes).
  """
  if strategy == 'jit':
    step = functools.partial(step_lib.train_step, task=task, tx=tx, schedule=schedule, options=options)
    return jax.jit(step, in_shardings=(state_shardings, batch_shardings),
                   out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0)
  if strategy == 'shard_map':
    return _shard_map_train_step(mesh, state_shardings, batch_shardings, task, tx, schedule, options)
  if strategy == 'pmap':
    return _pmap_train_step(mesh, task, tx, schedule, options)
  raise ValueError(f'unknown strategy {strategy!r}')  # validation rejects these earlier


def partition_eval_step(strategy: str, mesh: Mesh, params_shardings: Any, batch_shardings: Any, *,
                        task: step_lib.LossTask, frozen_shardings: Any = None) -> Any:
  """`(params, global batch) -> metrics`, partitioned the way the train step is; `(params, batch, frozen)` with
  `frozen_shardings` (the reference parameters of train.objective='dpo', which runs under 'jit' only).

  Not jit for every strategy: who chose 'shard_map' or 'pmap' to keep GSPMD out
  gets none in eval either, and eval_loss then checks the same per-device path.
  """
  step = functools.partial(step_lib.eval_step, task=task)
  if strategy == 'jit':
    frozen = () if frozen_shardings is None else (frozen_shardings,)
    return jax.jit(step, in_shardings=(params_shardings, batch_shardings, *frozen),
                   out_shardings=sharding.replicated(mesh))
  if strategy == 'shard_map':
    param_specs = _specs(params_shardings)

    def local_eval(param_shards, local_batch):
      return _pmean_varying(step(_gather_params(param_shards, param_specs, mesh), local_batch), mesh)

    per_device = jax.shard_map(local_eval, mesh=mesh, in_specs=(param_specs, _specs(batch_shardings)),
                               out_specs=PartitionSpec())
    return jax.jit(per_device, in_shardings=(params_shardings, batch_shardings),
                   out_shardings=sharding.replicated(mesh))
  if strategy == 'pmap':
    pmapped = jax.pmap(lambda params, local_batch: jax.lax.pmean(step(params, local_batch), PMAP_AXIS),
                       axis_name=PMAP_AXIS, in_axes=(None, 0), out_axes=None, devices=list(mesh.devices.flat))
    return _PmapWithGlobalBatch(pmapped, mesh)
  raise ValueError(f'unknown strategy {strategy!r}')


# ---- shard_map ----------------------------------------------------------------------------------


def _specs(shardings_tree) -> Any:
  return jax.tree.map(lambda s: s.spec, shardings_tree)


def _named_axes(spec: PartitionSpec) -> set[str]:
  """Every mesh axis the spec splits some dimension over."""
  return {a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)}


def _split_dims(spec: PartitionSpec, mesh: Mesh) -> list[tuple[int, tuple[str, ...]]]:
  """(dimension, mesh axes) for each dimension the spec really splits.

  Axes of size 1 are left out: a collective over them moves nothing, and XLA:CPU
  still emits it.
  """
  dims = []
  for dim, entry in enumerate(spec):
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    axes = tuple(a for a in axes if mesh.shape[a] > 1)
    if axes:
      dims.append((dim, axes))
  return dims


def _gather_params(param_shards, param_specs, mesh: Mesh):
  """Each device's shards all_gathered into whole parameters (FSDP's gather before use)."""

  def gather(shard, spec):
    for dim, axes in _split_dims(spec, mesh):
      shard = jax.lax.all_gather(shard, axes, axis=dim, tiled=True)
    return shard

  return jax.tree.map(gather, param_shards, param_specs)


def _pmean_varying(tree, mesh: Mesh):
  """Each value's mean over the mesh axes it differs on (jax refuses a pmean over an axis it does not vary on).

  Eval's parameters are not marked varying (no gradient to keep unreduced), so a
  metric varies only on the axes the batch is split over: not on 'tensor', for one.
  """

  def mean(x):
    axes = tuple(a for a in mesh.axis_names if a in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pmean(x, axes) if axes else x

  return jax.tree.map(mean, tree)


def _mark_varying(params, param_specs, mesh: Mesh):
  """Types whole parameters as differing per device on every mesh axis.

  shard_map's autodiff psums the gradient of a value that is the same on every
  device (replicated, or gathered) over the axes where the loss differs. This
  step does that reduction itself, below, so the gradient must come back per
  device, unreduced; the values do not change.
  """

  def mark(param, spec):
    return jax.lax.pcast(param, tuple(a for a in mesh.axis_names if a not in _named_axes(spec)), to='varying')

  return jax.tree.map(mark, params, param_specs)


def _reduce_grads(grads, param_specs, mesh: Mesh):
  """Per-device gradients -> the mean over devices, each device keeping its parameter shard.

  A dimension split over some mesh axes is psum_scattered over them, back to the
  parameter's layout; every mesh axis the parameter is not split over is psum'd
  (XLA drops those of size 1). Dividing by the device count gives the mean over
  batch shards: devices that differ only along 'tensor' saw the same rows and
  hold equal copies (tensor is 1 here anyway).
  """

  def reduce(grad, spec):
    for dim, axes in _split_dims(spec, mesh):
      grad = jax.lax.psum_scatter(grad, axes, scatter_dimension=dim, tiled=True)
    rest = tuple(a for a in mesh.axis_names if a not in _named_axes(spec))
    if rest:
      grad = jax.lax.psum(grad, rest)
    return grad / mesh.size

  return jax.tree.map(reduce, grads, param_specs)


def _shard_map_train_step(mesh: Mesh, state_shardings, batch_shardings, task, tx, schedule, options):
  param_specs = _specs(state_shardings.params)

  def local_grads(param_shards, local_batch):
    params = _mark_varying(_gather_params(param_shards, param_specs, mesh), param_specs, mesh)
    grads, metrics = step_lib.grads_and_metrics(params, local_batch, task, options)
    # Local batch shards are equal in size, so the mean of the per-device means is the global mean.
    return _reduce_grads(grads, param_specs, mesh), jax.lax.pmean(metrics, mesh.axis_names)

  grads_fn = jax.shard_map(local_grads, mesh=mesh, in_specs=(param_specs, _specs(batch_shardings)),
                           out_specs=(param_specs, PartitionSpec()))

  def train_step(state, batch):
    grads, metrics = grads_fn(state.params, batch)
    return step_lib.apply_gradients(state, grads, metrics, tx=tx, schedule=schedule)

  return jax.jit(train_step, in_shardings=(state_shardings, batch_shardings),
                 out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0)


# ---- pmap ---------------------------------------------------------------------------------------


def _pmap_train_step(mesh: Mesh, task, tx, schedule, options) -> '_PmapWithGlobalBatch':

  def train_step(state, local_batch):
    grads, metrics = step_lib.grads_and_metrics(state.params, local_batch, task, options)
    grads, metrics = jax.lax.pmean((grads, metrics), PMAP_AXIS)
    return step_lib.apply_gradients(state, grads, metrics, tx=tx, schedule=schedule)

  # in_axes/out_axes None: the state goes in and comes out whole on every device, in the
  # same TrainState as the other strategies (no stacked copy), so checkpoints interchange.
  pmapped = jax.pmap(train_step, axis_name=PMAP_AXIS, in_axes=(None, 0), out_axes=None,
                     devices=list(mesh.devices.flat), donate_argnums=0)
  return _PmapWithGlobalBatch(pmapped, mesh)


def _per_device_shape(shape: tuple[int, ...], mesh: Mesh) -> tuple[int, ...]:
  return (mesh.size, shape[0] // mesh.size) + tuple(shape[1:])


def _split_batch(batch, mesh: Mesh):
  """The global (B, ...) batch as (devices, B/devices, ...): each device's own rows become its slice.

  No data moves: with fsdp == tensor == 1 (validation) the batch's shard on the
  k-th device of the mesh is exactly pmap's k-th slice, so each shard is only
  given a leading axis of 1.
  """
  target = NamedSharding(Mesh(np.asarray(mesh.devices).reshape(-1), (PMAP_AXIS,)), PartitionSpec(PMAP_AXIS))
  return jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
      _per_device_shape(x.shape, mesh), target, [s.data[None] for s in x.addressable_shards]), batch)


class _PmapWithGlobalBatch:
  """A pmapped `(state or params, per-device batch)` function called like the jitted steps.

  The loop hands every strategy the global batch; this regroups it for pmap at
  each stage (`lower`, `compile`, call), so the loop stays one loop.
  """

  def __init__(self, fn, mesh: Mesh):
    self._fn, self._mesh = fn, mesh

  def lower(self, tree, batch) -> '_PmapWithGlobalBatch':
    # Abstract values with global shapes and no shardings (pmap brings its own): given anything
    # else, pmap.lower in a multi-process run tries to assemble it from per-process data.
    abstract_tree = jax.tree.map(lambda x: jax.core.ShapedArray(x.shape, x.dtype), tree)
    abstract_batch = jax.tree.map(
        lambda x: jax.core.ShapedArray(_per_device_shape(x.shape, self._mesh), x.dtype), batch)
    return _PmapWithGlobalBatch(self._fn.lower(abstract_tree, abstract_batch), self._mesh)

  def trace(self, tree, batch):
    """The step traced on abstract values (nothing lowered or compiled): raises what the model raises."""
    return jax.eval_shape(self._fn, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree),
                          jax.tree.map(lambda x: jax.ShapeDtypeStruct(_per_device_shape(x.shape, self._mesh),
                                                                      x.dtype), batch))

  def compile(self) -> '_PmapWithGlobalBatch':
    return _PmapWithGlobalBatch(self._fn.compile(), self._mesh)

  def __call__(self, tree, batch):
    return self._fn(tree, _split_batch(batch, self._mesh))

  def memory_analysis(self):
    """The compiled step's per-device memory analysis, as for the jitted strategies."""
    return self._fn.memory_analysis()

  def as_text(self) -> str:
    """The compiled step's per-device optimized HLO, as for the jitted strategies (the pre-flight's dense-experts
    guard counts an MoE step's dots in it)."""
    return self._fn.as_text()

