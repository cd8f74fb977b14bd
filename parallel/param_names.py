"""One axis name (or None) per dimension of every parameter, however the model named them, or whether it did.

Flax models name their parameters' dimensions in several ways; each is taken as
its author meant it:

- logical names (`nn.with_logical_partitioning`, or `nnx.with_partitioning`
  with names the rules know), which `parallel.extra_axis_rules` and then
  `parallel.logical_axis_rules` map to mesh axes;
- mesh-axis names (`nn.with_partitioning` / `nnx.with_partitioning` naming
  'data', 'fsdp' or 'tensor', as models written for their own mesh do): a name
  that is an axis of this launcher's mesh and that no rule maps stands for that
  axis (sharding.rules_from_config ends the rules with one identity rule per
  mesh axis). A model written for a mesh with other axis names ('model', 'mp')
  maps them with one `parallel.extra_axis_rules` entry each;
- fewer names than dimensions, Flax's own convention (a PartitionSpec shorter
  than the array, as a `DenseGeneral` kernel gets): the trailing dimensions
  are whole on every device;
- more names than dimensions, the extra leading ones None (a bias given its
  kernel's spec): the trailing names are the parameter's own; other excess
  names are refused;
- no names: `parallel.unnamed_params` decides. 'auto' (default) replicates
  parameters of rank 1 or of fewer than AUTO_MIN_ELEMENTS elements (norm
  scales, biases: the gather would cost more than the memory saved) and splits
  the largest dimension of bigger ones over 'fsdp' (the first, largest, that
  divides by its size; whole when none does), so FSDP shards them too;
  'replicate' keeps every unnamed parameter whole; 'error' refuses them.

Every leaf comes out as an `nn.LogicallyPartitioned` box with one name per
dimension, so the shardings, the optimizer state and the checkpoints treat
every model alike; `notes` says how the names of each parameter the model did
not fully name were chosen, for the sharding table.
"""

import math

import flax.linen as nn
import jax

from parallel import mesh as mesh_lib
from parallel import sharding
from trainer.base.errors import UserError

UNNAMED = ('auto', 'replicate', 'error')
AUTO_MIN_ELEMENTS = 2**18  # 1 MiB of float32: smaller unnamed parameters are replicated under 'auto'.


def _is_box(x) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def _auto_names(shape: tuple[int, ...], fsdp: int) -> tuple[tuple[str | None, ...], str]:
  if len(shape) < 2 or math.prod(shape) < AUTO_MIN_ELEMENTS:
    return (None,) * len(shape), 'unnamed: replicated (small)'
  for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
    if shape[dim] % fsdp == 0:
      return tuple('fsdp' if d == dim else None for d in range(len(shape))), f'unnamed: dim {dim} over fsdp'
  return (None,) * len(shape), f'unnamed: replicated (no dimension divides by mesh.fsdp={fsdp})'


def names_foreign_mesh_axes(abstract_boxed) -> bool:
  """Whether some parameter is boxed as naming mesh axes (nn.with_partitioning) that this mesh does not have."""
  return any(isinstance(leaf, nn.Partitioned) and not isinstance(leaf, nn.LogicallyPartitioned)
             and any(n is not None and n not in mesh_lib.AXES for n in leaf.names)
             for leaf in jax.tree.leaves(abstract_boxed, is_leaf=_is_box))


