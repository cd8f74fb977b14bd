"""The type and range (or choices) of every key configs/base.py declares: one table, checked before anything starts.

launch.py checks a loaded config against SCHEMA right after its keys (config_keys.py), before the supervisor,
the workdir or jax: a value no run can use (`train.steps=10**20`, `learning_rate=inf`, `log.wandb_mode='sometimes'`)
ends the launch in one line naming every such key, exit 2, rather than a traceback minutes in (tensorboardX's hparams
on a step count past int64, a learning rate that is nan by step 2) retried as a crash. The run's own checks
(trainer/training/validation.py) call `check` again on the config a model.init_from's config.json changed.

What one key cannot say (a divisor, a key that only counts beside another) stays with the module that reads it;
this table holds each key alone, and PRODUCTS the sizes whose product makes an array: an int64 extent (XLA aborts
the process on one that overflows) and, for a parameter, a sane memory. tests/test_config_schema.py fails when a
key declared in configs/base.py has no row here, and when a row's choices differ from those of the module that
reads the key.
"""

import dataclasses
import math
import re
from typing import Any, Callable

from trainer.base.errors import UserError

INT32_MAX = 2**31 - 1  # Step counters are int32 in jax; tensorboardX and jnp arrays take every count below it.
PARAM_ELEMENTS_MAX = 2**42  # One tensor of 4.4e12 elements, 17.6 TB in float32: 16x the largest published tensor.
FLOAT32_MAX = 3.4028234663852886e38  # A larger learning rate or weight is inf in the step: nan by step 2.
EXTENT_MAX = 2**61  # Elements of one array whose bytes (up to 4 a float32 element) still fit an int64.


@dataclasses.dataclass(frozen=True)
class Check:
  expected: str  # What the value must be, as the one line says it: 'an integer >= 1 and <= 2147483647'.
  accepts: Callable[[Any], bool]


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def integer(low: int = 0, high: int = INT32_MAX) -> Check:
  return Check(f'an integer >= {low} and <= {high}', lambda v: _is_int(v) and low <= v <= high)


def number(low: float = 0, high: float = FLOAT32_MAX, low_open: bool = False, high_open: bool = False) -> Check:
  """An int or float in the interval; without a `high`, any that float32 (the step's arithmetic) holds."""
  if high == FLOAT32_MAX:
    expected = f'a number {">" if low_open else ">="} {low:g} and <= {high:.3g}'
  else:
    expected = f'in {"(" if low_open else "["}{low:g}, {high:g}{")" if high_open else "]"}'
  return Check(expected, lambda v: _is_number(v) and (low < v if low_open else low <= v)
               and (v < high if high_open else v <= high))


def one_of(*choices) -> Check:
  # Compared with their type: True == 1, but a flag given 1 is a typo for a count or the other way round.
  return Check(f'one of {", ".join(map(repr, choices))}',
               lambda v: any(type(v) is type(c) and v == c for c in choices))


def either(*checks: Check) -> Check:
  return Check(' or '.join(c.expected for c in checks), lambda v: any(c.accepts(v) for c in checks))


def optional(check: Check) -> Check:
  return Check(f'None or {check.expected}', lambda v: v is None or check.accepts(v))


def sequence(item: Check, length: int | None = None) -> Check:
  size = f'{length} ' if length is not None else ''
  return Check(f'a tuple of {size}items each {item.expected}',
               lambda v: isinstance(v, (tuple, list)) and (length is None or len(v) == length)
               and all(item.accepts(x) for x in v))


def pair(first: Check, second: Check) -> Check:
  return Check(f'({first.expected}, {second.expected})',
               lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and first.accepts(v[0])
               and second.accepts(v[1]))


def _compiles(pattern) -> bool:
  try:
    re.compile(pattern)
  except (re.error, TypeError):
    return False
  return True


