"""Everything a config compiles to before data or state exist: mesh, model, optimizer, shardings, steps.

Built once per run by trainer/loop.py; scripts (benchmarks, tools) build the
same Job, so what they measure is exactly what the launcher runs.
"""

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from parallel import mesh as mesh_lib
from parallel import sharding, strategy
from trainer import data, guardrails, optimizer, validation
from trainer.precision import compute_dtype
from trainer import step as step_lib
from trainer import state as state_lib
from trainer.models import llama


def build_model(config, mesh=None, rules=()) -> llama.Llama:
  """The configured model; given a mesh (the 'jit' strategy), its activations carry sharding constraints."""
  m = config.model
  return llama.Llama(llama.LlamaConfig(
      num_layers=m.num_layers, d_model=m.d_model, num_heads=m.num_heads, mlp_dim=m.mlp_dim,
      vocab_size=m.vocab_size, rope_max_wavelength=m.rope_max_wavelength, norm_eps=m.norm_eps,
      dtype=compute_dtype(config.train.compute_dtype), param_dtype=jnp.dtype(config.train.param_dtype),
      remat_policy=config.train.remat_policy, scan_layers=m.scan_layers, mesh=mesh, rules=tuple(rules)))


@dataclasses.dataclass(frozen=True)
class Job:
  config: Any
  mesh: Mesh
  model: llama.Llama
  tx: optax.GradientTransformation
  abstract: state_lib.TrainState  # Shapes and dtypes of the state; nothing allocated.
  shardings: state_lib.TrainState  # NamedSharding per state leaf.
  batch_sharding: NamedSharding
  abstract_batch: dict[str, jax.ShapeDtypeStruct]
  train_step: Any  # Partitioned by the strategy; `.lower(state, batch).compile()`.
  eval_step: Any

  def compile_train_step(self):
    """Ahead-of-time compile for the configured mesh: the one compile of the run."""
    return self.train_step.lower(sharding.with_shardings(self.abstract, self.shardings), self.abstract_batch).compile()

  def init_state(self, seed: int) -> state_lib.TrainState:
    example = self.abstract_batch['inputs']
    return state_lib.create_state(seed, self.model, self.tx, jax.ShapeDtypeStruct(example.shape, example.dtype),
                                  self.shardings)


def build_job(config, devices: Sequence[jax.Device] | None = None) -> Job:
  """Validates the config against the devices (default: all of every process) and builds the Job."""
  validation.validate_config(config)
  mesh = mesh_lib.build_mesh(config.mesh, devices)
  mesh_lib.check_batch_size(config.train.batch_size, mesh, jax.process_count())
  validation.validate_against_mesh(config, mesh)
  validation.validate_strategy(config, mesh)
  validation.validate_grad_accum(config, mesh)
  rules = sharding.rules_from_config(config.parallel)
  model = build_model(config, *((mesh, rules) if config.parallel.strategy == 'jit' else ()))
  tx, schedule = optimizer.build_optimizer(config.train)
  guardrails.validate(config.train.on_nonfinite)
  tx = guardrails.guard_optimizer(tx)  # A non-finite update is never applied, in any train.on_nonfinite mode.
  example = jax.ShapeDtypeStruct((config.train.batch_size, config.data.seq_len), jnp.int32)
  abstract, shardings = state_lib.abstract_state(model, tx, example, mesh, rules)
  batch_sharding = sharding.named_sharding(mesh, rules, ('batch', 'length'))
  abstract_batch = {k: jax.ShapeDtypeStruct(example.shape, example.dtype, sharding=batch_sharding)
                    for k in data.batch_keys(config.data)}
  name = config.parallel.strategy
  train_step = strategy.partition_train_step(name, mesh, shardings, batch_sharding, apply_fn=model.apply, tx=tx,
                                             schedule=schedule, options=step_lib.StepOptions.from_config(config.train))
  eval_step = strategy.partition_eval_step(name, mesh, shardings.params, batch_sharding, apply_fn=model.apply)
  return Job(config, mesh, model, tx, abstract, shardings, batch_sharding, abstract_batch, train_step, eval_step)
