"""Everything a config compiles to before data or state exist: mesh, model, optimizer, shardings, steps.

Built once per run by trainer/run/loop.py (and --plan by trainer/run/plan.py); scripts
(benchmarks, tools) build the same Job, so what they measure is exactly what the
launcher runs. Building it first makes the memory choice (`train.remat_policy=
'auto'`, trainer/memory/remat.py), so the Job carries the settings it was built
with and the choice that made them.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding

from configs import base as base_config
from parallel import mesh as mesh_lib
from parallel import sharding
from trainer import pipeline
from trainer.hf import load as hf_load
from trainer.memory import footprint, measure, remat
from trainer.models import contract, lora, registry
from trainer.safety import guardrails
from trainer.training import optimizer, strategy, validation
from trainer.training import state as state_lib
from trainer.training import step as step_lib
from trainer.training import task as task_lib


@dataclasses.dataclass(frozen=True)
class Job:
  config: Any
  mesh: Mesh
  task: task_lib.Task  # The model (NNX or Linen, adapted) and what it is trained to do.
  tx: optax.GradientTransformation
  abstract: state_lib.TrainState  # Shapes and dtypes of the state; nothing allocated.
  shardings: state_lib.TrainState  # NamedSharding per state leaf.
  batch_shardings: dict[str, NamedSharding]  # Per batch key: rows over the batch axes (steps and data.to_global).
  abstract_batch: dict[str, jax.ShapeDtypeStruct]
  train_step: Any  # Partitioned by the strategy; `.lower(state, batch).compile()`.
  eval_step: Any
  memory: remat.Choice | None = None  # What train.remat_policy resolved to ('auto' or not), for the run manifest.
  # What tracing this Job left to reuse: 'train_step', the step's jaxpr, which compile_train_step keeps under the 'jit'
  # strategy, and 'flops', the step's FLOPs once counted (trainer/observe/flops.py counts from that jaxpr where it
  # can, instead of tracing the model once more).
  traced: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

  @property
  def brought_model(self) -> bool:
    """The model is the user's own (an import path), not one the launcher registers and tests."""
    return registry.registered_task(self.config.model.name) is None

  def compile_train_step(self):
    """Ahead-of-time compile for the configured mesh: the one compile of the run."""
    args = (sharding.with_shardings(self.abstract, self.shardings), self.abstract_batch)
    if self.config.parallel.strategy != 'jit':
      return self.train_step.lower(*args).compile()
    traced = self.train_step.trace(*args)  # What `lower` runs first: the jaxpr comes at no extra cost.
    self.traced['train_step'] = traced.jaxpr
    return traced.lower().compile()

  def init_state(self, seed: int) -> state_lib.TrainState:
    """The fresh state: random parameters, or model.init_from's weights read straight into their shardings."""
    params = None
    if self.config.model.get('init_from'):
      # The base weights only: LoRA's adapters are not in the checkpoint, and start from their init.
      params = hf_load.load_params(self.config, lora.base(self.abstract.params), lora.base(self.shardings.params))
    return state_lib.create_state(seed, self.task.model, self.tx, self.shardings, self.config.train.ema_decay, params,
                                  reference=self.shardings.reference_params is not None)


def batch_shardings(mesh: Mesh, rules, shapes: dict[str, jax.ShapeDtypeStruct]) -> dict[str, NamedSharding]:
  """Each batch array split by rows over the 'batch' axes, its other dimensions whole."""
  return {k: sharding.named_sharding(mesh, rules, ('batch',) + (None,) * (len(s.shape) - 1)) for k, s in shapes.items()}


def build_job(config, devices: Sequence[jax.Device] | None = None, *, workdir: str | None = None,
              limit: footprint.Limit | None = None, log_fn=logging.info) -> Job:
  """Resolves the memory choice, validates the config against the devices (default: all of every process) and builds
  the Job; `job.config` is the config as resolved (no 'auto' remat policy).

  `workdir`: a resumed run's earlier 'auto' choice is read back from its newest checkpoint instead of being
  searched for again. `limit`: the memory 'auto' fits in (default: the devices', footprint.device_limit).
  `log_fn` says the choice, once.
  """
  config, choice = remat.resolve(config, devices, limit=limit, workdir=workdir, log_fn=log_fn,
                                 measure_fn=_candidate_bytes)
  return dataclasses.replace(_assemble(config, devices), memory=choice)


def _candidate_bytes(config, devices: Sequence[jax.Device]) -> tuple[int, measure.Refused | None]:
  """A remat 'auto' candidate's per-device bytes, built as the run would build it and compiled; or the compiler's
  lower bound and its refusal."""
  try:
    return measure.plan_of(_assemble(config, devices)).total_bytes, None
  except measure.Refused as e:
    return e.needed_bytes, e


def _assemble(config, devices: Sequence[jax.Device] | None) -> Job:
  """The Job of a config whose memory choice is made."""
  validation.validate_config(config)
  mesh = mesh_lib.build_mesh(config.mesh, devices)
  mesh_lib.check_batch_size(config.train.batch_size, mesh, jax.process_count())
  validation.validate_strategy(config, mesh)
  validation.validate_grad_accum(config, mesh)
  rules = pipeline.layer_rules(sharding.rules_from_config(config.parallel), mesh)
  task = task_lib.build_task(config, mesh, rules)
  lora.check_adapted(config.model, task.model.abstract_params)
  sharding.check_divisible(task.model.abstract_boxed, mesh, rules)
  defaults = base_config.get_config().train
  optimizer.validate(config.train, defaults)
  if note := optimizer.unused_first_moment_dtype(config.train, defaults):
    logging.info('%s', note)
  tx, schedule = optimizer.build_optimizer(config.train, task.model.abstract_boxed)
  guardrails.validate(config.train.on_nonfinite)
  tx = guardrails.guard_optimizer(tx)  # A non-finite update is never applied, in any train.on_nonfinite mode.
  abstract, shardings = state_lib.abstract_state(task.model, tx, mesh, rules, config.train.ema_decay,
                                                 # Under LoRA the frozen base is the reference (task.py).
                                                 reference=(config.train.get('objective', 'task') == 'dpo'
                                                            and not lora.enabled(config.model)))
  shapes = task.batch_shapes()
  per_key = batch_shardings(mesh, rules, shapes)
  abstract_batch = {k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=per_key[k]) for k, s in shapes.items()}
  name = config.parallel.strategy
  train_step = strategy.partition_train_step(name, mesh, shardings, per_key, task=task, tx=tx, schedule=schedule,
                                             options=step_lib.StepOptions.from_config(config.train))
  eval_step = strategy.partition_eval_step(name, mesh, shardings.params, per_key, task=task.for_eval(),
                                           frozen_shardings=shardings.reference_params)
  job = Job(config, mesh, task, tx, abstract, shardings, per_key, abstract_batch, train_step, eval_step)
  if job.brought_model:
    contract.check_strategy(job)
  return job