BOOL = one_of(True, False)
TEXT = Check('a non-empty string', lambda v: isinstance(v, str) and bool(v.strip()))
ANY = Check('any value', lambda v: True)
REGEX = Check('a regular expression', lambda v: isinstance(v, str) and _compiles(v))
COUNT = integer(1)  # At least one.
COUNT_OR_OFF = integer(0)  # 0 switches the thing off, or means 'the default' (the key's comment says which).
FRACTION = number(0, 1, high_open=True)
NON_NEGATIVE = number(0)
POSITIVE = number(0, low_open=True)
DTYPES = ('float32', 'bfloat16')
MESH_AXIS = either(one_of(-1), COUNT)
AXIS_RULE = pair(TEXT, either(one_of(None), TEXT, sequence(TEXT)))

SCHEMA: dict[str, Check] = {
    'train.steps': COUNT, 'train.batch_size': COUNT, 'train.seed': COUNT_OR_OFF,
    'train.learning_rate': POSITIVE, 'train.warmup_steps': COUNT_OR_OFF,
    'train.end_learning_rate_ratio': number(0, 1), 'train.weight_decay': NON_NEGATIVE,
    'train.adam_b1': FRACTION, 'train.adam_b2': FRACTION,
    'train.optimizer': one_of('adamw', 'adafactor', 'lion', 'muon', 'sgd'),
    'train.schedule': one_of('cosine', 'linear', 'constant', 'wsd', 'rsqrt'),
    'train.decay_fraction': number(0, 1, low_open=True), 'train.decay_shape': one_of('linear', '1-sqrt'),
    'train.weight_decay_exclude': sequence(REGEX),
    'train.adafactor_min_dim_size_to_factor': COUNT_OR_OFF,
    'train.adafactor_decay_rate': number(0, 1, low_open=True),
    'train.lion_b1': number(0, 1), 'train.lion_b2': FRACTION,
    'train.muon_beta': FRACTION, 'train.muon_ns_steps': integer(1, 1000), 'train.muon_consistent_rms': POSITIVE,
    'train.sgd_momentum': FRACTION, 'train.sgd_nesterov': BOOL, 'train.ema_decay': FRACTION,
    'train.grad_clip_norm': NON_NEGATIVE, 'train.compute_dtype': one_of('auto', *DTYPES),
    'train.param_dtype': one_of(*DTYPES), 'train.quantization': optional(one_of('fp8', 'int8')),
    'train.remat_policy': one_of('auto', 'none', 'full', 'dots_saveable', 'dots_with_no_batch_dims_saveable',
                                 'save_qkv_proj', 'save_attention_and_mlp_hidden'),
    'train.adam_mu_dtype': one_of(*DTYPES), 'train.device_memory_gb': optional(POSITIVE),
    'train.pipeline_microbatches': COUNT_OR_OFF, 'train.pipeline_repeats': COUNT,
    'train.grad_accum_steps': COUNT, 'train.loss_chunks': COUNT, 'train.z_loss_weight': NON_NEGATIVE,
    'train.objective': one_of('task', 'dpo'), 'train.dpo_beta': POSITIVE,
    'train.dpo_label_smoothing': number(0, 0.5, high_open=True),
    'train.compilation_cache_dir': optional(TEXT),
    'train.eval_every_steps': COUNT_OR_OFF, 'train.eval_batches': COUNT_OR_OFF,
    'train.hang_timeout_s': optional(NON_NEGATIVE), 'train.straggler_warn_fraction': POSITIVE,
    'train.preemption_signals': sequence(TEXT),  # Which names: trainer/supervision/settings.py, with the fix.
    'train.preemption_notice_file': optional(TEXT), 'train.accept_schedule_change': BOOL,
    'train.on_nonfinite': one_of('stop', 'skip', 'rollback'),

    **{f'mesh.{axis}': MESH_AXIS for axis in ('data', 'fsdp', 'pipeline', 'expert', 'context', 'tensor',
                                               'dcn_data', 'dcn_fsdp', 'dcn_pipeline')},

    'parallel.strategy': one_of('jit', 'shard_map', 'pmap'),
    'parallel.logical_axis_rules': sequence(AXIS_RULE), 'parallel.extra_axis_rules': sequence(AXIS_RULE),
    'parallel.unnamed_params': one_of('auto', 'replicate', 'error'),

    'ckpt.every_steps': COUNT, 'ckpt.max_to_keep': COUNT, 'ckpt.keep_period': COUNT_OR_OFF,
    'ckpt.storage_deadline_s': POSITIVE, 'ckpt.async_save': BOOL,
    'ckpt.local_dir': optional(TEXT), 'ckpt.local_every_steps': COUNT,

    'log.every_steps': COUNT, 'log.idle_expert_steps': COUNT_OR_OFF, 'log.progress_bar': one_of('auto', 'on', 'off'),
    'log.trackers': sequence(one_of('wandb', 'mlflow')), 'log.run_name': optional(TEXT),
    'log.wandb_project': TEXT, 'log.wandb_mode': one_of('online', 'offline'),
    'log.mlflow_tracking_uri': optional(TEXT), 'log.mlflow_experiment': TEXT,
    'log.tracker_close_timeout_s': NON_NEGATIVE,

    'eval.tasks': sequence(TEXT), 'eval.every_steps': COUNT_OR_OFF, 'eval.max_questions': COUNT_OR_OFF,

    'profile.trace_window': BOOL, 'profile.start_step': COUNT_OR_OFF, 'profile.num_steps': COUNT,
    'profile.server_port': integer(0, 65535), 'profile.memory_on_oom': BOOL,

    'data.source': one_of('text', 'array_record', 'mixture', 'arrays', 'synthetic'),
    'data.text_dir': optional(TEXT), 'data.path': optional(TEXT),
    'data.mixture': sequence(pair(TEXT, NON_NEGATIVE)),
    'data.mixture_stages': sequence(pair(COUNT_OR_OFF, sequence(NON_NEGATIVE))),
    'data.packing': BOOL, 'data.packed_positions': one_of('document', 'row'),
    'data.max_documents_per_row': COUNT, 'data.loss_mask': BOOL, 'data.worker_count': integer(0, 4096),
    'data.prefetch': COUNT_OR_OFF, 'data.file_glob': TEXT, 'data.eval_percent': number(0, 100, high_open=True),
    'data.seq_len': COUNT, 'data.num_threads': integer(1, 4096), 'data.prefetch_buffer_size': COUNT_OR_OFF,
    'data.image_shape': sequence(COUNT, length=3),

    'model.name': TEXT, 'model.task': one_of('lm', 'classifier'),
    'model.num_layers': COUNT, 'model.d_model': COUNT, 'model.num_heads': COUNT, 'model.head_dim': COUNT_OR_OFF,
    'model.mlp_dim': COUNT, 'model.vocab_size': COUNT, 'model.rope_max_wavelength': POSITIVE,
    'model.norm_eps': number(0, 1, low_open=True, high_open=True), 'model.init_from': optional(TEXT),
    'model.rope_scaling': one_of('none', 'llama3'), 'model.rope_scaling_factor': POSITIVE,
    'model.rope_low_freq_factor': POSITIVE, 'model.rope_high_freq_factor': POSITIVE,
    'model.rope_original_max_positions': COUNT,
    'model.qkv_bias': BOOL, 'model.qk_norm': BOOL, 'model.num_kv_heads': COUNT_OR_OFF, 'model.tie_embeddings': BOOL,
    'model.num_classes': COUNT, 'model.patch_size': COUNT, 'model.scan_layers': one_of(True, False, 'auto'),
    'model.attention': one_of('auto', 'xla', 'cudnn', 'splash'),
    'model.context_scheme': one_of('auto', 'all-gather', 'ring'), 'model.check_alignment': BOOL,
    'model.call_kwargs': sequence(pair(TEXT, ANY)), 'model.eval_call_kwargs': sequence(pair(TEXT, ANY)),
    'model.packed_kwarg_names': sequence(TEXT, length=2), 'model.unshifted_inputs': BOOL,
    'model.num_experts': COUNT_OR_OFF, 'model.experts_per_token': COUNT,
    'model.moe_layers': either(one_of('all'), COUNT), 'model.shared_expert': BOOL,
    'model.expert_mlp_dim': COUNT_OR_OFF, 'model.expert_capacity_factor': optional(NON_NEGATIVE),
    'model.expert_exchange': one_of('auto', 'padded', 'ragged'), 'model.expert_buffer_factor': optional(NON_NEGATIVE),
    'model.router_aux_loss_weight': NON_NEGATIVE, 'model.router_z_loss_weight': NON_NEGATIVE,
    'model.router_bias_rate': NON_NEGATIVE,
    'model.lora_rank': COUNT_OR_OFF, 'model.lora_targets': either(TEXT, sequence(TEXT)), 'model.lora_alpha': POSITIVE,
}

