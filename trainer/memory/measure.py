"""What a Job's compiled step needs per device: compile it and read its memory analysis.

The one measurement both plan mode (trainer/run/plan.py: the report and the fixes it
proposes) and remat 'auto' (trainer/memory/remat.py: its candidates, measured
for trainer/run/job.py's build_job) are made of. It takes a built Job rather than
building one, so that the Job's builder can use it without a circle.
"""

import copy
import dataclasses

import jax

from parallel import sharding
from trainer import attention
from trainer.base.errors import UserError
from trainer.memory import footprint, gpu_targets
from trainer.observe import flops, traced_flops


@dataclasses.dataclass(frozen=True)
class Plan:
  """Per-device memory of the compiled step, and its FLOPs."""
  mesh_shape: dict[str, int]
  device_kind: str
  params_bytes: int
  opt_state_bytes: int
  argument_bytes: int  # Everything passed in: state and batch.
  output_bytes: int
  alias_bytes: int  # Outputs written into donated inputs' buffers (the state).
  temp_bytes: int  # Activations, gradients and scratch, live only during the step.
  code_bytes: int
  flops: flops.StepFlops | None  # The analytic counts: the built-in llama only.
  traced: traced_flops.Count | None = None  # Any model; None where the step does not trace without a mesh.
  attention: str | None = None  # The kernel a built-in model's attention runs on this mesh, and why; None otherwise.
  ema_bytes: int = 0  # The float32 parameter average (train.ema_decay > 0).
  reference_bytes: int = 0  # The frozen reference parameters (train.objective='dpo').

  @property
  def total_bytes(self) -> int:
    """Peak bytes per device while the step runs: inputs, outputs not aliased to them, temporaries, code."""
    return footprint.step_bytes(self.argument_bytes, self.output_bytes, self.alias_bytes, self.temp_bytes,
                                self.code_bytes)


class Refused(UserError):
  """The compiler refused the step for memory (footprint.CompilerRefused), with the mesh it was built for."""

  def __init__(self, refused: footprint.CompilerRefused, mesh_shape: dict[str, int]):
    super().__init__(str(refused))
    self.needed_bytes, self.available_bytes, self.mesh_shape = refused.needed_bytes, refused.available_bytes, mesh_shape


def plan_of(job) -> Plan:
  """Compiles `job`'s train step (a trainer/run/job.py Job) and measures it.

  Raises Refused when the compiler itself finds that the step cannot fit.
  """
  config = job.config
  try:
    memory = footprint.compile_step(job).memory_analysis()
  except footprint.CompilerRefused as e:
    raise Refused(e, dict(job.mesh.shape)) from e
  except jax.errors.JaxRuntimeError as e:
    if not gpu_targets.is_deviceless(job.mesh.devices.flat[0]):
      raise
    raise gpu_targets.compiler_failed(e) from e
  _, totals = sharding.sharding_table(job.abstract, job.shardings)
  return Plan(
      mesh_shape=dict(job.mesh.shape), device_kind=job.mesh.devices.flat[0].device_kind,
      params_bytes=totals['params_bytes_per_device'], opt_state_bytes=totals['opt_state_bytes_per_device'],
      ema_bytes=totals.get('ema_params_bytes_per_device', 0),
      reference_bytes=totals.get('reference_params_bytes_per_device', 0),
      argument_bytes=memory.argument_size_in_bytes, output_bytes=memory.output_size_in_bytes,
      alias_bytes=memory.alias_size_in_bytes, temp_bytes=memory.temp_size_in_bytes,
      code_bytes=memory.generated_code_size_in_bytes,
      flops=(flops.step_flops(config.model, config.train.batch_size, config.data.seq_len)
             if config.model.name == 'llama' else None),
      traced=flops.job_step_flops(job, log=False),  # report() prints it, once, not once per candidate.
      attention=_attention(config.model, config.data, config.train.compute_dtype, job.mesh))


def _attention(model, data, compute_dtype: str, mesh) -> str | None:
  # For the mesh's platform: a --topology plan names TPU kernels.
  choice = attention.check_config(model, data, compute_dtype, mesh)
  return choice.describe() if choice else None


def with_overrides(config, overrides: dict[str, object]):
  """A copy of `config` with {'section.key': value} changed; the original is untouched."""
  config = copy.deepcopy(config)
  with config.unlocked():
    for key, value in overrides.items():
      section, name = key.split('.')
      config[section][name] = value
  return config


def loss_chunks_worth_trying(config, mesh_shape: dict[str, int], budget: int | None) -> int | None:
  """Slices for train.loss_chunks where one device's whole float32 logits are 5% of the budget or more.

  Only the built-in Llama is offered it (a brought model must take hidden_and_head; its class is not known here).
  """
  if config.model.name != 'llama' or config.train.get('loss_chunks', 1) != 1 or budget is None:
    return None
  rows = config.train.batch_size // (mesh_shape['data'] * mesh_shape['fsdp'] * mesh_shape.get('expert', 1))
  tokens = config.data.seq_len // mesh_shape.get('context', 1)  # A device's part of each row.
  logits_bytes = 4 * rows * tokens * config.model.vocab_size // mesh_shape['tensor']
  divisors = [n for n in range(2, 9) if config.data.seq_len % n == 0]
  return divisors[-1] if divisors and logits_bytes >= 0.05 * budget else None
