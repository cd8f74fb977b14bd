"""The local tier's peer copy: every device's block of the train state sent to the device at the same place in the
previous process (on a save), or back to the next (on a restore), by one compiled collective-permute over the
training mesh in its own device order. trainer/training/local_tier.py writes and reads what it carries.

Blocks are keyed `<leaf>|<start:stop per dimension>`, as each process keys its own shards.
"""

import functools

import jax
import numpy as np


def key(leaf: int, index: tuple, shape: tuple[int, ...]) -> str:
  return f'{leaf}|' + ','.join(f'{s.start or 0}:{dim if s.stop is None else s.stop}' for s, dim in zip(index, shape))


def named(state, process_count: int) -> bool:
  """Whether the peer copy can be made: one process needs none; across processes every leaf on a named mesh."""
  return process_count == 1 or all(isinstance(leaf.sharding, jax.sharding.NamedSharding)
                                   for leaf in jax.tree.leaves(state))


def passer(state, towards_previous: bool):
  """A compiled program sending every device's block of every leaf of `state` (on its own shardings, or one row per
  device) to the device at the same place in the previous process (or the next), as one row per device.

  One collective-permute over the whole mesh, in the step's own device order: gloo pairs collectives by order, and a
  reshard onto a reordered mesh (device_put) set up new groups at each save, slowly, and once hung both hosts.
  """
  leaves = jax.tree.leaves(state)
  mesh = leaves[0].sharding.mesh
  axes = tuple(mesh.axis_names)
  position = {device: j for j, device in enumerate(mesh.devices.flat)}
  previous = dict(zip(mesh.devices.flat, shifted_mesh(mesh).devices.flat))
  pairs = [(position[d], position[previous[d]]) for d in mesh.devices.flat]
  pairs = pairs if towards_previous else [(b, a) for a, b in pairs]
  if towards_previous:
    in_specs, body = jax.tree.map(lambda leaf: leaf.sharding.spec, state), lambda x: x[None]
  else:
    in_specs, body = jax.sharding.PartitionSpec(axes), lambda x: x
  return jax.jit(jax.shard_map(lambda tree: jax.tree.map(lambda x: body(jax.lax.ppermute(x, axes, pairs)), tree),
                               mesh=mesh, in_specs=(in_specs,), out_specs=jax.sharding.PartitionSpec(axes),
                               check_vma=False))


def peer_shards(layouts, rows) -> dict[str, np.ndarray]:
  """The distinct shards of the next process held here as `rows` (a row per device: the block of the device at
  its place in the next process), keyed as that process keys its own."""
  out = {}
  for i, ((shape, sharding), leaf_rows) in enumerate(zip(layouts, rows)):
    index_of = sharding.devices_indices_map(shape)
    following = dict(zip(shifted_mesh(sharding.mesh).devices.flat, sharding.mesh.devices.flat))
    for shard in leaf_rows.addressable_shards:
      name = key(i, index_of[following[shard.device]], shape)
      if name not in out:
        out[name] = np.asarray(shard.data)[0]
  return out


def sent_back(abstract_with_shardings, copy: dict[str, np.ndarray]):
  """The state whose shards on each process are those the previous process holds in `copy` (zeros where it holds
  none): every leaf as one row per device, the row of each device built on the device before it, then moved.

  Rows, not the leaves themselves: a leaf replicated across processes is taken to be the same on every device by
  a reshard and is not sent at all (a replaced host kept its zeros).
  """
  leaves, tree = jax.tree.flatten(abstract_with_shardings)
  mesh = leaves[0].sharding.mesh
  flat = list(mesh.devices.flat)
  following = dict(zip(shifted_mesh(mesh).devices.flat, flat))
  rows_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(tuple(mesh.axis_names)))
  rows = []
  for i, leaf in enumerate(leaves):
    shard_shape = leaf.sharding.shard_shape(leaf.shape)
    index_of = leaf.sharding.devices_indices_map(leaf.shape)

    def row(index, i=i, leaf=leaf, shard_shape=shard_shape, index_of=index_of):
      target = following[flat[index[0].start or 0]]  # Row j goes to the device after device j.
      found = copy.get(key(i, index_of[target], leaf.shape))
      return (found.view(leaf.dtype) if found is not None else np.zeros(shard_shape, leaf.dtype))[None]
    rows.append(jax.make_array_from_callback((len(flat), *shard_shape), rows_sharding, row))
  moved = passer(rows, towards_previous=False)(rows)
  return jax.tree.unflatten(tree, [jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, [
      jax.device_put(np.asarray(shard.data)[0], shard.device) for shard in rows_leaf.addressable_shards])
                                   for leaf, rows_leaf in zip(leaves, jax.tree.leaves(moved))])


def shifted(sharding):
  """`sharding` with every device replaced by the device at the same place in the previous process: an array put
  on it has process i's devices holding what process i+1's hold on `sharding`."""
  return jax.sharding.NamedSharding(shifted_mesh(sharding.mesh), sharding.spec)


@functools.cache
def shifted_mesh(mesh):
  by_process: dict[int, list] = {}
  for device in sorted(mesh.devices.flat, key=lambda d: d.id):
    by_process.setdefault(device.process_index, []).append(device)
  processes = sorted(by_process)
  place = {d: (processes.index(p), k) for p, ds in by_process.items() for k, d in enumerate(ds)}

  def previous(device):
    order, k = place[device]
    return by_process[processes[(order - 1) % len(processes)]][k]
  return jax.sharding.Mesh(np.vectorize(previous, otypes=[object])(mesh.devices), mesh.axis_names)
