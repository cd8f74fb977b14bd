"""The device mesh, built once from `config.mesh` and passed explicitly everywhere.

Axes, outermost first: `data` (pure data parallel), `fsdp` (data parallel with
parameters sharded), `pipeline` (the scanned layers split into stages that pass
activations on, trainer/pipeline/), `expert` (MoE experts split; the batch is split over it
too, so the non-expert layers use it as data parallelism instead of leaving
those devices to repeat the same work), `context` (the sequence split: each
device holds a part of every row's tokens, docs/context.md), `tensor` (heads /
mlp / vocab split). A size of -1 fills the axis with whatever devices the others
leave.

Two levels, as in MaxText: `mesh.data/fsdp/tensor` lay out the devices of one
slice (chips on fast ICI links); `mesh.dcn_data/dcn_fsdp/dcn_pipeline` repeat that
layout across slices (or groups of hosts) joined by the data-centre network. The
final axis sizes are products: data = dcn_data * data, fsdp = dcn_fsdp * fsdp,
pipeline = dcn_pipeline * pipeline.
"""

import itertools
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from trainer.base.errors import UserError

AXES = ('data', 'fsdp', 'pipeline', 'expert', 'context', 'tensor')
# Mesh axes the global batch is split over: every device on them sees different examples.
BATCH_AXES = ('data', 'fsdp', 'expert')


def _fitting_shapes(mesh_config, num_devices: int, limit: int = 4) -> list[str]:
  """A few shapes whose product is num_devices, data-parallel first; axes the config leaves at 1 stay 1."""
  free = [a for a in AXES if a in ('data', 'fsdp', 'tensor') or mesh_config.get(a, 1) != 1]
  shapes = [s for s in itertools.product(range(1, num_devices + 1), repeat=len(free)) if math.prod(s) == num_devices]
  shapes.sort(key=lambda s: (-s[0], -s[1]))
  return [','.join(f'{a}={n}' for a, n in zip(free, s)) for s in shapes[:limit]]


