"""Logical axis names to NamedShardings, through the rules in `config.parallel.logical_axis_rules`.

Model code names the axes of its parameters ('embed', 'mlp', ...); the rules say
which mesh axis each name is split over. Changing parallelism is a config edit.
"""

import math
from collections.abc import Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallel import mesh as mesh_lib
from parallel import vocabularies

from trainer.base.errors import UserError

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def rules_from_config(parallel_config) -> tuple[tuple[str, object], ...]:
  """The rules in force, as hashable tuples (ConfigDict may hand back lists).

  `parallel.extra_axis_rules` first (Flax takes the first rule naming an axis,
  so they override without retyping the defaults), then
  `parallel.logical_axis_rules`, then those of the names public Flax code uses
  that neither names (parallel/vocabularies.py), then one identity rule per mesh
  axis no rule names: a parameter or activation named after a mesh axis ('data',
  'fsdp', 'tensor', as models written for their own mesh name them) is split over it.
  """
  rules = []
  for key in ('extra_axis_rules', 'logical_axis_rules'):
    for rule in parallel_config.get(key, ()):  # A run's config.json from before extra_axis_rules has none.
      axes = rule[1] if isinstance(rule, (tuple, list)) and len(rule) == 2 else ()
      axes = (axes,) if isinstance(axes, str) or axes is None else tuple(axes)
      if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
              and all(a is None or a in mesh_lib.AXES for a in axes)):
        raise UserError(f'parallel.{key}: {rule!r} is not a rule; each is (name, mesh axis), with a mesh axis of '
                        f"{mesh_lib.AXES}, a tuple of them, or None, e.g. ('model', 'tensor').")
      rules.append((rule[0], tuple(rule[1]) if isinstance(rule[1], list) else rule[1]))
  rules = tuple(rules)
  rules += vocabularies.rules({name for name, _ in rules})
  named = {name for name, _ in rules}
  return rules + tuple((axis, axis) for axis in mesh_lib.AXES if axis not in named)


def tree_shardings(abstract_boxed_tree, mesh: Mesh, rules: Rules):
  """NamedShardings for a tree whose leaves carry Flax logical-axis metadata.

  Leaves without metadata (step counters, rng keys) are replicated.
  """
  logical_specs = nn.get_partition_spec(abstract_boxed_tree)
  return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


def named_sharding(mesh: Mesh, rules: Rules, logical_axes: tuple[str | None, ...]) -> NamedSharding:
  """The NamedSharding of one array whose dimensions have the given logical names."""
  return NamedSharding(mesh, nn.logical_to_mesh_axes(logical_axes, rules))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def with_shardings(abstract_tree, shardings):
  """ShapeDtypeStructs that carry their target sharding (for restores and AOT lowering)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings)


def path_name(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


def _bytes_per_device(abstract, named: NamedSharding) -> int:
  return math.prod(named.shard_shape(abstract.shape)) * abstract.dtype.itemsize


def sharding_table(abstract_state, shardings, notes: dict[str, str] | None = None,
                   decays: dict[str, bool] | None = None) -> tuple[str, dict[str, int]]:
  """A table of every parameter (path, shape, PartitionSpec, bytes per device) and per-device totals.

  `notes` ({path: text}, from parallel/param_names.py) adds a column saying how
  the names of parameters the model did not fully name were chosen; `decays`
  ({path: bool}, from trainer/training/optimizer.py) a 'decay' column marking which get weight decay.
  Returns (text, totals) where totals has params / opt_state bytes per device and in total.
  """
  notes = notes or {}
  rows = [('parameter', 'shape', 'spec', 'bytes/device') + (('decay',) if decays else ())
          + (('names',) if notes else ())]
  for (path, leaf), named in zip(jax.tree_util.tree_flatten_with_path(abstract_state.params)[0],
                                 jax.tree.leaves(shardings.params)):
    where = path_name(path)
    rows.append((where, str(tuple(leaf.shape)), str(tuple(named.spec)), f'{_bytes_per_device(leaf, named):,}')
                + (('yes' if decays.get(where) else 'no',) if decays else ())
                + ((notes.get(where, 'from the model'),) if notes else ()))
  totals = {}
  parts = ('params', 'opt_state') + tuple(part for part in ('ema_params', 'reference_params')  # When kept.
                                          if getattr(abstract_state, part, None) is not None)
  for part in parts:
    leaves = jax.tree.leaves(getattr(abstract_state, part))
    named = jax.tree.leaves(getattr(shardings, part))
    totals[f'{part}_bytes_per_device'] = sum(_bytes_per_device(a, n) for a, n in zip(leaves, named))
    totals[f'{part}_bytes_total'] = sum(a.size * a.dtype.itemsize for a in leaves)
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = ['  '.join(c.rjust(w) if i == 3 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
           for r in rows]
  for part in parts:
    lines.append(f'{part} per device: {totals[f"{part}_bytes_per_device"]:,} bytes '
                 f'of {totals[f"{part}_bytes_total"]:,} in total')
  return '\n'.join(lines), totals


def summary(abstract_state, shardings, totals: dict[str, int]) -> str:
  """One line for the log: how many parameter arrays are split across devices, and the bytes per device."""
  leaves, named = jax.tree.leaves(abstract_state.params), jax.tree.leaves(shardings.params)
  split = sum(tuple(n.shard_shape(a.shape)) != tuple(a.shape) for a, n in zip(leaves, named))
  mib = lambda n: f'{n / 2**20:,.2f} MiB'
  return (f'{split} of {len(leaves)} parameter arrays split across devices, {len(leaves) - split} whole on each; per '
          f'device {mib(totals["params_bytes_per_device"])} of parameters (of {mib(totals["params_bytes_total"])}) and '
          f'{mib(totals["opt_state_bytes_per_device"])} of optimizer state (of {mib(totals["opt_state_bytes_total"])})'
          + (f' and {mib(totals["ema_params_bytes_per_device"])} of parameter average (train.ema_decay)'
             if 'ema_params_bytes_per_device' in totals else '')
          + (f' and {mib(totals["reference_params_bytes_per_device"])} of frozen reference (train.objective=dpo)'
             if 'reference_params_bytes_per_device' in totals else ''))


def check_divisible(abstract_boxed_params, mesh: Mesh, rules: Rules) -> None:
  """Every parameter dimension the rules split over mesh axes divides by their size; else one UserError."""
  is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)
  for path, box in jax.tree_util.tree_flatten_with_path(abstract_boxed_params, is_leaf=is_box)[0]:
    if not is_box(box):
      continue
    spec = nn.logical_to_mesh_axes(tuple(box.names), rules)
    for dim, (name, entry) in enumerate(zip(box.names, spec)):
      axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
      devices = math.prod(mesh.shape[a] for a in axes)
      if box.value.shape[dim] % devices:
        split = ' x '.join(f'mesh.{a}={mesh.shape[a]}' for a in axes)
        raise UserError(f'parameter {path_name(path)} {tuple(box.value.shape)}: its {name!r} dimension of '
                        f'{box.value.shape[dim]} does not divide over {split}; pick mesh sizes that divide '
                        f'{box.value.shape[dim]}, change the model size behind {name!r}, or map {name!r} to other '
                        f'axes in parallel.logical_axis_rules.')
