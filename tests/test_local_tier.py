"""The local checkpoint tier in-process (trainer/training/local_tier.py): a bit-exact round trip, which step a
restart takes when hosts are lost, a local folder that cannot be written (one line, the run goes on), a damaged
local copy (one line, the copy treated as missing), the GPU/TPU path's copy to host before the next step, and a
resume from it checked against the launch as the persistent tier's is (trainer/training/resume.py; one launch
refused). The two-process kill -9 runs are tests/test_local_tier_multiprocess.py."""

import errno
import json
import logging as std_logging
import os
import re
import shutil

import jax
import numpy as np
import pytest

from configs import tiny
from conftest import make_text_dir, run_launcher
from trainer.base.errors import UserError
from trainer.training import checkpoint, local_files, local_tier, resume
from trainer.training import manifest as manifests

# A manifest with what a resume reads (trainer/training/manifest.py), for the tests that never check one.
MANIFEST = {'model': {}, 'param_shapes': {}, 'config': {}}


def _state(scale=1.0, width=8):
  mesh = jax.make_mesh((2, 4), ('data', 'fsdp'))

  def put(value, *spec):
    return jax.device_put(value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))
  return {'w': put(np.arange(8 * width, dtype=np.float32).reshape(8, width) * scale, 'data', 'fsdp'),
          'b': put((np.ones((5, 3)) * scale).astype(jax.numpy.bfloat16)), 'step': put(np.int32(3))}


