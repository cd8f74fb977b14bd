"""Logical axis names to NamedShardings, through the rules in `config.parallel.logical_axis_rules`.

Model code names the axes of its parameters ('embed', 'mlp', ...); the rules say
which mesh axis each name is split over. Changing parallelism is a config edit.
"""

from collections.abc import Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def rules_from_config(parallel_config) -> tuple[tuple[str, object], ...]:
  """The config's rules as hashable tuples (ConfigDict may hand back lists)."""
  return tuple((name, tuple(axis) if isinstance(axis, list) else axis)
               for name, axis in parallel_config.logical_axis_rules)


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
