"""Config checks that run before any device work, each failing with the key and the fix."""

from absl import logging
from jax.sharding import Mesh

from parallel import context as context_lib
from parallel import mesh as mesh_lib
from trainer import data
from trainer.base import config_schema
from trainer.base.errors import UserError
from trainer.models import layer_scan, lora
from trainer.supervision import notices
from trainer.training import pipeline_checks


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise UserError(message)


def validate_config(config) -> None:
  """Checks every value that can be judged without devices."""
  # Each key's type and range: the table beside configs/base.py's keys (launch.py checked them before anything; a
  # model.init_from's config.json has changed the model's since, and a config built in code was never checked).
  config_schema.check(config)
  # Model sizes against each other are checked by the model's builder (trainer/models/), which knows which keys it
  # reads; what is left here relates keys.
  _check_loss_chunks(config)
  _check_preference(config)
  # The policy names themselves are the model's to check; 'auto' is resolved by building the Job.
  _require(config.train.remat_policy != 'auto',
           "train.remat_policy='auto' is chosen by compiling candidates when the Job is built: validate the config "
           "of trainer.run.job.build_job(config).config, or name a policy.")
  data.check_config(config.data)
  notices.check_config(config.train)
  _warn_if_warmup_exceeds_steps(config.train)
  layer_scan.check(config.model)
  lora.check_config(config)
  pipeline_checks.check_config(config, pipeline_checks.stages_of(config.mesh))


def _check_loss_chunks(config) -> None:
  if 'loss_chunks' not in config.train:  # A run's config.json from before the key: the whole logits, as then.
    return
  chunks = config.train.loss_chunks
  if chunks == 1:
    return
  _require(config.model.task == 'lm',
           f"train.loss_chunks={chunks} slices a language model's logits; model.task={config.model.task!r} has none: "
           f'set --config.train.loss_chunks=1.')
  seq_len = config.data.seq_len
  _require(seq_len % chunks == 0,
           f'train.loss_chunks={chunks} must divide data.seq_len={seq_len}; choose one of '
           f'{[n for n in range(2, min(seq_len, 64) + 1) if seq_len % n == 0][:8]}.')


def _check_preference(config) -> None:
  """What train.objective='dpo' runs with: prepared pairs, the 'jit' strategy (the reference is bound beside the
  parameters there), one logits slice, the launcher's own loss."""
  if config.train.get('objective', 'task') != 'dpo':  # A run's config.json from before the key: its task's loss.
    return
  fix = "or set --config.train.objective=task"
  _require(config.data.source == 'array_record',
           f"train.objective='dpo' reads answer pairs that scripts/prepare_data.py wrote from chosen/rejected JSONL: "
           f"set --config.data.source=array_record and data.path to that folder, {fix}.")
  _require(config.parallel.strategy == 'jit',
           f"train.objective='dpo' runs under parallel.strategy='jit' (it binds the reference parameters beside the "
           f"policy's): set --config.parallel.strategy=jit, {fix}.")
  _require(config.train.get('loss_chunks', 1) == 1,
           f"train.objective='dpo' sums each answer's log-probabilities from whole logits: set "
           f"--config.train.loss_chunks=1, {fix}.")
  _require(pipeline_checks.stages_of(config.mesh) == 1,
           f"train.objective='dpo' does not run on pipeline stages yet: set --config.mesh.pipeline=1, {fix}.")


def _warn_if_warmup_exceeds_steps(train) -> None:
  # A warning, not an error: shortening a run from the command line (--config.train.steps=10) is common and fine.
  if train.warmup_steps > train.steps:
    logging.warning('train.warmup_steps=%d is more than train.steps=%d: warmup is cut to %d steps, so the learning '
                    'rate reaches train.learning_rate only at the last step and never decays. Lower '
                    'train.warmup_steps or raise train.steps.', train.warmup_steps, train.steps, train.steps)


def validate_strategy(config, mesh: Mesh) -> None:
  """Checks that `parallel.strategy` can run on the mesh's shape."""
  name, tensor, fsdp = config.parallel.strategy, mesh.shape['tensor'], mesh.shape['fsdp']
  expert = mesh.shape.get('expert', 1)
  # The per-device strategies run the model on whole, gathered parameters: an expert axis needs the tokens
  # exchanged all-to-all inside the model, which the MoE layer does only under 'jit', where it gets the mesh
  # (trainer/models/expert_parallel.py).
  _require(name == 'jit' or expert == 1,
           f"parallel.strategy={name!r} does not support an expert axis (mesh.expert={expert}); set "
           f"mesh.expert=1, or use parallel.strategy='jit' for expert parallelism.")
  experts = config.model.get('num_experts', 0)
  _require(not experts or experts % expert == 0,
           f'model.num_experts={experts} must be a multiple of mesh.expert={expert} (each device on the expert axis '
           f'holds an equal share of the experts); choose num_experts from {[expert * n for n in range(1, 5)]}, or '
           f'a mesh.expert that divides it.')
  _check_context(config, mesh.shape.get('context', 1))
  pipeline_checks.check_config(config, mesh.shape.get('pipeline', 1), mesh_lib.data_parallel_size(mesh))
  if name == 'shard_map':
    # The per-device step gathers whole parameters: a tensor axis would only hold copies of the same work.
    _require(tensor == 1, f"parallel.strategy='shard_map' does not support tensor parallelism (mesh.tensor={tensor}); "
             f"set mesh.tensor=1, or use parallel.strategy='jit' for tensor parallelism.")
  if name == 'pmap':
    _require(fsdp == 1 and tensor == 1,
             f"parallel.strategy='pmap' replicates the parameters on every device, so it needs mesh.fsdp=1 and "
             f"mesh.tensor=1 (got mesh.fsdp={fsdp}, mesh.tensor={tensor}); set them to 1 (mesh.data=-1 takes "
             f"every device), or use parallel.strategy='jit' or 'shard_map' to shard the parameters.")


def _check_context(config, parts: int) -> None:
  """mesh.context > 1 splits every row's tokens: only the 'jit' strategy's language models run across it."""
  if parts == 1:
    return
  name = config.parallel.strategy
  _require(name == 'jit', f"parallel.strategy={name!r} cannot split sequences (mesh.context={parts}): attention "
           f"across the split runs under parallel.strategy='jit'; set it, or mesh.context=1.")
  _require(config.model.task == 'lm', f"mesh.context={parts} splits token rows, but model.task="
           f"{config.model.task!r} has none to split: set mesh.context=1.")
  context_lib.check_seq_len(config.data.seq_len, parts)


def validate_grad_accum(config, mesh: Mesh) -> None:
  """Checks that every device's share of the batch splits into `train.grad_accum_steps` microbatches."""
  accum = config.train.grad_accum_steps
  batch_devices = mesh_lib.data_parallel_size(mesh)
  per_device = config.train.batch_size // batch_devices
  _require(per_device % accum == 0,
           f'train.grad_accum_steps={accum} does not divide the per-device batch of {per_device} sequences '
           f'(train.batch_size={config.train.batch_size} over {batch_devices} batch-parallel devices); '
           f'pick grad_accum_steps dividing {per_device}, or raise train.batch_size.')
