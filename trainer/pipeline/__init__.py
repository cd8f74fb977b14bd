"""Pipeline parallelism: the built-in Llama's scanned layers split into `mesh.pipeline` stages (issue 43).

One entry point for the model, `run_layers`, which runs the layer stack as a circular pipeline
(trainer/pipeline/schedule.py); `from_config` gives the schedule a config and mesh ask for (None without a
pipeline axis); `summary` is the line the log and `--plan` print. What cannot be pipelined is refused, in one
line, by trainer/training/pipeline_checks.py (`check_config`; `can_double` says whether `--plan` may propose twice the
stages when a model does not fit): it asks the models what they are, so it sits above them, and this package,
which the built-in Llama runs its layers through, below.

Parameters keep the unpipelined layout (one 'layers' axis of num_layers), so a checkpoint restores onto any
pipeline size, or none; `layer_rules` splits that axis over the pipeline devices.
"""

from jax.sharding import Mesh

from trainer.pipeline.schedule import AXIS, Schedule, run, unpipelined_for_counting

__all__ = ['AXIS', 'Schedule', 'describe', 'from_config', 'layer_rules', 'run', 'summary', 'unpipelined_for_counting']


def from_config(train_config, mesh: Mesh | None) -> Schedule | None:
  """The schedule of `config.train` on `mesh`; None when the mesh has no pipeline axis (or one of size 1)."""
  stages = mesh.shape.get(AXIS, 1) if mesh is not None else 1
  if stages == 1:
    return None
  microbatches = train_config.get('pipeline_microbatches', 0) or stages
  return Schedule(stages, microbatches, train_config.get('pipeline_repeats', 1))


def layer_rules(rules: tuple, mesh: Mesh) -> tuple:
  """`rules` with the stacked-layers axis split over the pipeline axis, when the mesh has one (first rule wins).

  Layer l sits on device l // (num_layers / S): stage s's layers when repeats = 1; with repeats > 1 the
  circular view regroups them inside the step (schedule.py).
  """
  if mesh.shape.get(AXIS, 1) == 1:
    return rules
  return (('layers', AXIS),) + tuple(rules)


def describe(schedule: Schedule, num_layers: int) -> str:
  """One line: stages, the layers each holds, the bubble."""
  per = num_layers // (schedule.stages * schedule.repeats)
  groups = '; '.join(
      f'stage {s}: ' + ', '.join(f'{(r * schedule.stages + s) * per}-{(r * schedule.stages + s) * per + per - 1}'
                                 for r in range(schedule.repeats))
      for s in range(schedule.stages))
  return (f'pipeline: {schedule.stages} stages x {schedule.repeats} repeat(s) of {per} layer(s), '
          f'{schedule.microbatches} microbatches, {schedule.iterations} iterations a step, bubble '
          f'{schedule.bubble_fraction:.1%} = (S-1)/(repeats x microbatches + S-1); layers {groups}')


def summary(model, train, mesh_shape: dict[str, int]) -> str | None:
  """`describe` for config.model and config.train on a mesh of `mesh_shape`; None without a pipeline axis."""
  stages = mesh_shape.get(AXIS, 1)
  if stages == 1:
    return None
  schedule = Schedule(stages, train.get('pipeline_microbatches', 0) or stages, train.get('pipeline_repeats', 1))
  return describe(schedule, model.num_layers)