def resolve_shape(mesh_config, num_devices: int) -> tuple[int, ...]:
  """Turns config.mesh's per-slice sizes (at most one -1) into concrete sizes for num_devices per slice."""
  sizes = []
  for axis in AXES:
    size = mesh_config.get(axis, 1)  # A run's config.json from before an axis existed has none.
    if not isinstance(size, int) or size == 0 or size < -1:
      raise UserError(f'mesh.{axis}={size!r} is not a device count: use a positive integer, or -1 to fill.')
    sizes.append(size)
  fills = [a for a, s in zip(AXES, sizes) if s == -1]
  if len(fills) > 1:
    raise UserError(
        f'mesh.{fills[0]} and mesh.{fills[1]} are both -1; at most one mesh axis can fill the '
        f'remaining devices. Set all but one to explicit sizes.')
  fixed = math.prod(s for s in sizes if s != -1)
  if fills:
    if num_devices % fixed:
      raise UserError(
          f'mesh {dict(zip(AXES, sizes))} cannot fill {num_devices} devices: the fixed axes use '
          f'{fixed}, which does not divide {num_devices}. Shapes that fit: '
          f'{"; ".join(_fitting_shapes(mesh_config, num_devices))}.')
    sizes = [num_devices // fixed if s == -1 else s for s in sizes]
  elif fixed != num_devices:
    # A CPU run can have the devices it asks for: XLA fakes them (how docs/meshes.md runs a 2 x 2 x 2 mesh).
    fake = (f' On CPU, prefix the command with XLA_FLAGS=--xla_force_host_platform_device_count={fixed} to run '
            f'{fixed} devices.' if fixed > num_devices and jax.default_backend() == 'cpu' else '')
    raise UserError(
        f'mesh {dict(zip(AXES, sizes))} needs {fixed} devices but {num_devices} are available. '
        f'Shapes that fit: {"; ".join(_fitting_shapes(mesh_config, num_devices))} (or set one axis to -1).{fake}')
  return tuple(sizes)


def dcn_shape(mesh_config, num_devices: int) -> tuple[int, ...]:
  """How many slices each axis of AXES spans (dcn_data, dcn_fsdp, dcn_pipeline, then 1s); checked against the
  device count."""
  # A run's config.json from before the pipeline axis has no dcn_pipeline.
  shape = (mesh_config.dcn_data, mesh_config.dcn_fsdp, mesh_config.get('dcn_pipeline', 1)) + (1,) * (len(AXES) - 3)
  for axis, size in zip(('dcn_data', 'dcn_fsdp', 'dcn_pipeline'), shape):
    if not isinstance(size, int) or size < 1:
      raise UserError(f'mesh.{axis}={size!r} must be a positive integer (1 = no split across slices).')
  slices = math.prod(shape)
  if num_devices % slices:
    raise UserError(f'mesh.dcn_data={shape[0]} x mesh.dcn_fsdp={shape[1]} x mesh.dcn_pipeline={shape[2]} = {slices} '
                    f'slices does not divide '
                    f'the {num_devices} devices; choose DCN sizes whose product divides {num_devices}.')
  return shape


def _host_major(devices: list[jax.Device], ici: tuple[int, ...], dcn: tuple[int, ...]) -> np.ndarray:
  """Device grid for the DCN split when devices carry no slice_index: consecutive hosts form a slice."""
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  n = len(AXES)
  grid = np.array(devices, dtype=object).reshape(*dcn, *ici)  # (dcn_d, dcn_f, dcn_p, 1, 1, 1, d, f, p, e, c, t)
  grid = grid.transpose([i for axis in range(n) for i in (axis, n + axis)])  # Each DCN axis just outside its ICI axis.
  return grid.reshape([a * b for a, b in zip(dcn, ici)])


def build_mesh(mesh_config, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the (data, fsdp, pipeline, expert, context, tensor) mesh over `devices` (default: all devices of all processes)."""
  devices = list(jax.devices() if devices is None else devices)
  dcn = dcn_shape(mesh_config, len(devices))
  ici = resolve_shape(mesh_config, len(devices) // math.prod(dcn))
  # Auto axis types on purpose: jax 0.10's default (Explicit) puts shardings into
  # the types and asks every op to agree, while this launcher states shardings
  # once at the jit boundary (params, optimizer state, batch) and lets GSPMD
  # propagate them through the model, the way logical-axis rules are meant to work.
  axis_types = (AxisType.Auto,) * len(AXES)
  if math.prod(dcn) == 1:
    return jax.make_mesh(ici, AXES, axis_types=axis_types, devices=devices)
  if getattr(devices[0], 'slice_index', None) is not None:  # TPU multislice: let JAX order by slice.
    grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
  else:
    grid = _host_major(devices, ici, dcn)
  return Mesh(grid, AXES, axis_types=axis_types)


def data_parallel_size(mesh: Mesh) -> int:
  """Number of distinct batch shards: the product of the batch axes' sizes."""
  return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batch_size(batch_size: int, mesh: Mesh, process_count: int) -> None:
  """Fails with the nearest valid sizes unless the global batch splits evenly over devices and hosts."""
  dp = data_parallel_size(mesh)
  unit = math.lcm(dp, process_count)
  if batch_size <= 0 or batch_size % unit:
    lower, upper = (batch_size // unit) * unit, (batch_size // unit + 1) * unit
    nearest = ' or '.join(str(b) for b in (lower, upper) if b > 0)
    hosts = f' and {process_count} processes' if process_count > 1 else ''
    raise UserError(
        f'train.batch_size={batch_size} does not divide over the {dp} data-parallel devices '
        f'(mesh data={mesh.shape["data"]} x fsdp={mesh.shape["fsdp"]} x expert={mesh.shape["expert"]}){hosts}. '
        f'Nearest valid batch sizes: {nearest}.')
