"""What a checkpoint records about the run that made it, and what a resume may change.

The manifest (saved with every checkpoint as `manifest`) holds the resolved config, parameter shapes, versions, XLA
flags, mesh, strategy and git commit. On resume it is compared with the launching run's: another model, optimizer,
parameter average or objective is refused in one line before anything is compiled or restored (`check_same_model`),
a learning-rate jump at the resume step needs consent (`check_schedule`), and every other difference is logged
(`safe_differences`). `check_resume` is the one rule both checkpoint tiers go through: the persistent tier's
(trainer/training/checkpoint.py) and the local tier's (trainer/training/local_tier.py, which saves the same record).
"""

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

from configs import base as base_config
from parallel import sharding
from trainer import attention
from trainer.base.errors import UserError
from trainer.models import quantization, router_bias

# Settings that change what a checkpoint means; any other difference is safe and only logged.
_UNSAFE_SECTIONS = ('model',)
# Model keys that change how the step computes, never the parameters: a run may resume under another value.
# init_from only seeds a fresh run (a resumed one never reads it), so a moved or re-exported folder is no other model.
_KERNEL_ONLY_KEYS = ('attention', 'context_scheme', 'init_from')
# Model keys a resume may change with a line (safe_differences), like a learning rate: the parameters keep their tree.
# router_bias_rate only sets how far each step moves a bias the parameters hold; turning it on or off adds or drops
# that bias, which _check_same_router_bias refuses.
_LOGGED_MODEL_KEYS = ('router_bias_rate',)


