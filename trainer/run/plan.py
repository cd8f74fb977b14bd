"""Plan mode (`launch.py --plan`): compile the real train step ahead of time and report what it will cost.

Nothing is trained and no data is read. The step is lowered and compiled for
the configured mesh, on this machine's devices (fake CPU devices work) or, with
`--topology=v5p:4x4x4`, for a TPU pod slice this machine does not have: the
optional `libtpu` wheel (requirements-tpu-plan.txt) describes the pod's chips,
and XLA's TPU compiler gives the real per-chip memory use. `--topology=h100:8`
does the same for NVIDIA GPUs with jax's CUDA plugin (requirements-gpu-plan.txt;
trainer/memory/gpu_targets.py). Printed: the mesh,
per-device bytes (parameters, optimizer state, temporaries, from
`compiled.memory_analysis()`), FLOPs per step (trainer/observe/flops.py: counted from
the traced step for any model; the built-in Llama's analytic conventions too)
and the step time the FLOPs imply on each accelerator in the peak table.

The memory budget is `--plan_memory_gb`, else the chip's HBM with `--topology`,
else what a run's pre-flight check would use (trainer/memory/footprint.py):
`train.device_memory_gb` or the local devices' own limit. A plan that does not
fit fails with the config changes that would make it fit, each of them compiled
and measured the same way; the TPU compiler refusing a step outright
(CompileTimeHbmOom) is the same verdict. `train.remat_policy='auto'` is resolved
as the Job is built, as the run resolves it (trainer/run/job.py, trainer/memory/remat.py).

launch.py sets TF_CPP_MIN_LOG_LEVEL=3 for --plan before jax loads: XLA's
slow-operation alarms ('Constant folding an instruction is taking > 1s',
'Very slow compile?') are error-level C++ log lines that look like failures.
Measured on this CPU: with the variable (or absl's min log level 3) a 3-minute
compile printed no alarm; without it, two. The TPU compiler of --topology
lives in libtpu, whose own logging this does not reach; its start-up complaints
about the missing TPU metadata are answered instead (`_describe_host_to_libtpu`).
"""

import contextlib
import importlib.util
import logging
import math
import os
import re

import jax
from absl import logging as absl_logging

from trainer import attention, pipeline
from trainer.base.errors import UserError
from trainer.hf import load as hf_load
from trainer.memory import footprint, gpu_targets, measure, remat
from trainer.memory.measure import Plan, Refused, with_overrides  # noqa: F401  (API)
from trainer.observe import flops
from trainer.run import job as job_lib
from trainer.training import pipeline_checks

GIB = footprint.GIB
# HBM per chip in GiB, for --topology runs without --plan_memory_gb.
HBM_GIB = {'h100': 80, 'h200': 141, 'v4': 32, 'v5e': 16, 'v5p': 95, 'v6e': 32}
ASSUMED_MFU = 0.5  # The step time printed next to the compute-bound one: the MFU a well-tuned run reaches.


def make_plan(config, devices=None) -> Plan:
  """Builds the Job on `devices` (default: this machine's), compiles its train step and measures it.

  Raises Refused when the compiler itself finds that the step cannot fit.
  """
  return measure.plan_of(job_lib.build_job(config, devices))


def total_or_refused(config, devices) -> tuple[int, Refused | None]:
  """Per-device bytes of `config`'s compiled step, or (the compiler's lower bound, the refusal)."""
  try:
    return make_plan(config, devices).total_bytes, None
  except Refused as e:
    return e.needed_bytes, e


def split_slices(topology: str) -> tuple[int, str]:
  """'2xv5p:2x2x2' (two v5p 2x2x2 slices joined by DCN) -> (2, 'v5p:2x2x2'); a topology without the prefix is one
  slice."""
  found = re.fullmatch(r'(\d+)x([a-z]\w*:.*)', topology)
  return (int(found.group(1)), found.group(2)) if found else (1, topology)