# (what the product sizes, its keys, the most elements). A key of 0 ('= another key', as model.head_dim) stands for
# 1; the row naming the key it defaults to covers that case.
PRODUCTS = (
    ('the embedding table', ('model.vocab_size', 'model.d_model'), PARAM_ELEMENTS_MAX),
    ("the stacked layers' MLP weights", ('model.num_layers', 'model.d_model', 'model.mlp_dim'), PARAM_ELEMENTS_MAX),
    ("the stacked layers' attention weights", ('model.num_layers', 'model.d_model', 'model.d_model'),
     PARAM_ELEMENTS_MAX),
    ("the stacked layers' query weights", ('model.num_layers', 'model.d_model', 'model.num_heads', 'model.head_dim'),
     PARAM_ELEMENTS_MAX),
    ("the stacked experts' weights", ('model.num_layers', 'model.num_experts', 'model.d_model', 'model.mlp_dim'),
     PARAM_ELEMENTS_MAX),
    ("the stacked experts' weights", ('model.num_layers', 'model.num_experts', 'model.d_model',
                                      'model.expert_mlp_dim'), PARAM_ELEMENTS_MAX),
    ("a batch's logits", ('train.batch_size', 'data.seq_len', 'model.vocab_size'), EXTENT_MAX),
    ("a batch's MLP activations", ('train.batch_size', 'data.seq_len', 'model.mlp_dim'), EXTENT_MAX),
    ("the run's tokens", ('train.steps', 'train.batch_size', 'data.seq_len'), EXTENT_MAX),
)


