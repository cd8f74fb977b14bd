"""Orbax checkpoints of the train state, the Grain iterator and a run manifest.

Layout: WORKDIR/checkpoints/<step>/{state,data,manifest}. The manifest records
what the state was built from (resolved config, parameter shapes, versions,
XLA flags, mesh, strategy, git commit), so a workdir holding another model's
checkpoints is refused with a clear message before anything is compiled or
restored, and every other change since the save is logged.

Nothing here deletes a checkpoint it cannot read. Orbax writes each save into
`<step>.orbax-checkpoint-tmp-*` and renames it to `<step>` only once every
file is written, so a save killed midway leaves a tmp folder that is never
taken for a checkpoint; we report it and leave it (Orbax's tmp cleanup is off).
A finished checkpoint that fails to read (a truncated or missing file, an
empty folder) is reported and the next older one is tried; once an older one
is good, the damaged ones are moved to WORKDIR/damaged_checkpoints/
(trainer/safety/damaged.py) so the run can save those steps again.
"""

import collections
import contextlib
import json
import logging as std_logging
import os
import pathlib
import sys
import time
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from absl import logging

from parallel import sharding
from trainer.base import storage
from trainer.base.errors import UserError
from trainer.safety import checksums, disk
from trainer.safety import damaged as damaged_lib
from trainer.supervision import attempt
from trainer.training import manifest as manifests

_TMP_MARK = '.orbax-checkpoint-tmp'
# Where Orbax's JsonSave of the 'manifest' item puts it in a step folder (tests/test_gcs.py lists the object).
_MANIFEST_FILE = 'manifest/metadata'
# Orbax splits a replicated array so each replica writes a slice ("replica-parallel"); each slice shape costs
# one small compile on the first save (7 s for the tiny model's 500 slices on 8 CPU devices). In one process
# every slice is written by the same host anyway, so there it is kept for big slices only.
_MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL = 4 << 20


class _OverrideWarning(std_logging.Filter):
  def filter(self, record: std_logging.LogRecord) -> bool:
    return not str(record.msg).startswith('Type handler registry')


@contextlib.contextmanager
def _without_override_warning():
  """Drops Orbax's warning that a jax.Array handler replaces its default: replacing it is the point here, and a
  user reads a W-level line on every launch as a fault. Scoped to the one call, so no other Orbax warning is lost."""
  quiet = _OverrideWarning()
  logger = std_logging.getLogger('absl')
  logger.addFilter(quiet)
  try:
    yield
  finally:
    logger.removeFilter(quiet)


