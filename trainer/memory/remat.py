"""`train.remat_policy='auto'`: the least recomputation whose compiled step fits, else the fewest microbatches.

`resolve(config, devices, measure_fn=...)` turns 'auto' into a concrete policy
(and maybe a larger `train.grad_accum_steps`) as the first part of building the
Job (trainer/run/job.py: build_job), so the model builders never see 'auto'. The Job
builder hands in `measure_fn`, which builds a candidate's Job and compiles it ahead
of time (trainer/memory/measure.py, the measurement plan mode reports; the
persistent compilation cache, when on, keeps them): this module never builds a
Job itself.

Where one device's float32 logits are a large part of the memory (the built-in
Llama, `train.loss_chunks` left at 1: measure.loss_chunks_worth_trying), each
policy is also tried with the loss computed in slices of positions: a chunked
loss costs one more head matmul per token, recomputation costs a block's forward,
so a faster policy with a chunked loss is preferred to a slower one without it.

Order, least recomputed first. Basis: the matmul FLOPs per token and layer the
backward pass redoes of a Llama block's forward (multi-head, L tokens, width d,
MLP width f; the forward is 8d^2 + 4Ld + 6df):
  none                              0
  dots_saveable                     0 (elementwise ops only: every matmul output is kept)
  dots_with_no_batch_dims_saveable  4Ld (the attention core; weight matmuls have no batch dims and are kept)
  save_qkv_proj                     4Ld + 2d^2 + 4df (core, out projection for the residual, MLP up/gate)
  save_attention_and_mlp_hidden     2Ld + 8d^2 + 4df (the above plus q/k/v, minus P V; past L = 3d it
                                    would move below save_qkv_proj, a length no preset trains at)
  full                              8d^2 + 4Ld + 6df (everything)
The H100 measurements of issue 14 (llama_1b, batch 16) agree where they exist:
full 45.5% MFU, save_qkv_proj 46.2%, dots_with_no_batch_dims_saveable 50.1%;
dots_saveable and save_attention_and_mlp_hidden were not measured.
A fit needs footprint.MARGIN free, the margin under which the pre-flight check warns.
"""

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence

import jax
from absl import logging

from parallel import mesh as mesh_lib
from trainer.base.errors import UserError
from trainer.memory import footprint, measure
from trainer.models import checkpoint_policies
from trainer.training import checkpoint

RECOMPUTE_ORDER = ('none', 'dots_saveable', 'dots_with_no_batch_dims_saveable', 'save_qkv_proj',
                   'save_attention_and_mlp_hidden', 'full')
# Config values that change the compiled step's memory: a resumed run re-chooses when any of them changed.
_MEMORY_KEYS = ('model', 'mesh', 'parallel', 'data.seq_len', 'data.image_shape', 'data.packing',
                'data.max_documents_per_row', 'train.batch_size', 'train.loss_chunks',
                'train.remat_policy', 'train.grad_accum_steps', 'train.compute_dtype', 'train.param_dtype',
                'train.adam_mu_dtype', 'train.device_memory_gb')


@dataclasses.dataclass(frozen=True)
class Choice:
  """What 'auto' resolved to, and why; `summary` is '' when the config named a policy itself."""
  remat_policy: str
  grad_accum_steps: int
  needed_bytes: int | None  # The chosen step's per-device bytes; None when nothing was compiled.
  summary: str
  fingerprint: str = ''  # Of the requested config, devices and limit: a resumed run reuses a matching choice.
  loss_chunks: int = 1  # train.loss_chunks chosen with the policy (1 = the whole logits at once).

  def record(self) -> dict:
    """For the run manifest (manifest.run_manifest's 'memory' entry)."""
    return dataclasses.asdict(self)


def checkpoint_policy(name: str):
  """The `jax.checkpoint` policy for a train.remat_policy name a brought model was given (not 'none').

  A brought model's builder may be handed `remat_policy=` (docs/bring_your_own_model.md); this is what to give
  `nn.remat` / `nnx.remat` / `jax.checkpoint` for it.
  """
  if name not in checkpoint_policies.GENERIC:
    raise UserError(f'train.remat_policy={name!r}: a model of your own takes one of none, '
                    f'{", ".join(checkpoint_policies.GENERIC)}.')
  return checkpoint_policies.GENERIC[name]


def policies(model_name: str) -> tuple[str, ...] | None:
  """The remat policies a model takes, least recomputation first; None for a brought model taking none."""
  if model_name == 'llama':
    from trainer.models import llama
    known = llama.REMAT_POLICIES
  elif model_name == 'vit':
    from trainer.models import vit
    known = vit.REMAT_POLICIES
  else:
    from trainer.models import adapters, registry
    if not adapters.takes_keyword(registry.resolve(model_name), 'remat_policy'):
      return None
    known = checkpoint_policies.GENERIC
  return tuple(p for p in RECOMPUTE_ORDER if p == 'none' or p in known)


def fingerprint(config, devices: Sequence[jax.Device], limit: footprint.Limit) -> str:
  values = {k: config[k.split('.')[0]][k.split('.')[1]] if '.' in k else config[k].to_dict() for k in _MEMORY_KEYS}
  values.update(devices=len(devices), kind=devices[0].device_kind, limit=limit.bytes)
  if config.train.get('quantization'):  # Quantized dots change the step's memory; unset, the fingerprints of old runs.
    values['train.quantization'] = config.train.quantization
  return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]


def previous_choice(workdir: str | None) -> dict | None:
  """The 'memory' entry of the newest readable checkpoint manifest in `workdir` (read-only), if any."""
  newest = checkpoint.newest_manifest(workdir) if workdir else None
  return newest[1].get('memory') if newest else None