def param_shapes(params) -> dict[str, list[int]]:
  """{'block_0/mlp/up/kernel': [d, f], ...}: the shape signature of a parameter tree."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return {sharding.path_name(path): list(leaf.shape) for path, leaf in flat}


def _git_commit() -> str | None:
  repo = pathlib.Path(__file__).resolve().parents[2]
  try:
    out = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=repo, capture_output=True, text=True, timeout=5)
  except (OSError, subprocess.SubprocessError):
    return None
  return (out.stdout.strip() or None) if out.returncode == 0 else None


def run_manifest(config, abstract, mesh) -> dict[str, Any]:
  """What a checkpoint was made from; compared on resume (see `Checkpointer.check_compatible`)."""
  import flax, jaxlib, optax, grain as grain_lib  # noqa: E401  (versions only)
  return {
      'model': config.model.to_dict(),
      'param_shapes': param_shapes(abstract.params),
      'mesh': dict(mesh.shape),
      'device_count': mesh.size,
      'strategy': config.parallel.strategy,
      'attention': _attention_entry(config.model, config.data, config.train.compute_dtype, mesh),
      'process_count': jax.process_count(),
      'versions': {m.__name__: m.__version__ for m in (jax, jaxlib, flax, optax, ocp, grain_lib)},
      'xla_flags': os.environ.get('XLA_FLAGS', ''),
      'libtpu_init_args': os.environ.get('LIBTPU_INIT_ARGS', ''),
      'git_commit': _git_commit(),
      'config': json.loads(config.to_json_best_effort()),
  }


def _attention_entry(model, data, compute_dtype: str, mesh) -> dict[str, str]:
  """model.attention and, for the built-in models, the kernel it runs on this mesh and why."""
  choice = attention.check_config(model, data, compute_dtype, mesh)
  if choice is None:
    return {'setting': model.attention, 'kernel': 'chosen per call by the model'}
  return {'setting': choice.setting, 'kernel': choice.kernel, 'reason': choice.reason}


def _flat(tree: Any, prefix: str = '') -> dict[str, Any]:
  if isinstance(tree, dict):
    return {k: v for key, sub in tree.items() for k, v in _flat(sub, f'{prefix}{key}.').items()}
  return {prefix[:-1]: tree.tolist() if hasattr(tree, 'tolist') else tree}


def safe_differences(saved: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
  """Human-readable differences the resume tolerates: mesh, devices, strategy, schedule, versions, ..."""
  keys = ('mesh', 'device_count', 'strategy', 'versions', 'xla_flags', 'git_commit')
  logged = {f'config.model.{k}': getattr(base_config.get_config().model, k) for k in _LOGGED_MODEL_KEYS}
  # A logged model key newer than the checkpoint is its default there (the model it built), not a change.
  old = {**logged, **{k: saved.get(k) for k in keys}, **_flat(saved.get('config', {}), 'config.')}
  new = {**{k: manifest.get(k) for k in keys}, **_flat(manifest.get('config', {}), 'config.')}
  skip = tuple(f'config.{s}.' for s in _UNSAFE_SECTIONS)
  return [f'{k}: {old.get(k)!r} -> {new.get(k)!r}' for k in sorted(old.keys() | new.keys())
          if (k in logged or not k.startswith(skip)) and _normal(old.get(k)) != _normal(new.get(k))]


def check_schedule(step: int, saved: dict[str, Any], manifest: dict[str, Any]) -> None:
  """Refuses a resume whose changed train.* settings move the learning rate at the resume step, unless accepted."""
  saved_train, train = saved.get('config', {}).get('train'), manifest['config'].get('train')
  if not saved_train or not train or saved_train == train:
    return
  import ml_collections
  from trainer.training import optimizer
  config = ml_collections.ConfigDict(train)
  moved = optimizer.schedule_change(saved_train, config, step)
  if moved is None:
    return
  changed = ', '.join(f'train.{k} {saved_train.get(k)!r} -> {v!r}' for k, v in sorted(train.items())
                      if k in saved_train and saved_train[k] != v and k != 'accept_schedule_change')
  what = (f'{changed or "train.* settings"} since checkpoint {step}: the learning-rate schedule moves: at step '
          f'{step + 1} it becomes {moved[1]:.3g} instead of {moved[0]:.3g}')
  if config.get('accept_schedule_change', False):
    logging.warning('Resuming step %d: %s (accepted: train.accept_schedule_change=True).', step, what)
    return
  changed_keys = {k for k, v in train.items() if k in saved_train and saved_train[k] != v}
  if changed_keys == {'learning_rate'} and _given_on_command_line('train.learning_rate'):
    # What the non-finite stop advises ("lower train.learning_rate"): typed on the relaunch, it is the user's choice.
    logging.warning('Resuming step %d: %s; taken as deliberate, since --config.train.learning_rate was given on the '
                    'command line.', step, what)
    return
  raise UserError(f'{what}, a jump the run never had. Relaunch with --config.train.accept_schedule_change=True to '
                  f'take it, or with the checkpoint\'s values to keep the schedule it was trained on.')


def _given_on_command_line(key: str) -> bool:
  """Whether launch.py's command line set --config.KEY (this process's own flags: what the user typed)."""
  return any(arg.lstrip('-').startswith(f'config.{key}=') for arg in sys.argv[1:])


def _check_same_average(saved: dict[str, Any], manifest: dict[str, Any], workdir) -> None:
  """A parameter average is in the saved state or not: train.ema_decay may change its value, not turn it on or off."""
  before = saved.get('config', {}).get('train', {}).get('ema_decay', 0.0) or 0.0
  now = manifest.get('config', {}).get('train', {}).get('ema_decay', 0.0) or 0.0
  if bool(before) != bool(now):
    kept = 'keep a parameter average' if before else 'keep no parameter average'
    raise UserError(f'--workdir {workdir} was trained with train.ema_decay={before}, so its checkpoints '
                    f'{kept}; resume with --config.train.ema_decay={before if before else 0}'
                    f'{" (any value in (0, 1) works)" if before else ""}, or use a fresh --workdir for '
                    f'train.ema_decay={now}.')


def _check_same_objective(saved: dict[str, Any], manifest: dict[str, Any], workdir) -> None:
  """A DPO run's checkpoints hold its reference parameters, another run's none: train.objective stays as it was."""
  before, now = (m.get('config', {}).get('train', {}).get('objective', 'task') for m in (saved, manifest))
  if (before == 'dpo') != (now == 'dpo'):
    raise UserError(f'--workdir {workdir} was trained with train.objective={before!r}; resume with '
                    f'--config.train.objective={before}, or start train.objective={now!r} in a fresh --workdir '
                    f'(from an exported checkpoint: scripts/export_hf.py, then model.init_from=hf:FOLDER).')


def _check_same_optimizer(saved: dict[str, Any], manifest: dict[str, Any], workdir) -> None:
  """Another optimizer's state cannot be restored into this one's (a schedule change can, and is logged)."""
  # Checkpoints written before train.optimizer existed were AdamW's.
  before = saved.get('config', {}).get('train', {}).get('optimizer', 'adamw')
  now = manifest.get('config', {}).get('train', {}).get('optimizer', 'adamw')
  if before != now:
    raise UserError(f'--workdir {workdir} was trained with train.optimizer={before!r}, not {now!r}: resume '
                    f'with --config.train.optimizer={before}, or use a fresh --workdir to start with {now!r}.')


def _check_same_router_bias(saved: dict[str, Any], manifest: dict[str, Any], workdir) -> None:
  """The router bias is in the saved parameters or not: model.router_bias_rate may change its speed, not turn it on
  or off (the checkpoints could not be restored into the other tree, nor route as they were trained to)."""
  held = [any(name.rsplit('/', 1)[-1] == router_bias.PARAM for name in m['param_shapes']) for m in (saved, manifest)]
  if held[0] == held[1]:  # A dense or brought model keeps none, whatever the rate.
    return
  before, now = (float(m['model'].get('router_bias_rate', 0.0) or 0.0) for m in (saved, manifest))
  if held[0]:
    raise UserError(f'--workdir {workdir} was trained with model.router_bias_rate={before:g}, so its '
                    f'checkpoints hold the router bias its experts are chosen with; resume with a rate > 0 '
                    f'(--config.model.router_bias_rate={before:g}, or another to move the bias faster or slower), '
                    f'or use a fresh --workdir to train without it; nothing was changed.')
  raise UserError(f'--workdir {workdir} was trained with model.router_bias_rate={before:g}, so its '
                  f'checkpoints hold no router bias; resume with --config.model.router_bias_rate={before:g}, or use a '
                  f'fresh --workdir to train with model.router_bias_rate={now:g} from step 0; nothing was changed.')


def _normal(value):
  return list(value) if isinstance(value, tuple) else value


def _as_saved(value):
  """A config value as the manifest's JSON gives it back (tuples come back as lists)."""
  return json.loads(json.dumps(value))