class Checkpointer:
  """Saves every `ckpt.every_steps` (and on demand), restores the newest intact one, guards against foreign workdirs."""

  def __init__(self, workdir: str, ckpt_config, move_damaged: bool = True):
    """`move_damaged`: move unreadable steps aside once an older one is good; only for the run holding the workdir
    (tools reading a live run's workdir pass False)."""
    self.directory = storage.path(workdir) / 'checkpoints'
    self._move_damaged = move_damaged
    if not (isinstance(ckpt_config.keep_period, int) and ckpt_config.keep_period >= 0):
      raise UserError(f'ckpt.keep_period={ckpt_config.keep_period!r} must be an integer >= 0 (0 keeps none extra).')
    keep = [ocp.checkpoint_managers.LatestN(ckpt_config.max_to_keep)]
    if ckpt_config.keep_period:
      keep.append(ocp.checkpoint_managers.EveryNSteps(ckpt_config.keep_period))
    options = ocp.CheckpointManagerOptions(
        save_interval_steps=ckpt_config.every_steps,
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(keep),
        enable_async_checkpointing=ckpt_config.async_save,
        cleanup_tmp_directories=False,  # An interrupted save is evidence; we report it, never delete it.
        # An async save's checksums are written once Orbax has written its files, before it commits the folder.
        async_options=ocp.AsyncOptions(post_finalization_callback=self._record_checksums)
        if ckpt_config.async_save else None,
        create=True)
    if jax.process_count() == 1:  # Across hosts, Orbax's default spreads the writes of replicated arrays.
      with _without_override_warning():
        ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
            min_slice_bytes_for_replica_parallel=_MIN_SLICE_BYTES_FOR_REPLICA_PARALLEL), override=True)
    self._async = ckpt_config.async_save
    self._manager = ocp.CheckpointManager(self.directory, options=options)
    self._saving_step = None  # The step of the save in flight, to name it if the write fails.
    self._failed = None  # The SaveFailedError already raised: close() does not raise it twice.
    self._finalizing = collections.deque()  # Steps of the async saves not yet committed, oldest first.
    self._verified = set()  # Steps whose files matched their checksums in this process (each is read once).
    self.newest_manifest: dict[str, Any] | None = None  # The newest readable step's, read by resumable_steps().
    disk.quiet_orbax_tracebacks()

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def incomplete_saves(self) -> list[storage.Path]:
    """Saves that never finished (a process killed mid-save): Orbax's tmp folders on disk. In a bucket Orbax
    writes `<step>/` in place and lists it only once its commit_success.txt is written, so there it is the step
    folders Orbax does not list (saving that step again overwrites them)."""
    if not self.directory.exists():
      return []
    if storage.is_cloud(self.directory):
      listed = set(self.all_steps())
      return sorted(p for p in self.directory.iterdir() if p.name.isdigit() and int(p.name) not in listed)
    return sorted(p for p in self.directory.iterdir() if _TMP_MARK in p.name)

  def read_manifest(self, step: int) -> dict[str, Any]:
    return self._manager.restore(step, args=ocp.args.Composite(manifest=ocp.args.JsonRestore()))['manifest']

  def resumable_steps(self, manifest: dict[str, Any], training: bool = True, resuming_here: bool = True) -> list[int]:
    """Steps to try resuming from, newest first, after checking the newest readable one against `manifest`
    (`manifests.check_resume`; its manifest is kept as `newest_manifest`).

    Reports (and skips) interrupted saves and checkpoints whose manifest cannot
    be read. Raises UserError for a different model, or when checkpoints exist
    but none is readable: the launcher never starts from scratch over a saved one
    (a first save that never completed is not one). `resuming_here=False`: only
    another model is refused here; a run that may resume from its local tier
    checks the step it restores, of either tier (trainer/training/resume.py).
    """
    for path in self.incomplete_saves():
      logging.warning('Checkpoint %s is an incomplete save (the run was killed while writing it): skipped, '
                      'left on disk.', path)
    steps, damaged, changed = self.all_steps()[::-1], [], {}
    for step in steps:
      try:
        self._verify(step)
      except checksums.Damaged as e:
        logging.warning('Checkpoint %s is damaged (%s): trying an older one.', self.directory / str(step), e)
        damaged.append(step)
        changed[step] = str(e)
        continue
      try:
        saved = self.read_manifest(step)
      except Exception as e:  # pylint: disable=broad-except  (any failure: this checkpoint cannot be trusted)
        logging.warning('Checkpoint %s is damaged (manifest unreadable: %s): trying an older one.',
                        self.directory / str(step), _short(e))
        damaged.append(step)
        continue
      self.newest_manifest = saved
      if resuming_here:  # Unsafe differences refuse; the others are logged.
        manifests.check_resume(step, saved, manifest, self.directory, self.directory.parent, training)
      else:
        manifests.check_same_model(saved, manifest, self.directory, self.directory.parent)
      self._set_aside([s for s in damaged if s not in changed], 'manifest unreadable')
      for changed_step, why in changed.items():
        self._set_aside([changed_step], why)
      return [s for s in steps if s <= step and s not in damaged]
    if not steps and self.incomplete_saves():
      # The run was killed while writing its first checkpoint: nothing complete was ever saved, so step 0 is the only
      # place to resume from (a supervised restart lands here after a crash early in a run).
      logging.warning('No complete checkpoint in %s yet (only the incomplete save(s) above, left on disk): training '
                      'from step 0.', self.directory)
      return []
    if steps:
      raise UserError(f'{self.directory} holds no intact checkpoint (damaged: {damaged[::-1] or "none"}; incomplete '
                      f'saves: {[p.name for p in self.incomplete_saves()] or "none"}). Nothing was changed. Use a '
                      f'fresh --workdir, or relaunch with --start_over to move them aside and train from step 0.')
    return []

  def check_compatible(self, step: int, manifest: dict[str, Any]) -> None:
    """Raises UserError if the checkpoint at `step` holds a different model than `manifest` describes."""
    try:
      saved = self._manager.restore(step, args=ocp.args.Composite(manifest=ocp.args.JsonRestore()))['manifest']
    except Exception as e:  # Any failure here means we cannot trust this checkpoint for resuming.
      raise UserError(f'checkpoint {self.directory / str(step)} has no readable manifest ({type(e).__name__}); '
                      f'it was not written by this launcher or is damaged. Use a fresh --workdir.') from e
    manifests.check_same_model(saved, manifest, self.directory, self.directory.parent)
    # Another process count is fine: the data position is a count of global examples (trainer/data/pipeline.py).

  def save(self, step: int, state, data_iterator: grain.DatasetIterator, manifest: dict[str, Any],
           force: bool = False) -> bool:
    """Starts a save if `step` is due (or `force`); returns whether one started."""
    state = detach(state)
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_iterator.get_state()),
        manifest=ocp.args.JsonSave(manifest))
    if self._async and jax.process_index() == 0:  # Where Orbax calls _record_checksums.
      self._finalizing.append(step)  # Before the save starts: its callback may run before save() returns.
    started = False
    with self._save_failures(step):
      try:
        started = storage.within_deadline(f'saving step {step}', self.directory,
                                          lambda: self._manager.save(step, args=args, force=force))
      finally:
        if not started and step in self._finalizing:
          self._finalizing.remove(step)
      if started and not self._async and jax.process_index() == 0:
        checksums.record(self.directory / str(step))  # Committed already; a crash before this leaves it unverified.
    self._verified.discard(step)
    if started:
      self._saving_step = step
    return started

  @contextlib.contextmanager
  def _save_failures(self, step: int):
    """Turns a write that failed for space or permission (now, or in the async save in flight) into one line."""
    try:
      yield
    except storage.StorageStall as e:
      _stop_for_storage(step, e)
    except Exception as e:
      failed_step = self._saving_step if self._saving_step is not None else step
      lost = self._lost_from_bucket(failed_step, e)
      if lost:
        _stop_for_storage(failed_step, lost)
      code = disk.write_failure(e)
      if code is None:
        raise
      good = [s for s in self._complete_steps_on_disk() if s != failed_step]
      self._failed = disk.save_failed(self.directory, failed_step, code, good)
      raise self._failed from None

  def _lost_from_bucket(self, step: int, error: Exception) -> storage.ObjectsGone | None:
    """For a save that failed in a bucket: the error naming the bucket when it is gone, or emptied (the checkpoints
    saved before are gone, or a write of this save answered 'not found': the server lost the upload or the objects
    it wrote first); else None."""
    if not storage.is_cloud(self.directory):
      return None
    # The steps committed before (Orbax's list, from memory), less the save that failed.
    earlier = [s for s in self._manager.all_steps() if s not in (step, self._saving_step)]

    def missing() -> list[int]:
      storage.filesystem().invalidate_cache()
      gone = [s for s in earlier if not (self.directory / str(s)).exists()]
      # A write answered 'not found' even where the step's folder is there: the server restarted empty during a
      # resumable upload, and the save's later objects landed in the new bucket (tests/test_faults_gcs.py).
      if not gone and _not_found(error):
        gone = [step]
      return gone or ([] if storage.bucket_exists(self.directory) else [step])

    try:
      gone = storage.within_deadline('looking for the checkpoints saved before', self.directory, missing)
    except Exception:  # pylint: disable=broad-except  (not answering either: the save's own error says more)
      return None
    return storage.objects_gone(self.directory, f'checkpoint {", ".join(map(str, gone))} of this run') if gone else None

  def _complete_steps_on_disk(self) -> list[int]:
    return sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit()) if self.directory.exists() else []

  def restore(self, step: int, abstract_state_with_shardings, data_iterator: grain.DatasetIterator):
    """Restores the state straight into its target shardings and rewinds the data iterator."""
    restored = self._restore_state_and_data(step, abstract_state_with_shardings)
    data_iterator.set_state(restored['data'])  # Same position on every process, for any process count.
    return restored['state']

  def _restore_state_and_data(self, step: int, abstract_state_with_shardings):
    self._verify(step)
    args = ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state_with_shardings),
        data=ocp.args.JsonRestore())
    return self._manager.restore(step, args=args)

  def restore_newest_intact(self, steps: list[int], abstract_state_with_shardings,
                            data_iterator: grain.DatasetIterator):
    """(step, state) from the first of `steps` that restores; damaged ones are reported and skipped, never deleted."""
    failed = []
    for step in steps:
      try:
        restored = self._restore_state_and_data(step, abstract_state_with_shardings)
      except Exception as e:  # pylint: disable=broad-except  (a truncated file surfaces as many error types)
        logging.warning('Checkpoint %s is damaged (%s): trying an older one.', self.directory / str(step), _short(e))
        failed.append(step)
        continue
      # A refusal here is a changed data.* setting or train.seed (a UserError naming them), not damage.
      data_iterator.set_state(restored['data'])
      self._set_aside(failed, 'could not be restored')
      return step, restored['state']
    raise UserError(f'no checkpoint in {self.directory} could be restored (tried steps {steps}); nothing was '
                    f'changed. Use a fresh --workdir, or relaunch with --start_over to train from step 0.')

  def _set_aside(self, steps: list[int], why: str) -> None:
    """Moves damaged `steps` out of Orbax's sight (WORKDIR/damaged_checkpoints/), so they can be saved again."""
    if not (steps and self._move_damaged):
      if steps:
        logging.warning('Damaged checkpoint(s) %s (%s): skipped, left on disk.', steps, why)
      return
    for step in steps:
      damaged_lib.move_aside(self.directory, step, why)
    if storage.is_cloud(self.directory):  # Orbax's listings would still show them: saving one of those steps again
      storage.forget_listings()  # would delete what is no longer there (FileNotFoundError).
    self._manager.reload()

  def restores(self, step: int, abstract_state_with_shardings) -> bool:
    """Whether `step`'s state and data position restore (read and dropped): damage shows only on a real read."""
    try:
      self._restore_state_and_data(step, abstract_state_with_shardings)
    except Exception as e:  # pylint: disable=broad-except  (a truncated file surfaces as many error types)
      logging.warning('Checkpoint %s is damaged (%s).', self.directory / str(step), _short(e))
      return False
    return True

  def restore_state(self, step: int, abstract_state_with_shardings):
    """Only the train state (e.g. for export, or onto another process count), into the given shardings."""
    self._verify(step)
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state_with_shardings))
    return self._manager.restore(step, args=args)['state']

  def _verify(self, step: int) -> None:
    """checksums.Damaged if a file of `step` changed since its save; each step's files are read once."""
    if step not in self._verified:
      storage.within_deadline(f'verifying checkpoint {step}', self.directory, checksums.verify,
                              self.directory / str(step))
      self._verified.add(step)

  def _record_checksums(self) -> None:
    """Orbax's post-finalization callback (process 0, on its save thread): the oldest save in flight is written."""
    step = self._finalizing.popleft() if self._finalizing else None
    # Not yet committed: a local save is still in its tmp folder; in a bucket Orbax writes `<step>/` in place.
    folder = self.directory / (str(step) if storage.is_cloud(self.directory) else f'{step}{_TMP_MARK}')
    if step is None or not folder.exists():
      logging.warning('No checksums recorded for the checkpoint being saved (%s not found): it will be restored '
                      'without verifying it.', folder)
      return
    checksums.record(folder)

  def save_in_progress(self) -> bool:
    return self._manager.is_saving_in_progress()

  def wait_until_finished(self) -> None:
    with self._save_failures(self._saving_step or 0):
      storage.within_deadline(f'finishing the save of step {self._saving_step}', self.directory,
                              self._manager.wait_until_finished)
    self._saving_step = None

  def close(self) -> None:
    """Waits for any save in flight, then releases the manager (a save failure already raised is not raised again)."""
    reported = self._failed is not None
    try:
      self.wait_until_finished()
      self._manager.close()
    except Exception:  # pylint: disable=broad-except
      if not reported:
        raise


