"""What can be pipelined, checked before any compile: each refusal is one UserError naming the key and the fix."""

from trainer.base.errors import UserError
from trainer.models import adapters, layer_scan, registry
from trainer.pipeline import AXIS

# What a model must be for mesh.pipeline > 1: the launcher splits a stack it can see, the built-in Llama's
# scanned blocks. A brought model's layers are inside its own code, so it must run them through the schedule itself.
CONTRACT = ("the launcher cannot see a brought model's layers; to be pipelined its builder takes a pipeline= "
            "keyword (a trainer.pipeline.Schedule, None without the axis) and runs its model.num_layers stacked "
            "layers through trainer.pipeline.run(layer_fn, stacked_params, x, per_token_arrays, pipeline, mesh, "
            "batch_axes), their parameters' leading axis named 'layers'")


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise UserError(message)


def stages_of(mesh) -> int | None:
  """The pipeline size config.mesh (`mesh`) asks for; None while mesh.pipeline is -1 (known once the mesh is built)."""
  size = mesh.get('pipeline', 1)
  if size == -1:
    return None
  return size * mesh.get('dcn_pipeline', 1) if isinstance(size, int) else size


def check_config(config, stages: int | None, batch_devices: int | None = None) -> None:
  """Refuses settings that cannot be pipelined over `stages` (None: not yet known, only the keys are checked).

  `batch_devices` (the devices the batch is split over, once the mesh exists) adds the per-device check: each
  device's rows must split into the microbatches, so cutting microbatches moves no row between devices.
  """
  train = config.train
  micro, repeats = train.get('pipeline_microbatches', 0), train.get('pipeline_repeats', 1)
  _require(isinstance(micro, int) and not isinstance(micro, bool) and micro >= 0,
           f'train.pipeline_microbatches={micro!r} must be an integer >= 0 (0 = one microbatch per stage).')
  _require(isinstance(repeats, int) and not isinstance(repeats, bool) and repeats >= 1,
           f'train.pipeline_repeats={repeats!r} must be an integer >= 1 (layer groups per stage).')
  if stages is None or stages == 1:
    return
  micro = micro or stages
  name = config.parallel.strategy
  _require(name == 'jit', f"parallel.strategy={name!r} cannot pipeline (mesh.pipeline={stages}): the stages pass "
           f"activations inside one GSPMD program; use parallel.strategy='jit', or set mesh.pipeline=1.")
  model = config.model
  if model.name != 'llama':
    _require(registry.registered_task(model.name) is None and
             adapters.takes_keyword(registry.resolve(model.name), 'pipeline'),
             f"model.name={model.name!r} cannot be pipelined (mesh.pipeline={stages}): "
             + (CONTRACT if registry.registered_task(model.name) is None else 'it has no layer stack to split')
             + '. Set mesh.pipeline=1.')
  _check_layers(config, stages, repeats, micro, batch_devices)


def _check_layers(config, stages: int, repeats: int, micro: int, batch_devices: int | None) -> None:
  """The layers, microbatches and rows of a model that can be pipelined (the Llama's own settings for the Llama)."""
  model, train = config.model, config.train
  llama = model.name == 'llama'
  _require(not llama or layer_scan.scans(model), f'mesh.pipeline={stages} splits the scanned layer stack, but '
           f'model.scan_layers={model.scan_layers!r} unrolls these {model.num_layers} layers: set '
           f'--config.model.scan_layers=True.')
  _require(not llama or not model.get('num_experts', 0), f"mesh.pipeline={stages} does not pipeline "
           f"mixture-of-experts layers (model.num_experts={model.num_experts}: their routing losses are sown per "
           f"layer): set mesh.pipeline=1 or model.num_experts=0.")
  context = config.mesh.get('context', 1)
  _require(context == 1, f'mesh.pipeline={stages} with mesh.context={context}: attention across the sequence split '
           f'is not run inside pipeline stages; set one of them to 1.')
  layers = model.num_layers
  _require(layers % (stages * repeats) == 0,
           f'model.num_layers={layers} does not split into mesh.pipeline={stages} stages x train.pipeline_repeats='
           f'{repeats}: every stage holds the same number of layers, so choose stages x repeats from '
           f'{[d for d in range(2, layers + 1) if layers % d == 0][:6]}.')
  _require(micro >= stages, f'train.pipeline_microbatches={micro} is fewer than the mesh.pipeline={stages} stages: '
           f'some stage would always idle; use at least {stages} (0 picks {stages}).')
  rows = train.batch_size // train.grad_accum_steps
  _require(rows % micro == 0, f'train.batch_size={train.batch_size} / train.grad_accum_steps={train.grad_accum_steps} '
           f'= {rows} rows a pass do not split into train.pipeline_microbatches={micro}; choose microbatches '
           f'dividing {rows}.')
  if batch_devices:
    unit = micro * batch_devices  # Each microbatch's rows split over the batch devices too.
    _require(rows % unit == 0, f'{rows} rows a pass (train.batch_size / train.grad_accum_steps) over '
             f'{batch_devices} batch-parallel devices do not split into train.pipeline_microbatches={micro} on every '
             f'device; use a batch of rows divisible by {unit}, or fewer microbatches.')


def can_double(config, mesh_shape: dict[str, int]) -> bool:
  """Whether the model and batch allow twice the pipeline stages, taken from the data axis."""
  if mesh_shape['data'] % 2:
    return False
  batch_devices = mesh_shape['data'] // 2 * mesh_shape['fsdp'] * mesh_shape.get('expert', 1)
  try:
    check_config(config, mesh_shape.get(AXIS, 1) * 2, batch_devices)
  except UserError:
    return False
  return True