def check_same_model(saved: dict[str, Any], manifest: dict[str, Any], directory, workdir) -> None:
  """Raises UserError when the checkpoint's manifest `saved` holds another model, optimizer, average or objective
  than `manifest` describes (the checkpoints in `directory`, of the run in `workdir`, could not be restored into
  it)."""
  # A key newer than the checkpoint (absent from its manifest) is what the key's default says: the model it built.
  defaults = base_config.get_config().model.to_dict()
  diffs = [f'model.{k}: checkpoint {saved["model"].get(k)!r} vs config {v!r}'
           for k, v in manifest['model'].items()
           if saved['model'].get(k, _as_saved(defaults.get(k))) != _as_saved(v)
           and k not in _KERNEL_ONLY_KEYS + _LOGGED_MODEL_KEYS]
  if not diffs:  # Before the shapes: it names the key that changes them.
    _check_same_router_bias(saved, manifest, workdir)
  if not diffs and saved['param_shapes'] != manifest['param_shapes']:
    diffs = ['parameter shapes differ']
  if diffs:
    raise UserError(f'--workdir holds checkpoints of a different model ({"; ".join(diffs[:4])}) in '
                    f'{directory}. Resume with the config it was trained with, or use a fresh --workdir; '
                    f'nothing was changed.')
  _check_same_optimizer(saved, manifest, workdir)
  _check_same_average(saved, manifest, workdir)
  _check_same_objective(saved, manifest, workdir)


def check_resume(step: int, saved: dict[str, Any], manifest: dict[str, Any], directory, workdir,
                 training: bool = True) -> None:
  """What a launch described by `manifest` may change since checkpoint `step` (its manifest `saved`, in `directory`,
  of either tier): another model, optimizer, average or objective refused (UserError); with `training`, a
  learning-rate jump at `step` refused unless accepted, and a change of quantization noted; every other difference
  logged in one line. `training=False`: a tool reading the parameters, which applies no schedule."""
  check_same_model(saved, manifest, directory, workdir)
  if training:
    check_schedule(step, saved, manifest)
    quantized = quantization.resume_note(step, *(m.get('config', {}).get('train', {}).get('quantization')
                                                 for m in (saved, manifest)))
    if quantized:
      logging.info(quantized)
  changes = safe_differences(saved, manifest)
  if changes:
    logging.info('%s step %d with %d setting(s) changed since it was saved: %s',
                 'Resuming' if training else 'Reading', step, len(changes), '; '.join(changes))