def topology_devices(topology: str) -> list[jax.Device]:
  """The compile-only devices of a TPU slice such as 'v5p:4x4x4' (libtpu), of several slices joined by DCN such as
  '2xv5p:2x2x2' (the devices carry their slice_index, so mesh.dcn_* axes split across slices), or of GPUs such as
  'h100:8' (CUDA plugin)."""
  if gpu_targets.is_gpu_topology(topology):
    return gpu_targets.devices(topology)
  slices, topology = split_slices(topology)
  if importlib.util.find_spec('libtpu') is None:
    raise UserError(f'--topology={topology!r} needs the TPU compiler, an optional extra of about 600 MB: '
                    f'pip install -r requirements-tpu-plan.txt (or run --plan without --topology).')
  from jax.experimental import topologies
  # libtpu takes /tmp/libtpu_lockfile so that two processes never drive the same chips; compile-only devices drive
  # none, and without this a second plan on the machine (two test workers, two terminals) fails to describe the
  # slice ("Internal error when accessing libtpu multi-process lockfile": seen under pytest -n 2).
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  _describe_host_to_libtpu(topology)
  try:
    return list(topologies.get_topology_desc(topology, 'tpu', **({'num_slices': slices} if slices > 1 else {})).devices)
  except Exception as e:  # pylint: disable=broad-except  (the TPU plugin raises its own runtime errors)
    text = ' '.join(str(e).split())[:300]
    raise UserError(f'--topology={topology!r} cannot be described ({text}); name a TPU generation and chip '
                    f'grid, e.g. v4:2x2x2, v5p:4x4x4, v5e:16x16 or v6e:4x4, or GPUs: '
                    f'{", ".join(gpu_targets.TARGETS)}[:[HOSTSx]GPUS], e.g. h100:8.') from e


# Accelerator type names count TensorCores where a chip has two (v4, v5p) and chips otherwise; v5e has its own name.
_ACCELERATOR_TYPE = {'v5e': ('v5litepod', 1), 'v4': ('v4', 2), 'v5p': ('v5p', 2)}


def _describe_host_to_libtpu(topology: str) -> None:
  """Tells libtpu the slice it would otherwise look up, on a host with no TPU chips.

  With nothing set, libtpu asks the cloud metadata server, finds none, and prints 'could not determine TPU
  accelerator type' and an E0000 'unexpected worker hostname' line on every --topology plan, which read as a
  failure. The compile-only devices come from the topology string alone: a v5p:4x4x4 plan printed the same with
  TPU_ACCELERATOR_TYPE unset, v5p-8 or v5p-128. Values the user exported are kept; a TPU VM is left alone.
  """
  try:
    from jax._src import hardware_utils  # What jax itself checks before it initializes Cloud TPU.
    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
      return
  except Exception:  # pylint: disable=broad-except  (private; if it moved, say nothing rather than guess)
    return
  generation, _, grid = topology.partition(':')
  try:
    chips = math.prod(int(n) for n in grid.split('x'))
  except ValueError:
    return  # get_topology_desc names the mistake.
  name, per_chip = _ACCELERATOR_TYPE.get(generation, (generation, 1))
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', f'{name}-{chips * per_chip}')
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')


_gib = footprint.gib


def _six_n_params(counts: flops.StepFlops) -> str:
  """What N of the 6N figure counts: the non-embedding parameters, and a tied head when one is added."""
  if counts.inactive_params:
    active = counts.non_embedding_params - counts.inactive_params
    return (f'{counts.six_n_params:,} parameters used ({active:,} active of {counts.non_embedding_params:,} '
            f'non-embedding: the experts a token is routed to{", and the tied output head" if active != counts.six_n_params else ""})')
  extra = counts.six_n_params - counts.non_embedding_params
  if not extra:
    return f'{counts.six_n_params:,} non-embedding parameters'
  return (f'{counts.six_n_params:,} parameters used ({counts.non_embedding_params:,} non-embedding and the tied '
          f'output head\'s {extra:,}, whose matmul is done every token)')


def _duration(seconds: float) -> str:
  if seconds >= 1:
    return f'{seconds:.3f} s'
  return f'{seconds * 1e3:.3f} ms' if seconds >= 1e-3 else f'{seconds * 1e6:.1f} us'