def _get(config, path: str):
  section, key = path.split('.')
  return config[section][key] if section in config and key in config[section] else None


def shown(value) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + '...'


def oversized(values: dict, name=lambda path: path) -> list[str]:
  """One phrase per row of PRODUCTS whose keys all have values (path -> value) and multiply past its most; `name`
  says a path as the user knows it (a config.json field)."""
  found = []
  for what, paths, most in PRODUCTS:
    sizes = [values.get(p) for p in paths]
    if any(v is None for v in sizes):
      continue
    product = math.prod(v or 1 for v in sizes)
    if product > most:
      found.append(f'{" x ".join(f"{name(p)}={v}" for p, v in zip(paths, sizes))} makes {what} {product:.3g} '
                   f'elements, more than {most:.3g}: lower one of them')
  return found


def problems(config) -> list[str]:
  """One phrase per key of `config` outside its row, then per product too large; keys a config lacks are skipped
  (a run's config.json from before the key)."""
  found = []
  for path, check in SCHEMA.items():
    section, key = path.split('.')
    if section in config and key in config[section] and not check.accepts(config[section][key]):
      found.append(f'{path}={shown(config[section][key])} must be {check.expected}')
  if found:  # A product of values already refused says nothing more.
    return found
  return oversized({path: _get(config, path) for _, paths, _ in PRODUCTS for path in paths})


def check(config) -> None:
  """Raises a UserError with one line naming every key outside its row (SCHEMA) and every product too large."""
  found = problems(config)
  if found:
    raise UserError(f'{"; ".join(found)}.')
