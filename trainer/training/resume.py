"""Which checkpoint tier a launch resumes from, and the one check of what it changed since that step was saved.

The persistent tier's newest readable checkpoint is found first (a workdir of another model refused at once), then
the local tier's newest complete step, taken if newer (trainer/training/local_tier.py). The manifest of the step that
will be restored, of whichever tier, then goes through `manifests.check_resume`: the same refusals (another model,
optimizer, average or objective; a learning-rate jump without consent) and the same logged changes either way, all
before the compile. A local step newer than the one restored (of another layout, or with unusable shards), which the
run will drop, is checked for another model too: a run never discards the newest state of the model it was trained as.
"""

import time
from typing import Any

from absl import logging

from trainer.base import storage
from trainer.training import checkpoint, local_tier
from trainer.training import manifest as manifests


def choose(ckpt: checkpoint.Checkpointer, local: local_tier.LocalTier, manifest: dict[str, Any],
           abstract_with_shardings, workdir: str) -> tuple[list[int], local_tier.Found | None, str]:
  """(the persistent tier's steps to try, newest first; the local step to restore, or None; why not, in words, or
  '') for the launch `manifest` describes. Raises UserError, on every process, for what a resume may not change.
  Every process must call it."""
  # Only another model is refused there: the rest is checked below, against the step of the tier restored.
  resumable = storage.within_deadline("reading the checkpoints' manifests", workdir,
                                      lambda: ckpt.resumable_steps(manifest, resuming_here=False))
  persistent = resumable[0] if resumable else None
  found, not_local = local.newest(abstract_with_shardings, newer_than=persistent or 0)
  newest = local.newest_described()
  run = ckpt.directory.parent  # The workdir as the persistent tier's lines name it.
  if newest is not None and newest > (persistent or 0) and (found is None or newest > found.step):
    manifests.check_same_model(local.manifest(newest), manifest, local.folder, run)
  if found:
    manifests.check_resume(found.step, local.manifest(found.step), manifest, local.folder, run)
  elif resumable:
    manifests.check_resume(persistent, ckpt.newest_manifest, manifest, ckpt.directory, run)
  return resumable, found, not_local


def restore_local(tier: local_tier.LocalTier, found: local_tier.Found, abstract_with_shardings, data_iterator,
                  persistent_step: int | None) -> Any:
  """Restores `found` (state returned, data position set) and says in one line which tier and why."""
  start = time.perf_counter() - tier.read_s  # Its files were read as the step was chosen.
  state, data_state = tier.restore(found, abstract_with_shardings)
  data_iterator.set_state(data_state)
  source = (f'process(es) {list(found.from_peer)} from their peer\'s copy (their own copy is missing or unusable), '
            'the others from their own' if found.from_peer else 'every process from its own folder')
  logging.info('Resuming from the local tier at step %d (%s; newer than the persistent tier\'s %s) in %.1fs: %s.',
               found.step, tier.folder.parent, 'none' if persistent_step is None else f'step {persistent_step}',
               time.perf_counter() - start, source)
  return state