def report(plan: Plan, config, topology: str | None = None) -> str:
  """The human-readable plan; `topology` (--topology) names the chips where their device kind is vaguer."""
  devices = math.prod(plan.mesh_shape.values())
  kind = plan.device_kind
  generation = split_slices(topology or '')[1].split(':')[0]
  if generation and generation.lower() not in kind.lower().replace(' ', ''):  # libtpu calls a v5p chip 'TPU v5'.
    kind = f'{generation} ({kind})'
  tokens = config.train.batch_size * config.data.seq_len
  lines = [
      f'Plan: mesh {plan.mesh_shape} over {devices} x {kind}; strategy {config.parallel.strategy}; '
      f'global batch {config.train.batch_size} x {config.data.seq_len} tokens'
      f'{f" in {config.train.grad_accum_steps} microbatches" if config.train.grad_accum_steps > 1 else ""}; '
      f'remat {config.train.remat_policy}; compute dtype {config.train.compute_dtype}',
      f'Attention: {plan.attention}' if plan.attention else "Attention: the model's own (not a built-in model)",
      *filter(None, [pipeline.summary(config.model, config.train, plan.mesh_shape)]),
      'Per device (compiled memory analysis):',
      f'  parameters          {_gib(plan.params_bytes)}',
      f'  optimizer state     {_gib(plan.opt_state_bytes)} ({config.train.optimizer})',
      *([f'  parameter average   {_gib(plan.ema_bytes)} (train.ema_decay)'] if plan.ema_bytes else []),
      *([f'  frozen reference    {_gib(plan.reference_bytes)} (train.objective=dpo)'] if plan.reference_bytes else []),
      f'  temporaries         {_gib(plan.temp_bytes)}',
      f'  inputs {_gib(plan.argument_bytes)}, outputs {_gib(plan.output_bytes)}, of which donated and reused '
      f'{_gib(plan.alias_bytes)}; code {_gib(plan.code_bytes)}',
      f'  total               {_gib(plan.total_bytes)}',
  ]
  if plan.traced is not None:
    gaps = flops.describe_gaps(plan.traced)
    lines.append(f'FLOPs per step: {plan.traced.flops:.4g} (every matmul and convolution of the traced forward and '
                 f'backward, causal attention in full; trainer/observe/flops.py){f"; {gaps}" if gaps else ""}')
  if plan.flops is not None:
    lines.append(
        f'{"  Analytic" if plan.traced else "FLOPs per step"}: {plan.flops.matmul:.4g} (matmul count, causal '
        f'attention halved; MaxText), {plan.flops.six_n:.4g} (6N + 12*layers*heads*head_dim*seq_len per token; '
        f'nanoGPT) with N = {_six_n_params(plan.flops)}')
  step_flops = plan.traced.flops if plan.traced else plan.flops.matmul if plan.flops else 0
  if not step_flops:
    lines.append(f'FLOPs per step: not counted for model.name={config.model.name!r} (its step does not trace '
                 f'without a mesh, or has no matmuls).')
    return '\n'.join(lines)
  mode = config.train.get('quantization')
  if mode and plan.traced is not None:
    lines.append(f'train.quantization={mode!r}: {plan.traced.quantized:.4g} of these FLOPs '
                 f'({plan.traced.quantized / plan.traced.flops:.1%}) in {mode} dots, the rest in train.compute_dtype; '
                 f'on a chip with {mode} matrix units they run at twice the bf16 peak.')
  lines.append(f'Step time implied by {"these" if plan.traced else "the matmul"} FLOPs on {devices} '
               f'chip{"s" if devices != 1 else ""} of each kind (a compute-bound lower bound, and at '
               f'{ASSUMED_MFU:.0%} MFU):')
  for name, peak in flops.PEAK_FLOPS.items():
    ideal = step_flops / (devices * peak)
    lines.append(f'  {name:5s} {peak / 1e12:5.0f} TFLOP/s bf16: {_duration(ideal):>10s} at 100% MFU, '
                 f'{_duration(ideal / ASSUMED_MFU):>10s} ({tokens / ideal * ASSUMED_MFU:,.0f} tokens/s) '
                 f'at {ASSUMED_MFU:.0%}')
    if plan.traced is not None and flops.quantized_peak_flops(mode, name):
      fast = flops.ideal_seconds(plan.traced, peak, mode, name) / devices
      lines.append(f'  {"":5s} {mode:>4s} layer matmuls at {flops.quantized_peak_flops(mode, name) / 1e12:,.0f} '
                   f'TFLOP/s: {_duration(fast):>10s} at 100% MFU, {_duration(fast / ASSUMED_MFU):>10s} '
                   f'({tokens / fast * ASSUMED_MFU:,.0f} tokens/s) at {ASSUMED_MFU:.0%}')
  return '\n'.join(lines)


