"""The pre-flight check: after the train step compiles and before anything runs or is written, does it fit?

A step that does not fit ends the launch with one UserError naming what it
needs, what the devices have, and the config changes that would fit (each
compiled by plan mode's machinery, trainer/run/plan.py); a step that fits with
under footprint.MARGIN free gets a warning. Called by trainer/run/loop.py before
the workdir is touched, so a refused launch leaves it as it was.
"""

from absl import logging

from trainer.base.errors import UserError
from trainer.memory import footprint
from trainer.observe import compiled_flops, flops
from trainer.run import plan


def compile_checked(job):
  """`job`'s compiled train step, once it is known to fit each local device; UserError with fixes otherwise."""
  devices = list(job.mesh.devices.flat)
  limit = footprint.device_limit(job.config.train.device_memory_gb, devices)
  try:
    compiled = footprint.compile_step(job)
  except footprint.CompilerRefused as e:  # The TPU compiler's own verdict: the same refusal, with fixes.
    logging.warning('The compiler refused the train step: %s', e)
    available = min(limit.bytes or e.available_bytes, e.available_bytes)
    needed = f"more than {footprint.gib(e.needed_bytes)} (the compiler's figure for temporaries alone)"
    _refuse(job, needed, footprint.Limit(available, limit.source), devices)
  needed = footprint.compiled_bytes(compiled)
  line = footprint.verdict(needed, limit)
  if limit.bytes is None or footprint.fits(needed, limit.bytes, footprint.MARGIN):
    logging.info('Pre-flight: %s', line)
  elif needed <= limit.bytes:
    logging.warning('Pre-flight: %s', line)
  else:
    logging.warning('Pre-flight: %s Trying changes that use less memory:', line)
    _refuse(job, footprint.gib(needed), limit, devices)
  dense_experts(job, compiled)
  return compiled


def dense_experts(job, compiled) -> str | None:
  """The dense-experts guard (trainer/observe/compiled_flops.py) for a dropless MoE step, logged as a warning; None when
  the step is not one or runs near its active FLOPs."""
  model = job.config.model
  if not model.get('num_experts', 0) or model.get('expert_capacity_factor'):
    return None
  counted = flops.job_step_flops(job, log=False)
  if counted is None:
    return None
  per_device = compiled_flops.dot_flops(compiled.as_text())
  line = compiled_flops.dense_experts_line(per_device * job.mesh.devices.size, counted.flops, moe_dropless=True)
  if line:
    logging.warning('%s', line)
  return line


def _refuse(job, needed: str, limit: footprint.Limit, devices) -> None:
  advice = plan.fixes(job.config, dict(job.mesh.shape), limit.bytes, devices, print_fn=logging.info)
  raise UserError(f'the compiled train step needs {needed} per device, over the {footprint.gib(limit.bytes)} '
                  f'available ({limit.source}); no step was run and no checkpoint was written. {advice}')