def _not_found(error: BaseException) -> bool:
  """Whether `error` or one it came from is a 'not found' (gcsfs's FileNotFoundError, tensorstore's NOT_FOUND)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, FileNotFoundError) or str(error).startswith('NOT_FOUND'):
      return True
    error = error.__cause__ or error.__context__
  return False


def _stop_for_storage(step: int, stall: storage.StorageStall) -> None:
  """The line and the exit the supervisor retries (74), at once, as the hang watch does (trainer/supervision/hang.py).

  A bucket that stopped answering mid-save: Orbax's writers (and the metrics' uploads) would each wait out their own
  retries in the cleanup that follows, minutes of silence. A bucket gone or emptied: every writer still open
  (TensorBoard's, at exit) would fail with its own traceback.
  """
  attempt.note(stopped='storage stalled')
  print(f'{pathlib.Path(sys.argv[0]).name}: error: could not save step {step}: {stall}', file=sys.stderr, flush=True)
  os._exit(stall.exit_code)


def detach(state):
  """On CPU, a copy of `state` for Orbax to write from, so the next (donating) step need not wait for the write.

  A CPU array is already host memory, and Orbax's async save reads it in place:
  the train step, which donates the state, then waits for the whole write (a
  1 GB state held the next step for ~17 s in benchmarks/bench_checkpoint.py). On
  GPU/TPU Orbax copies to host before save() returns, so no copy is made there.
  One device_put copies every local shard of every leaf, compiling nothing: a
  copy per leaf compiled one program per leaf shape (11 for the tiny model, at
  every launch), and a device_put of the whole tree refused arrays spread over
  several processes (tests/test_checkpoint.py's two-process save).
  """
  if jax.default_backend() != 'cpu':
    return state
  leaves, tree = jax.tree.flatten(state)
  shards = [[s.data for s in leaf.addressable_shards] for leaf in leaves]
  copies = iter(jax.device_put([d for ds in shards for d in ds], [d.device for ds in shards for d in ds],
                               may_alias=False))
  return jax.tree.unflatten(tree, [jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding,
                                                                            [next(copies) for _ in ds])
                                   for leaf, ds in zip(leaves, shards)])


def _short(error: Exception) -> str:
  text = ' '.join(str(error).split())
  return f'{type(error).__name__}: {text[:300]}'


def newest_manifest(workdir: str) -> tuple[int, dict[str, Any]] | None:
  """(step, manifest) of the newest finished checkpoint in `workdir` whose manifest reads, or None; only reads.

  For callers that look before a run holds the workdir (remat 'auto' reusing its
  earlier choice): no Checkpointer, whose Orbax manager creates the folder, and
  nothing moved or logged. Saves that never finished (Orbax's own test: a tmp
  folder on disk, no commit_success.txt in a bucket) and manifests that do not
  parse are skipped; `Checkpointer.resumable_steps` reports them when the run starts.
  """
  directory = storage.path(workdir) / 'checkpoints'
  if not directory.is_dir():
    return None
  for path in sorted((p for p in directory.iterdir() if p.name.isdigit()), key=lambda p: -int(p.name)):
    try:
      if ocp.utils.is_checkpoint_finalized(path):
        return int(path.name), json.loads((path / _MANIFEST_FILE).read_text())
    except (OSError, ValueError):
      continue
  return None


# What `--start_over` moves aside: everything a run writes into its workdir but the lock (docs/checkpoints.md).
START_OVER_NAMES = ('checkpoints', 'metrics.jsonl', 'goodput.jsonl', 'tensorboard', 'plugins', 'memory_profiles',
                    'config.json', 'sharding.txt', 'attempts.jsonl', 'hangs', damaged_lib.FOLDER)


def start_over(workdir: str) -> storage.Path | None:
  """`--start_over`: moves the previous run's checkpoints and logs into WORKDIR/previous_run_<UTC time>/.

  Nothing is deleted: the user can move them back. Process 0 moves, every
  process waits for it, so no process sees a half-moved workdir.
  """
  from jax.experimental import multihost_utils
  workdir = storage.path(workdir)
  found = [workdir / n for n in START_OVER_NAMES if (workdir / n).exists()]
  target = workdir / time.strftime('previous_run_%Y%m%dT%H%M%SZ', time.gmtime()) if found else None
  if found and jax.process_index() == 0:
    for path in found:
      storage.move(path, target / path.name)
    logging.warning('--start_over: moved the previous run (%s) to %s; training starts from step 0.',
                    ', '.join(p.name for p in found), target)
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices('start_over')
  return target


def restore_for_tool(job, workdir: str, step: int | None = None) -> tuple[int, Any]:
  """(step, train state) of checkpoint `step` (default: the newest intact one) of `workdir`, for tools.

  `job` (a trainer.run.job.Job) describes the model: the checkpoint's manifest is
  checked against it first, and the state is restored into its shardings.
  """
  ckpt = Checkpointer(workdir, job.config.ckpt, move_damaged=False)  # The run may still be writing there.
  try:
    steps = ckpt.resumable_steps(manifests.run_manifest(job.config, job.abstract, job.mesh), training=False)
    if step is not None:
      if step not in ckpt.all_steps():
        raise UserError(f'--step={step}: no such checkpoint in {ckpt.directory} (have {ckpt.all_steps()}); give one '
                        f'of them, or leave --step out for the newest intact one.')
      steps = [step]
    if not steps:
      raise UserError(f'{ckpt.directory} holds no checkpoint; train with launch.py until one is saved '
                      f'(ckpt.every_steps, or the last step).')
    state = ckpt.restore_state(steps[0], sharding.with_shardings(job.abstract, job.shardings))
    logging.info('Read checkpoint step %d from %s', steps[0], ckpt.directory)  # Which one a tool used, in its log.
    return steps[0], state
  finally:
    ckpt.close()
