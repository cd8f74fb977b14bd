"""Elastic continuation: a run written for FULL processes goes on with the processes it has, at the same global batch.

The config describes the run at its full size; `--elastic_full_processes=FULL` (which the launcher passes, e.g.
scripts/launch_local.py --elastic_min_processes) says what that size is. When fewer processes join (a host lost and
not back within --distributed_timeout_s, docs/supervisor.md), or all of them again later, `plan` recomputes the job
for the devices held:

- the mesh: the batch axes take the change of size, a whole slice first (`mesh.dcn_data`, then `mesh.dcn_fsdp`),
  else the data or fsdp axis of a slice; the model axes (pipeline, expert, context, tensor) keep their sizes, so each
  device holds the same share of every parameter;
- gradient accumulation: raised (or lowered) so each device's microbatch stays the size it had at full size
  (train.batch_size / (full batch-parallel devices x train.grad_accum_steps)): the same memory per device, and
  each step still takes train.batch_size examples, so the learning-rate schedule, which counts steps, is unchanged;
- the data position needs nothing: it is one global count of examples (trainer/data/pipeline.py), and every global
  batch is the same examples whoever reads them; the state restores onto the new mesh as any restore does.

Pure arithmetic on config.mesh and config.train, so a refusal (a batch that no longer divides) is one line before
anything is compiled or restored, and nothing in the workdir changes.
"""

import dataclasses
import fractions
import math

from parallel import mesh as mesh_lib
from trainer.base.errors import UserError

# The survivors of a lost process whose rejoin timed out (parallel/distributed.py): not retried by the supervisor at
# the same size; the launcher starts them as a smaller job. 76 is EX_PROTOCOL in sysexits.h, beside the lost peer's 75.
PROCESSES_MISSING_EXIT_CODE = 76
# The axes a change of size goes to, in order: a whole slice across the data-centre network first.
_RESIZED = ('dcn_data', 'dcn_fsdp', 'data', 'fsdp')
_DCN = ('dcn_data', 'dcn_fsdp', 'dcn_pipeline')


@dataclasses.dataclass(frozen=True)
class Size:
  """The job this attempt runs: its processes of the full count, its mesh settings and its accumulation."""
  processes: int
  full_processes: int
  mesh: dict[str, int]  # Every mesh.* size, concrete, for this attempt's devices.
  grad_accum_steps: int
  full_mesh: dict[str, int]
  full_grad_accum_steps: int

  @property
  def shrunk(self) -> bool:
    return self.processes < self.full_processes

  def describe(self) -> str:
    changed = [f'mesh.{k} {self.full_mesh[k]} -> {v}' for k, v in self.mesh.items() if v != self.full_mesh[k]]
    if self.grad_accum_steps != self.full_grad_accum_steps:
      changed.append(f'train.grad_accum_steps {self.full_grad_accum_steps} -> {self.grad_accum_steps}')
    if not changed:
      return f'Elastic: all {self.full_processes} processes of the run: its config as written.'
    grow = ' (a relaunch with all of them grows it back)' if self.shrunk else ''
    return (f'Elastic: running on {self.processes} of the run\'s {self.full_processes} processes: '
            f'{", ".join(changed)}; each step still takes train.batch_size examples, so the data order and '
            f'learning-rate schedule are unchanged{grow}.')


def _full_sizes(mesh_config, devices: int) -> dict[str, int]:
  """Every mesh.* setting as a concrete size for `devices` (the config's own checks and errors)."""
  dcn = mesh_lib.dcn_shape(mesh_config, devices)
  ici = mesh_lib.resolve_shape(mesh_config, devices // math.prod(dcn))
  return {**dict(zip(mesh_lib.AXES, ici)), **dict(zip(_DCN, dcn))}


def _batch_devices(sizes: dict[str, int]) -> int:
  return math.prod(sizes[a] * sizes.get(f'dcn_{a}', 1) for a in mesh_lib.BATCH_AXES)


def plan(mesh_config, train_config, full_processes: int, processes: int, devices_per_process: int) -> Size:
  """The mesh and accumulation for `processes` of a run whose config is written for `full_processes`.

  Raises:
    UserError: a full count below the processes running, or no mesh and accumulation of this size that takes the
      same global batch (named with the fix).
  """
  if isinstance(full_processes, bool) or not isinstance(full_processes, int) or full_processes < processes:
    raise UserError(f'--elastic_full_processes={full_processes!r} must be the process count the config is written '
                    f'for, at least the {processes} running now.')
  full = _full_sizes(mesh_config, full_processes * devices_per_process)
  batch, accum = train_config.batch_size, train_config.grad_accum_steps
  full_dp = _batch_devices(full)
  if batch % (full_dp * accum):
    raise UserError(f'train.batch_size={batch} does not split into train.grad_accum_steps={accum} microbatches '
                    f'over the {full_dp} batch-parallel devices of the full run; fix the config for its full size '
                    f'first.')
  micro = batch // (full_dp * accum)  # Rows per device per microbatch: what the memory plan was made for.
  ratio = fractions.Fraction(processes, full_processes)
  sizes = _resized(full, ratio, processes, full_processes)
  dp = _batch_devices(sizes)
  unit = math.lcm(dp, processes)
  if batch % unit:
    over = 'them and the processes' if unit != dp else 'them'
    raise UserError(
        f'elastic: {processes} of {full_processes} processes make {dp} batch-parallel devices (mesh '
        f'{_shape(sizes)}), and train.batch_size={batch} does not divide over {over}: '
        f'the run cannot go on at this size; nothing was changed. Relaunch with all {full_processes} processes, or '
        f'restart with a train.batch_size that divides over both sizes (e.g. {math.lcm(batch, unit, full_dp)}), or '
        f'a --elastic_min_processes that excludes {processes}.')
  per_device = batch // dp
  accum_now = next(n for n in range(-(-per_device // micro), per_device + 1) if per_device % n == 0)
  return Size(processes, full_processes, sizes, accum_now, full, accum)


def _resized(full: dict[str, int], ratio: fractions.Fraction, processes: int, full_processes: int) -> dict[str, int]:
  """`full` with one batch axis scaled by `ratio` (a slice first); UserError where none scales to whole devices."""
  if ratio == 1:
    return dict(full)
  for axis in _RESIZED:
    scaled = full[axis] * ratio
    if scaled.denominator == 1 and scaled >= 1:
      return {**full, axis: int(scaled)}
  raise UserError(f'elastic: no mesh for {processes} of {full_processes} processes: none of mesh.dcn_data='
                  f'{full["dcn_data"]}, mesh.dcn_fsdp={full["dcn_fsdp"]}, mesh.data={full["data"]}, mesh.fsdp='
                  f'{full["fsdp"]} scales by {ratio} to whole devices; nothing was changed. Relaunch with all '
                  f'{full_processes} processes, or set --elastic_min_processes so that every size it allows divides '
                  f'those axes (e.g. whole slices: mesh.dcn_data = the number of hosts).')


def _shape(sizes: dict[str, int]) -> str:
  return ', '.join(f'{a}={sizes[a] * sizes.get(f"dcn_{a}", 1)}' for a in mesh_lib.AXES)


def apply(mesh_config, train_config, size: Size) -> None:
  """Writes what `size` changes into config.mesh and config.train (existing keys of a locked config: allowed).

  Only the resized axis is written: an axis the config fills (-1) fills the same devices as at full size.
  """
  for key, value in size.mesh.items():
    if value != size.full_mesh[key]:
      mesh_config[key] = value
  train_config.grad_accum_steps = size.grad_accum_steps