def _candidates(config, mesh_shape: dict[str, int], budget: int | None = None) -> list[tuple[str, dict[str, object]]]:
  """Config changes that lower per-device memory, each as (flags, overrides)."""
  out = []
  if config.train.remat_policy != 'full' and remat.policies(config.model.name) is not None:  # Only where it applies.
    out.append({'train.remat_policy': 'full'})
  data, fsdp = mesh_shape['data'], mesh_shape['fsdp']
  chunks = measure.loss_chunks_worth_trying(config, mesh_shape, budget)
  if chunks:
    out.append({'train.loss_chunks': chunks})
  if data % 2 == 0:
    out.append(_from_data(config, mesh_shape, 'fsdp'))
  experts, expert = config.model.get('num_experts', 0), mesh_shape.get('expert', 1)
  if experts and data % 2 == 0 and experts % (expert * 2) == 0:  # Each device holds half as many experts.
    out.append({'mesh.expert': config.mesh.expert * 2, 'mesh.data': -1})
  per_device_batch = config.train.batch_size // (data * fsdp * expert)
  if per_device_batch % (config.train.grad_accum_steps * 2) == 0:
    out.append({'train.grad_accum_steps': config.train.grad_accum_steps * 2})
  together = {k: v for o in out for k, v in o.items()}  # Every change above: they keep the global batch.
  if pipeline_checks.can_double(config, mesh_shape):  # Each device holds half the layers (and adds a bubble).
    out.append(_from_data(config, mesh_shape, 'pipeline'))
  if config.train.batch_size % 2 == 0:  # Last: this one changes the training, not only its layout.
    out.append({'train.batch_size': config.train.batch_size // 2})
  if len(together) > 1 and len(out) > 2:
    out.append(together)
  return [(' '.join(f'--config.{k}={v}' for k, v in o.items()), o) for o in out]


def _from_data(config, mesh_shape: dict[str, int], axis: str) -> dict[str, object]:
  """Overrides doubling `axis` by halving the data axis: within a slice, or between slices (mesh.dcn_*) where the
  data axis is split over slices and not within one (two slices with mesh.data=1: an ICI fsdp of twice the slice's
  chips cannot be built, a dcn_fsdp or dcn_pipeline of 2 can)."""
  dcn = config.mesh.get('dcn_data', 1)
  if dcn % 2 == 0 and (mesh_shape['data'] // dcn) % 2:
    return {f'mesh.dcn_{axis}': config.mesh.get(f'dcn_{axis}', 1) * 2, 'mesh.dcn_data': dcn // 2}
  return {f'mesh.{axis}': config.mesh.get(axis, 1) * 2, 'mesh.data': -1}


def fixes(config, mesh_shape: dict[str, int], budget: int, devices=None, print_fn=print) -> str:
  """Compiles each memory-lowering change of `config`; the sentence naming those that fit in `budget` bytes."""
  fitting = []
  for flags_text, overrides in _candidates(config, mesh_shape, budget):
    try:
      total, refused = total_or_refused(with_overrides(config, overrides), devices)
    except UserError as e:
      print_fn(f'  {flags_text}: not possible here ({e})')
      continue
    if refused:
      print_fn(f'  {flags_text}: over {_gib(total)} per device (the compiler refused it)')
      continue
    print_fn(f'  {flags_text}: {_gib(total)} per device{" (fits)" if total <= budget else ""}')
    if total <= budget:
      fitting.append(f'{flags_text} ({_gib(total)})')
  return (f'Changes that fit: {"; ".join(fitting)}.' if fitting else
          'None of remat, a chunked loss, more fsdp, accumulation or a smaller batch fits, alone or together; '
          'a smaller model or more devices is needed.')


def _limit(config, memory_gb: float | None, devices) -> footprint.Limit:
  """--plan_memory_gb, else the --topology chip's HBM, else what the run's pre-flight check would use."""
  if memory_gb is not None:
    return footprint.Limit(int(memory_gb * GIB), f'--plan_memory_gb={memory_gb:g}')
  if devices and devices[0].platform == 'gpu' and config.train.device_memory_gb is None:
    return gpu_targets.memory_limit(devices[0])
  chip = flops.accelerator_name(devices[0]) if devices else None
  if chip in HBM_GIB and config.train.device_memory_gb is None:
    return footprint.Limit(HBM_GIB[chip] * GIB, f'the HBM of one {chip} chip')
  return footprint.device_limit(config.train.device_memory_gb, devices or jax.devices())


def run(config, memory_gb: float | None = None, topology: str | None = None, print_fn=print) -> Plan | None:
  """Plans `config`; raises UserError naming the changes that fit when the plan exceeds the memory budget.

  Returns None when the compiler refused the step and no budget was given to judge it by (cannot happen
  with --topology, whose chips have a known HBM).
  """
  with _console_without_attention_line():
    return _run(config, memory_gb, topology, print_fn)


class _AttentionInReport(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith('Attention kernel')


@contextlib.contextmanager
def _console_without_attention_line():
  """The report's 'Attention:' line says the kernel choice; its log line on the console would say it twice."""
  handler, dropped = absl_logging.get_absl_handler(), _AttentionInReport()
  handler.addFilter(dropped)
  try:
    yield
  finally:
    handler.removeFilter(dropped)


def _run(config, memory_gb, topology, print_fn) -> Plan | None:
  devices = None
  config = hf_load.configure(config)  # model.init_from: the imported model's shape, from config.json alone.
  if topology:
    devices = topology_devices(topology)
    if config.train.compute_dtype == 'auto':  # 'auto' looks at this machine's backend; the target is a TPU or GPU.
      config = with_overrides(config, {'train.compute_dtype': 'bfloat16'})
    call = attention.config_call(config.model, config.data, config.train.compute_dtype,
                                 jax.sharding.Mesh(devices[:1], ('device',)))
    if devices[0].platform == 'gpu' and call and attention.choose(call, config.model.attention).kernel == 'cudnn':
      gpu_targets.check_traceable(call)
  limit = _limit(config, memory_gb, devices)
  job = job_lib.build_job(config, devices, limit=limit, log_fn=print_fn)  # remat 'auto' says its choice, once.
  config = job.config  # As resolved: the report and the fixes start from what was built.
  try:
    plan = measure.plan_of(job)
  except Refused as e:
    print_fn(f'The compiler refused the step: {e}')
    needed, mesh_shape, plan = e.needed_bytes, e.mesh_shape, None
    limit = footprint.Limit(min(limit.bytes or e.available_bytes, e.available_bytes), limit.source)
  else:
    print_fn(report(plan, config, topology))
    needed, mesh_shape = plan.total_bytes, plan.mesh_shape
  if limit.bytes is None:
    return plan
  print_fn(footprint.verdict(needed, limit) if plan else
           f'Does not fit: more than {_gib(needed)} per device, over the {_gib(limit.bytes)} available '
           f'({limit.source}).')
  if plan is not None and needed <= limit.bytes:
    return plan
  print_fn('Trying changes that use less memory:')
  advice = fixes(config, mesh_shape, limit.bytes, devices, print_fn)
  needs = _gib(needed) if plan else f'more than {_gib(needed)} (the compiler\'s figure for temporaries alone)'
  raise UserError(f'the plan needs {needs} per device, over the budget of {_gib(limit.bytes)} ({limit.source}). '
                  f'{advice}')
