"""Numeric guardrails: a non-finite loss or gradient is named, leaf by leaf, and handled per `train.on_nonfinite`.

In the step: the optimizer is wrapped in `optax.apply_if_finite`, so an update
from non-finite gradients is never applied (parameters and Adam moments stay as
they were), whatever the mode; and the step reports one finiteness flag per
gradient leaf (`leaf_finite`), so the host can name the offending parameters.

On the host (`Guard.check`, on each step's metrics as the loop fetches them):
- 'stop': raise NonFiniteError; launch.py exits with code 3. Every checkpoint
  on disk was taken from a step already checked (the loop checks a step before
  saving it), so the last good checkpoint is intact;
- 'skip': log the leaves and how many steps were skipped so far, and go on (the
  update was already dropped in the step). A checkpoint is not saved while the
  steps skipped since the last save outnumber the good ones (`may_save`): a model
  that stopped training is never saved over good checkpoints, so retention can
  only ever delete checkpoints older than the newest good one. Once more than
  SKIP_LIMIT_FRACTION of this launch's checked steps (at least SKIP_MIN_CHECKED of
  them) were skipped, stop as in 'stop', naming the checkpoint a relaunch
  resumes from;
- 'rollback': reload the newest checkpoint before the bad step, and when the
  replay reaches that step, draw the next batch instead of the offending one.
  If the same step is non-finite again after a rollback, stop as in 'stop'.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from trainer.base.errors import UserError

MODES = ('stop', 'skip', 'rollback')
NONFINITE_EXIT_CODE = 3  # Distinct from 2 (bad config), so schedulers can tell "do not just restart".
SKIP_LIMIT_FRACTION = 0.5
SKIP_MIN_CHECKED = 10


class NonFiniteError(UserError):
  """The run stopped on a non-finite loss or gradient; the last good checkpoint is on disk."""
  exit_code = NONFINITE_EXIT_CODE


class Rollback(Exception):
  """Raised out of the step loop to ask `Guard.roll_back` for the last good state (control flow only)."""

  def __init__(self, step: int, what: str):
    super().__init__(f'step {step}: {what}')
    self.step, self.what = step, what


def validate(mode: str) -> None:
  if mode not in MODES:
    raise UserError(f'train.on_nonfinite={mode!r}: choose one of {MODES}.')


def packing_hint(data_config) -> str:
  """What packed rows feed the model that can make it non-finite at once; '' when packing is off."""
  if not data_config.packing:
    return ''
  if data_config.get('packed_positions', 'document') == 'document':
    return (' Packing is on: positions= are offsets within each document, which run past data.seq_len in long '
            'documents; a model with a learned position table of seq_len rows reads past its end (NaN): set '
            '--config.data.packed_positions=row.')
  return ' Packing is on: positions= are offsets within each row\'s piece of a document (< data.seq_len).'


def guard_optimizer(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """Drops any update whose gradients are not all finite; never gives in (int32 max consecutive errors)."""
  return optax.apply_if_finite(tx, max_consecutive_errors=int(np.iinfo(np.int32).max))


def leaf_finite(grads) -> jax.Array:
  """bool[num_leaves], in `jax.tree.leaves` order: is every element of that gradient leaf finite?"""
  return jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])


class Guard:
  """Checks each step's metrics once; see the module docstring for what each mode does."""

  def __init__(self, mode: str, leaf_names: list[str], data_hint: str = '', resumed_step: int | None = None):
    validate(mode)
    self.mode, self._names = mode, leaf_names
    self._data_hint = data_hint  # A sentence on what the data feeds the model that can cause it (packing_hint).
    self._last_save = resumed_step  # The newest checkpoint known good: resumed from, or saved since.
    self._good_since_save, self._skipped_since_save = 0, 0
    self._last_checked = None
    self._skip_at = None  # After a rollback: the step whose batch is drawn and dropped.
    self._rolled_back_at = set()
    self._checked, self._skipped = 0, 0  # This launch's steps, for train.on_nonfinite=skip's limit.

  def check(self, step: int, metrics) -> None:
    if step == self._last_checked:
      return
    self._last_checked = step
    self._checked += 1
    loss, finite = jax.device_get((metrics['loss'], metrics['grads_finite']))
    if np.isfinite(loss) and bool(np.all(finite)):
      self._good_since_save += 1
      return
    bad = [name for name, ok in zip(self._names, np.asarray(finite)) if not ok]
    what = (f'non-finite loss ({float(loss)})' if not np.isfinite(loss) else 'finite loss') + (
        f' and non-finite gradients in {len(bad)} parameter leaves: {", ".join(bad[:8])}'
        f'{" ..." if len(bad) > 8 else ""}' if bad else ' but every gradient leaf finite')
    if self.mode == 'skip':
      self._skipped += 1
      self._skipped_since_save += 1
      logging.warning('Step %d: %s; update skipped (train.on_nonfinite=skip; %d of %d steps skipped so far).', step,
                      what, self._skipped, self._checked)
      if self._checked >= SKIP_MIN_CHECKED and self._skipped > SKIP_LIMIT_FRACTION * self._checked:
        raise NonFiniteError(
            f'step {step}: {self._skipped} of the {self._checked} steps checked in this launch were non-finite and '
            f'skipped (train.on_nonfinite=skip); stopped, since the model no longer trains. No checkpoint was saved '
            f'while skipped steps outnumbered good ones, so a relaunch resumes from {self._resume_point()}: lower '
            f'train.learning_rate or check the data first.{self._data_hint}')
    elif self.mode == 'rollback' and step not in self._rolled_back_at:
      raise Rollback(step, what)
    else:
      again = ' again after rolling back and skipping its batch' if step in self._rolled_back_at else ''
      raise NonFiniteError(
          f'step {step}: {what}{again}. Stopped (train.on_nonfinite={self.mode}); the update was not applied and '
          f'no checkpoint of this step or later was written, so a relaunch resumes from the last good one. '
          f'Lower train.learning_rate (a relaunch with a lower --config.train.learning_rate resumes with it), check '
          f'the data, or set train.on_nonfinite=skip or rollback.{self._data_hint}')

  def _resume_point(self) -> str:
    return f'step {self._last_save}' if self._last_save else 'step 0 (no checkpoint was saved before the skips)'

  def may_save(self, step: int) -> bool:
    """Whether the state at `step` may be saved: not while skipped steps outnumber good ones since the last save."""
    if self._skipped_since_save > self._good_since_save:
      logging.warning('Step %d: not saved: %d of the %d steps since %s were non-finite and skipped '
                      '(train.on_nonfinite=skip), so this state is no better than that one, which stays the newest '
                      'checkpoint.', step, self._skipped_since_save, self._skipped_since_save + self._good_since_save,
                      f'checkpoint {self._last_save}' if self._last_save else 'the start')
      return False
    return True

  def saved(self, step: int) -> None:
    """The state at `step` was saved: the counts since the last save start again."""
    self._last_save, self._good_since_save, self._skipped_since_save = step, 0, 0

  def roll_back(self, rollback: Rollback, ckpt, abstract_with_shardings, train_iter):
    """(step, state) of the newest intact checkpoint before the bad step; its batch will be skipped on replay."""
    ckpt.wait_until_finished()
    steps = [s for s in ckpt.all_steps() if s < rollback.step][::-1]
    if not steps:
      raise NonFiniteError(f'step {rollback.step}: {rollback.what}. train.on_nonfinite=rollback, but no checkpoint '
                           f'before step {rollback.step} exists to roll back to; stopped. Save more often '
                           f'(ckpt.every_steps) or lower train.learning_rate.')
    step, state = ckpt.restore_newest_intact(steps, abstract_with_shardings, train_iter)
    self.saved(step)  # The counts since the last save start again from the state rolled back to.
    self._rolled_back_at.add(rollback.step)
    self._skip_at, self._last_checked = rollback.step, None
    logging.warning('Step %d: %s. Rolled back to the checkpoint at step %d (train.on_nonfinite=rollback); its '
                    'batch will be skipped when the replay reaches it.', rollback.step, rollback.what, step)
    return step, state

  def skip_offending_batch(self, step: int, train_iter) -> None:
    """Call before drawing the batch of `step`: after a rollback, drops the batch that went non-finite."""
    if step == self._skip_at:
      next(train_iter)
      self._skip_at = None
      logging.warning('Step %d: skipped the batch that went non-finite before the rollback.', step)