# Per-device bytes of compiled candidates, by (config, devices): a process resolving twice (plan mode's fixes,
# tests) compiles each candidate once. A refusal by the compiler is stored as -(its lower bound + 1).
_MEASURED: dict[tuple[str, tuple[int, ...]], int] = {}


# A candidate's (per-device bytes of its compiled step, whether the compiler refused it): the Job builder's.
Measure = Callable[..., tuple[int, object]]


def step_bytes(config, devices: Sequence[jax.Device], measure_fn: Measure) -> tuple[int, bool]:
  """(per-device bytes of `config`'s compiled step, whether the compiler refused it); UserError if impossible."""
  key = (config.to_json_best_effort(sort_keys=True), tuple(d.id for d in devices))
  if key not in _MEASURED:
    total, refused = measure_fn(config, devices)
    _MEASURED[key] = -(total + 1) if refused else total
  value = _MEASURED[key]
  return (-value - 1, True) if value < 0 else (value, False)


def _with(config, policy: str, accum: int, chunks: int | None = None):
  return measure.with_overrides(config, {'train.remat_policy': policy, 'train.grad_accum_steps': accum,
                                         'train.loss_chunks': chunks or config.train.loss_chunks})


def resolve(config, devices: Sequence[jax.Device] | None = None, limit: footprint.Limit | None = None,
            workdir: str | None = None, log_fn: Callable[[str], None] = logging.info,
            measure_fn: Measure | None = None):
  """(config with 'auto' replaced by a concrete policy and accumulation, Choice); other configs pass unchanged.

  `measure_fn(candidate_config, devices)` compiles a candidate (trainer/run/job.py passes its own); only a search
  calls it, not a choice read back from `workdir` or one made without a memory limit.
  """
  t = config.train
  if t.remat_policy != 'auto':
    return config, Choice(t.remat_policy, t.grad_accum_steps, None, '')
  devices = list(devices or jax.devices())
  limit = limit or footprint.device_limit(t.device_memory_gb, devices)
  order = policies(config.model.name)
  key = fingerprint(config, devices, limit)
  if order is None or limit.bytes is None:
    why = (f'model.name={config.model.name!r} takes no remat policy' if order is None else limit.source)
    choice = Choice('none', t.grad_accum_steps, None, f"remat 'auto': 'none' ({why}).", key, t.loss_chunks)
  else:
    saved = previous_choice(workdir)
    if saved and saved.get('fingerprint') == key:
      choice = Choice(**{'loss_chunks': t.loss_chunks, **saved,
                         'summary': f"remat 'auto': {saved['remat_policy']!r} with grad_accum_steps="
                                    f"{saved['grad_accum_steps']}, as chosen when this run started "
                                    f"(its config, devices and memory are unchanged)."})
    else:
      choice = _search(config, devices, limit, order, key, measure_fn)
  log_fn(choice.summary)
  return _with(config, choice.remat_policy, choice.grad_accum_steps, choice.loss_chunks), choice


def _search(config, devices, limit: footprint.Limit, order: tuple[str, ...], key: str, measure_fn: Measure) -> Choice:
  """Compiles candidates: per accumulation (configured first), 'full' as the least-memory probe, then by order."""
  mesh = mesh_lib.build_mesh(config.mesh, devices)
  per_device = config.train.batch_size // mesh_lib.data_parallel_size(mesh)
  first = config.train.grad_accum_steps
  accums = [first] + [a for a in range(first + 1, per_device + 1) if per_device % a == 0]
  budget = int(limit.bytes * (1 - footprint.MARGIN))
  chunked = measure.loss_chunks_worth_trying(config, dict(mesh.shape), budget)
  chunk_options = [config.train.loss_chunks] + ([chunked] if chunked else [])
  tried: dict[tuple[str, int, int], int | None] = {}

  def need(policy, accum, chunks):
    if (policy, accum, chunks) not in tried:
      try:
        total, refused = step_bytes(_with(config, policy, accum, chunks), devices, measure_fn)
      except UserError:  # This accumulation or policy is not possible here (validation says why).
        total, refused = None, False
      tried[policy, accum, chunks] = max(total, limit.bytes + 1) if refused else total
    return tried[policy, accum, chunks]

  for accum in accums:
    probe = need(order[-1], accum, chunk_options[-1])
    if probe is None or probe > budget:
      continue
    for policy in order:
      for chunks in chunk_options:
        total = need(policy, accum, chunks)
        if total is not None and total <= budget:
          return Choice(policy, accum, total, _summary((policy, accum, chunks), total, limit, tried, budget), key,
                        chunks)
  return Choice(order[-1], first, tried.get((order[-1], first, chunk_options[-1])),
                _summary(None, None, limit, tried, budget), key, chunk_options[-1])


def _summary(chosen, total, limit, tried, budget) -> str:
  def name(p, a, c):
    return f'{p}{f" x{a} microbatches" if a > 1 else ""}{f" with loss_chunks={c}" if c > 1 else ""}'
  rejected = ', '.join(f'{name(*k)} ({footprint.gib(b)})' for k, b in tried.items() if b is not None and b > budget)
  not_fitting = f'; did not fit with {footprint.MARGIN:.0%} free: {rejected}' if rejected else ''
  if chosen is None:
    return (f"remat 'auto': no policy fits in {footprint.gib(limit.bytes)} ({limit.source}) at any accumulation"
            f"{not_fitting}; trying 'full'.")
  policy, accum, chunks = chosen
  return (f"remat 'auto': {policy!r} with grad_accum_steps={accum}"
          f"{f' and train.loss_chunks={chunks} (the logits in slices)' if chunks > 1 else ''}, "
          f"{footprint.gib(total)} of {footprint.gib(limit.bytes)} per device ({limit.source}){not_fitting}.")