def _abstract(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


@pytest.fixture
def warnings(caplog):
  caplog.set_level(std_logging.WARNING)
  return lambda: [r.getMessage() for r in caplog.records if r.levelno >= std_logging.WARNING]


def test_a_saved_step_restores_bit_exact_with_its_data_position_and_two_are_kept(tmp_path):
  tier = local_tier.LocalTier(str(tmp_path), 2, '/some/workdir', 0, 1)
  for step in (2, 4, 6):
    tier.save(step, _state(step), {'position': step}, MANIFEST)
  tier.wait_until_finished()
  assert tier.steps() == [4, 6]
  assert oct(os.stat(tier.folder).st_mode & 0o777) == '0o700'
  found, why = tier.newest(_abstract(_state()), newer_than=0)
  assert (found, why) == (local_tier.Found(6, ()), '')
  state, data_state = tier.restore(found, _abstract(_state()))
  assert data_state == {'position': 6}
  for name, value in _state(6).items():
    assert state[name].dtype == value.dtype and state[name].sharding == value.sharding
    np.testing.assert_array_equal(np.asarray(state[name]), np.asarray(value))
  assert tier.newest(_abstract(_state()), newer_than=6) == (None, "the local tier's newest complete step, 6, is not "
                                                                   'newer')
  tier.discard_after(4)
  assert tier.steps() == [4]


def test_a_local_dir_that_is_not_a_folder_is_one_line_and_the_tier_is_off(tmp_path, warnings):
  (tmp_path / 'file').write_text('')
  tier = local_tier.LocalTier(str(tmp_path / 'file'), 2, '/w', 0, 1)
  assert not tier.enabled and not tier.due(2)
  [line] = warnings()
  assert line.startswith(f"ckpt.local_dir='{tmp_path / 'file'}' cannot be written ({tmp_path / 'file'} is not a "
                         'folder): going on with the persistent tier alone') and 'Fix: point ckpt.local_dir' in line


def test_a_link_planted_where_the_run_folder_goes_is_refused_in_one_line(tmp_path, warnings):
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  probe = local_tier.LocalTier(str(tmp_path / 'shm'), 2, '/w', 0, 1) if (tmp_path / 'shm').mkdir() is None else None
  run_folder = probe.folder.parent
  for path in sorted(run_folder.rglob('*'), reverse=True):
    path.rmdir()
  run_folder.rmdir()
  run_folder.symlink_to(elsewhere)
  tier = local_tier.LocalTier(str(tmp_path / 'shm'), 2, '/w', 0, 1)
  assert not tier.enabled and not list(elsewhere.iterdir())
  assert 'is a symbolic link' in warnings()[-1] and 'going on with the persistent tier alone' in warnings()[-1]


def test_a_full_ram_disk_is_one_line_the_tier_stops_and_earlier_steps_stay(tmp_path, warnings, monkeypatch):
  tier = local_tier.LocalTier(str(tmp_path), 2, '/w', 0, 1)
  tier.save(2, _state(), {'position': 2}, MANIFEST)
  tier.wait_until_finished()
  real = local_files.write_npz

  def full(path, arrays):
    real(path, arrays)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
  monkeypatch.setattr(local_files, 'write_npz', full)
  tier.save(4, _state(), {'position': 4}, MANIFEST)
  tier.save(6, _state(), {'position': 6}, MANIFEST)  # Waits for 4's write, which failed: said once, then off.
  tier.wait_until_finished()
  [line] = warnings()
  assert line.startswith(f'the local tier in {tier.folder} could not be written (No space left on device: ') and (
      'going on with the persistent tier alone' in line)
  assert not tier.enabled and tier.steps() == [2] and sorted(p.name for p in tier.folder.iterdir()) == ['2']


def test_a_lost_host_is_restored_from_its_peer_and_one_whose_peer_is_lost_too_from_the_persistent_tier():
  def choose(own_of, copy_of, newer_than=0, unusable=False):  # {process: steps}, as the all-gather leaves them.
    return local_tier.complete_step([set(own_of[p]) for p in range(3)],
                                    [set(copy_of[(p - 1) % 3]) for p in range(3)], newer_than, unusable)
  # Process 1's host is new: its shards of 36 come from process 0's copy.
  assert choose({0: [36, 34], 1: [], 2: [36, 34]}, {0: [36, 34], 1: [], 2: [36]}) == (local_tier.Found(36, (1,)), '')
  found, why = choose({0: [36, 34], 1: [], 2: [36, 34]}, {0: [], 1: [], 2: [36]})  # Process 0 lost its copy too.
  assert found is None and why == ("the local tier holds no complete step (its newest, 36, lacks the shards of "
                                   "process(es) [1]: neither their own folder nor their peer's copy on process(es) "
                                   "[0] has them; both hosts lost)")
  assert choose({0: [36], 1: [], 2: [36]}, {0: [], 1: [], 2: []}, unusable=True)[1].endswith('; lost or unusable)')
  everything = {0: [36, 34], 1: [34], 2: [36, 34]}, {0: [36, 34], 1: [34], 2: [36, 34]}  # 1 died writing 36.
  assert choose(*everything) == (local_tier.Found(36, (1,)), '')
  assert choose(*everything, newer_than=50)[0] is None  # The persistent tier's 50 is newer.
  assert choose({0: [], 1: [], 2: []}, {0: [], 1: [], 2: []}, unusable=True) == (
      None, 'the local tier holds no usable step')


def test_start_over_moves_the_local_steps_aside_and_keeps_them(tmp_path):
  tier = local_tier.LocalTier(str(tmp_path), 2, '/w', 0, 1)
  tier.save(2, _state(), {'position': 2}, MANIFEST)
  tier.wait_until_finished()
  tier.set_aside()
  [kept] = [p for p in tier.folder.parent.iterdir() if '.previous_run_' in p.name]
  assert (kept / '2' / 'own.npz').is_file() and tier.steps() == [] and tier.folder.is_dir()


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """A local dir holding steps 4 and 6 of one process, each with the state `_state(step)`, copied by each test."""
  root = tmp_path_factory.mktemp('saved')
  tier = local_tier.LocalTier(str(root / 'shm'), 2, '/w', 0, 1)
  for step in (4, 6):
    tier.save(step, _state(step), {'position': step}, MANIFEST)
  tier.wait_until_finished()
  return root / 'shm', tier.folder.relative_to(root / 'shm')


def _flip_a_data_byte(path):
  data = bytearray(path.read_bytes())
  at = data.find(np.float32(6 * 17).tobytes())  # A value of w (step 6) inside its stored bytes: only the CRC sees it.
  assert at > 0
  data[at] ^= 0x40
  path.write_bytes(bytes(data))


def _wrong_shape(path):
  with np.load(path) as files:
    blocks = dict(files)
  name = next(k for k in blocks if k.startswith('2|'))  # A block of w (leaves in key order: b, step, w).
  blocks[name] = np.zeros((1, *blocks[name].shape[1:]), blocks[name].dtype)
  os.unlink(path)
  np.savez(path, **blocks)


def _link_to_a_copy(path):
  """Replaces `path` with a link to an intact copy of it elsewhere: were it followed, step 6 would restore."""
  target = path.parent.parent.parent / f'elsewhere-{path.name}'
  (shutil.copytree if path.is_dir() else shutil.copy)(path, target)
  (shutil.rmtree if path.is_dir() else os.unlink)(path)
  path.symlink_to(target)
  return target


DAMAGE = {
    'own.npz a link': ('own.npz', _link_to_a_copy, 'a symbolic link (to '),
    'own.npz a fifo': ('own.npz', lambda p: os.unlink(p) or os.mkfifo(p), 'a special file'),
    'own.npz truncated': ('own.npz', lambda p: os.truncate(p, p.stat().st_size // 2), 'truncated or corrupt: '),
    'own.npz a flipped byte': ('own.npz', _flip_a_data_byte, 'truncated or corrupt: Bad CRC-32'),
    'own.npz a block of another shape': ('own.npz', _wrong_shape, 'block 2|0:4,0:2 is float32[1, 2], not float32[4, 2]'),
    'the step folder a link': ('', _link_to_a_copy, 'a symbolic link (to '),
    'meta.json a link': ('meta.json', _link_to_a_copy, 'its meta.json is a symbolic link (to '),
    # A step saved before the tier kept manifests has none: it cannot be checked against the launch.
    'manifest.json missing': ('manifest.json', os.unlink, 'its manifest.json is missing'),
    'manifest.json truncated': ('manifest.json', lambda p: os.truncate(p, 20), 'its manifest.json cannot be read ('),
    'manifest.json not a manifest': ('manifest.json', lambda p: p.write_text('{"model": {}}') and None,
                                     'its manifest.json is not a run manifest'),
}


@pytest.mark.parametrize('damage', list(DAMAGE))
def test_a_damaged_local_copy_is_one_line_treated_as_missing_and_the_step_before_restores(
    damage, saved, tmp_path, warnings):
  shm, folder = saved
  shutil.copytree(shm, tmp_path / 'shm')
  name, spoil, why = DAMAGE[damage]
  path = tmp_path / 'shm' / folder / '6' / name if name else tmp_path / 'shm' / folder / '6'
  target = spoil(path)
  kept = target and sorted((p.relative_to(target), p.read_bytes()) for p in [target, *target.rglob('*')]
                           if p.is_file())
  tier = local_tier.LocalTier(str(tmp_path / 'shm'), 2, '/w', 0, 1)
  found, not_local = tier.newest(_abstract(_state()), newer_than=0)
  assert (found, not_local) == (local_tier.Found(4, ()), '')  # Step 6 treated as missing: never read through.
  [line] = warnings()
  assert line.startswith(f'{path.parent if name.endswith(".json") else path} cannot be used ({why}') and line.endswith(
      "the local tier treats this process's step 6 as missing (never reading through a link) and falls back to its "
      "peer's copy of it if intact, else to an older step or the persistent tier."), line
  state, data_state = tier.restore(found, _abstract(_state()))
  assert data_state == {'position': 4}
  for key, value in _state(4).items():
    np.testing.assert_array_equal(np.asarray(state[key]), np.asarray(value))
  tier.discard_after(4)  # The run goes on from 4: the damaged 6 goes (a link only unlinked), never its target.
  assert tier.steps() == [4] and not os.path.lexists(tmp_path / 'shm' / folder / '6')
  if target:
    assert sorted((p.relative_to(target), p.read_bytes()) for p in [target, *target.rglob('*')] if p.is_file()) == kept


def test_a_local_tier_whose_every_step_is_damaged_falls_back_to_the_persistent_tier(saved, tmp_path, warnings):
  shm, folder = saved
  shutil.copytree(shm, tmp_path / 'shm')
  for step in (4, 6):
    os.truncate(tmp_path / 'shm' / folder / str(step) / 'own.npz', 100)
  tier = local_tier.LocalTier(str(tmp_path / 'shm'), 2, '/w', 0, 1)
  assert tier.newest(_abstract(_state()), newer_than=0) == (None, 'the local tier holds no usable step')
  assert [line.split(' cannot be used')[0] for line in warnings()] == [
      str(tmp_path / 'shm' / folder / str(step) / 'own.npz') for step in (6, 4)]


def test_off_the_host_the_save_copies_to_host_before_the_next_step_may_donate_the_buffers(tmp_path):
  tier = local_tier.LocalTier(str(tmp_path), 2, '/w', 0, 1)
  tier.host_resident = False  # As on a GPU or TPU: no device-side copy, the copy to host is made in save().
  state = _state(2)
  tier.save(2, state, {'position': 2}, MANIFEST)
  for leaf in state.values():
    leaf.delete()  # What the next step's donation does to these buffers: the write must not need them.
  tier.wait_until_finished()
  assert tier.enabled and tier.steps() == [2]
  found, _ = tier.newest(_abstract(_state()), newer_than=0)
  restored, _ = tier.restore(found, _abstract(_state()))
  for key, value in _state(2).items():
    np.testing.assert_array_equal(np.asarray(restored[key]), np.asarray(value))


def _manifest(state, **changes) -> dict:
  """What a resume reads of a run's manifest (trainer/training/manifest.py: run_manifest): configs/tiny.py with
  `changes` ({'train__learning_rate': 0.01}), over the toy `state`'s parameters."""
  config = tiny.get_config()
  for key, value in changes.items():
    section, name = key.split('__')
    config[section][name] = value
  return {'model': config.model.to_dict(), 'param_shapes': manifests.param_shapes(state),
          'config': json.loads(config.to_json_best_effort())}


class _Position:
  """The data iterator a persistent save reads the position from."""

  def __init__(self, step):
    self.step = step

  def get_state(self):
    return {'position': self.step}


def _files(root) -> dict[str, bytes]:
  return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob('*')) if p.is_file()}


def _resume(root, persistent, local, launch, width, caplog):
  """What resume.choose makes of the launch manifest `launch` (a toy state `width` wide) over a persistent step and
  a local one, each (step, manifest) or None: (the error, or the step it resumes from; the manifest lines logged),
  with the tier's folder and the workdir as words. It changes no file."""
  workdir = root / 'run'
  ckpt = checkpoint.Checkpointer(str(workdir), tiny.get_config().ckpt)
  if persistent:
    ckpt.save(persistent[0], _state(persistent[0]), _Position(persistent[0]), persistent[1], force=True)
    ckpt.wait_until_finished()
  tier = local_tier.LocalTier(str(root / 'shm'), 2, str(workdir), 0, 1)
  if local:
    tier.save(local[0], _state(local[0]), {'position': local[0]}, local[1])
    tier.wait_until_finished()
  before = _files(root)
  caplog.clear()
  try:
    resumable, found, _ = resume.choose(ckpt, tier, launch, _abstract(_state(width=width)), str(workdir))
    said = found.step if found else resumable[0]
  except UserError as e:
    said = str(e)
  finally:
    ckpt.close()
  assert _files(root) == before
  lines = [r.getMessage() for r in caplog.records if r.module == 'manifest']
  words = {str(tier.folder): 'FOLDER', str(workdir / 'checkpoints'): 'FOLDER', str(workdir): 'WORKDIR'}
  return [re.sub('|'.join(map(re.escape, words)), lambda m: words[m[0]], str(x)) for x in (said, *lines)]


CHANGES = {  # A launch's changes since step 6, the toy state's width it builds, and what is said of it.
    'another model of the same shapes': ({'model__rope_max_wavelength': 5e5}, 8, [
        'different model (model.rope_max_wavelength: checkpoint 10000.0 vs config 500000.0) in FOLDER. Resume with '
        'the config it was trained with']),
    'another model of other shapes': ({'model__d_model': 64}, 16, ['(model.d_model: checkpoint 32 vs config 64) in FOLDER']),
    'another optimizer': ({'train__optimizer': 'lion'}, 8, [
        "--workdir WORKDIR was trained with train.optimizer='adamw', not 'lion'"]),
    'a learning-rate jump': ({'train__learning_rate': 0.01}, 8, [
        'train.learning_rate 0.003 -> 0.01 since checkpoint 6: the learning-rate schedule moves']),
    'a learning-rate jump accepted, and a setting only logged': (
        {'train__learning_rate': 0.01, 'train__accept_schedule_change': True, 'log__every_steps': 7}, 8,
        ['6', '(accepted: train.accept_schedule_change=True)',
         'Resuming step 6 with 3 setting(s) changed since it was saved: config.log.every_steps: 2 -> 7; '
         'config.train.accept_schedule_change: False -> True; config.train.learning_rate: 0.003 -> 0.01']),
}


@pytest.mark.parametrize('change', list(CHANGES))
def test_a_resume_from_the_local_tier_is_refused_or_logged_as_one_from_the_persistent_tier(change, tmp_path, caplog):
  """The persistent tier's step 6 alone, against the local tier's step 6 over a persistent step 2 that agrees with
  the launch: the newest state decides, in the same words, whichever tier holds it; nothing is changed."""
  changes, width, said = CHANGES[change]
  caplog.set_level(std_logging.INFO)
  saved, launch = _manifest(_state()), _manifest(_state(width=width), **changes)
  from_persistent = _resume(tmp_path / 'persistent', (6, saved), None, launch, width, caplog)
  from_local = _resume(tmp_path / 'local', (2, launch), (6, saved), launch, width, caplog)
  assert from_local == from_persistent
  assert len(from_local) == len(said) and all(part in line for part, line in zip(said, from_local)), from_local


def test_a_launch_with_another_model_than_its_newer_local_step_is_refused_in_one_line_before_the_compile(tmp_path):
  """The launcher's path (trainer/run/loop.py): configs/tiny.py's state saved to the local tier at step 6, none in
  the persistent tier; a launch with another RoPE wavelength (the same shapes) stops with one line, exit 2, and leaves
  the local tier as it was."""
  from parallel import sharding
  from trainer.run import job as job_lib
  text_dir = make_text_dir((tmp_path / 'text').mkdir() or tmp_path / 'text', num_files=4)
  config = tiny.get_config()
  config.data.text_dir = str(text_dir)
  job = job_lib.build_job(config)
  workdir, shm = tmp_path / 'run', tmp_path / 'shm'
  tier = local_tier.LocalTier(str(shm), 2, str(workdir), 0, 1)
  state = jax.tree.map(lambda leaf: jax.device_put(np.zeros(leaf.shape, leaf.dtype), leaf.sharding),
                       sharding.with_shardings(job.abstract, job.shardings))
  tier.save(6, state, {}, manifests.run_manifest(config, job.abstract, job.mesh))
  tier.wait_until_finished()
  saved = _files(shm)
  result = run_launcher('--config=configs/tiny.py', f'--workdir={workdir}', f'--config.data.text_dir={text_dir}',
                        f'--config.ckpt.local_dir={shm}', '--config.ckpt.local_every_steps=2',
                        '--config.model.rope_max_wavelength=500000.0')
  assert result.returncode == 2, result.stderr[-3000:]
  assert result.stderr.strip().splitlines()[-1] == (
      'launch.py: error: --workdir holds checkpoints of a different model (model.rope_max_wavelength: checkpoint '
      f'10000.0 vs config 500000.0) in {tier.folder}. Resume with the config it was trained with, or use a fresh '
      '--workdir; nothing was changed.')
  assert 'Traceback' not in result.stderr and 'Compiling the train step' not in result.stderr
  assert _files(shm) == saved