def name_params(abstract_boxed, rules, mesh_shape: dict[str, int], unnamed: str, model_name: str,
                framework: str) -> tuple[object, dict[str, str]]:
  """(the tree with every leaf in an nn.LogicallyPartitioned box, {path: note}); one UserError when names are wrong."""
  if unnamed not in UNNAMED:
    raise UserError(f'parallel.unnamed_params={unnamed!r}: choose one of {UNNAMED}.')
  known = {rule[0] for rule in rules} | set(mesh_lib.AXES)
  notes, bare = {}, []

  def name(path, leaf):
    where = sharding.path_name(path)
    if not _is_box(leaf):
      shape = tuple(leaf.shape)
      if unnamed == 'error':
        bare.append(f'{where} {shape}')
        return leaf
      names, notes[where] = (((None,) * len(shape), 'unnamed: replicated') if unnamed == 'replicate'
                             else _auto_names(shape, mesh_shape['fsdp']))
      return nn.LogicallyPartitioned(leaf, names)
    names, shape = tuple(leaf.names), tuple(leaf.value.shape)
    extra = len(names) - len(shape)
    if extra > 0 and shape and all(n is None for n in names[:extra]):
      # A bias given its kernel's spec (the JAX AI Stack's LLM tutorial: P(None, 'model') on a (features,) bias):
      # its dimensions are the kernel's last ones, so the spec's trailing names are its own.
      notes[where] = f'{len(names)} names for {len(shape)} dims: the last {len(shape)} taken'
      names = names[extra:]
    if len(names) > len(shape):
      raise UserError(f'model.name={model_name!r}: parameter {where} has shape {shape} but {len(names)} axis names '
                      f'{names}; give at most one name (or None) per dimension.')
    missing = [n for n in names if n is not None and n not in known]
    if missing:
      raise UserError(f'model.name={model_name!r}: parameter {where} names axis {missing[0]!r}, which is neither a mesh '
                      f'axis ({", ".join(mesh_lib.AXES)}) nor in parallel.logical_axis_rules; map it with '
                      f"--config.parallel.extra_axis_rules=\"(('{missing[0]}', 'tensor'),)\" (or None to replicate).")
    if len(names) < len(shape):
      notes[where] = f'{len(names)} names for {len(shape)} dims: the rest whole'
      names += (None,) * (len(shape) - len(names))
    return nn.LogicallyPartitioned(leaf.value, names)

  named = jax.tree_util.tree_map_with_path(name, abstract_boxed, is_leaf=_is_box)
  if bare:
    how = ('nnx.with_partitioning(init, names)' if framework == 'nnx'
           else 'nn.with_logical_partitioning(init, names)')
    raise UserError(f'model.name={model_name!r}: {len(bare)} parameter(s) have no axis names: '
                    f'{", ".join(bare[:6])}{" ..." if len(bare) > 6 else ""}, and parallel.unnamed_params=\'error\'. '
                    f"Name them with {how} on the initializer, or set parallel.unnamed_params='auto' or 'replicate'.")
  return named, notes


def unsplit_note(named_boxed, param_shardings, mesh_shape: dict[str, int], notes: dict[str, str],
                 model_name: str) -> str | None:
  """One line when mesh.fsdp or mesh.tensor is > 1 and no parameter the model named is split over either.

  A model whose names map only to other axes (nanodo names its axis 'data') trains with every parameter whole on
  every device, silently: the line says so, with the rule that maps its most used name to the axis. None when some
  parameter is split over fsdp or tensor, or the model named none (`parallel.unnamed_params` decided those).
  """
  axes = [a for a in ('fsdp', 'tensor') if mesh_shape.get(a, 1) > 1]
  if not axes:
    return None
  boxes = jax.tree_util.tree_flatten_with_path(named_boxed, is_leaf=_is_box)[0]
  weight, count = {}, 0
  for (path, box), named in zip(boxes, jax.tree.leaves(param_shardings)):
    entries = [e for e in named.spec if e is not None]
    if any(a in ((e,) if isinstance(e, str) else tuple(e)) for e in entries for a in axes):
      return None
    if notes.get(sharding.path_name(path), '').startswith('unnamed'):
      continue
    count += 1
    for n in box.names:
      if n is not None:
        weight[n] = weight.get(n, 0) + math.prod(box.value.shape)
  if not count:
    return None
  mesh = ' x '.join(f'mesh.{a}={mesh_shape[a]}' for a in axes)
  if not weight:
    how = 'name their dimensions (nnx.with_partitioning / nn.with_logical_partitioning, e.g. \'embed\', \'mlp\')'
  else:
    name = max(weight, key=weight.get)
    how = f"map its most used name to {axes[0]}: --config.parallel.extra_axis_rules=\"(('{name}', '{axes[0]}'),)\""
  shown = ', '.join(repr(n) for n in sorted(weight)) or 'None only'
  return (f'{mesh} splits none of the {count} parameters model.name={model_name!r} names (its names: {shown} map to '
          f'neither), so those axes hold every one of them whole; to split them, {how}.')
