"""The local checkpoint tier in-process (trainer/training/local_tier.py): a bit-exact round trip, which step a
restart takes when hosts are lost, and a local folder that cannot be written (one line, the run goes on).
The two-process kill -9 runs are tests/test_local_tier_multiprocess.py."""

import errno
import logging as std_logging
import os

import jax
import numpy as np
import pytest

from trainer.training import local_tier


def _state(scale=1.0):
  mesh = jax.make_mesh((2, 4), ('data', 'fsdp'))

  def put(value, *spec):
    return jax.device_put(value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))
  return {'w': put(np.arange(64, dtype=np.float32).reshape(8, 8) * scale, 'data', 'fsdp'),
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
    tier.save(step, _state(step), {'position': step})
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
  tier.save(2, _state(), {'position': 2})
  tier.wait_until_finished()
  real = local_tier._write_npz

  def full(path, arrays):
    real(path, arrays)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
  monkeypatch.setattr(local_tier, '_write_npz', full)
  tier.save(4, _state(), {'position': 4})
  tier.save(6, _state(), {'position': 6})  # Waits for 4's write, which failed: said once, then off.
  tier.wait_until_finished()
  [line] = warnings()
  assert line.startswith(f'the local tier in {tier.folder} could not be written (No space left on device: ') and (
      'going on with the persistent tier alone' in line)
  assert not tier.enabled and tier.steps() == [2] and sorted(p.name for p in tier.folder.iterdir()) == ['2']


def _held(monkeypatch, tier_count, held):
  """Makes `newest` see what each process says it holds: {process: (own steps, peer-copy steps)}."""
  rows = np.full((tier_count, 2, local_tier._SLOTS), -1, np.int64)
  for p, (own, peer) in held.items():
    rows[p, 0, :len(own)], rows[p, 1, :len(peer)] = own, peer
  monkeypatch.setattr(local_tier.multihost_utils, 'process_allgather', lambda _: rows)


def test_a_lost_host_is_restored_from_its_peer_and_one_whose_peer_is_lost_too_from_the_persistent_tier(
    tmp_path, monkeypatch):
  tier = local_tier.LocalTier(str(tmp_path), 2, '/w', 0, 1)
  tier._count = 3  # The decision only: what three processes would say.
  _held(monkeypatch, 3, {0: ([36, 34], [36, 34]), 1: ([], []), 2: ([36, 34], [36])})  # Process 1's host is new.
  assert tier.newest(_abstract(_state()), newer_than=0) == (local_tier.Found(36, (1,)), '')
  _held(monkeypatch, 3, {0: ([36, 34], []), 1: ([], []), 2: ([36, 34], [36])})  # Process 0 lost its copy of 1's.
  found, why = tier.newest(_abstract(_state()), newer_than=0)
  assert found is None and why == ("the local tier holds no complete step (its newest, 36, lacks the shards of "
                                   "process(es) [1]: neither their own folder nor their peer's copy on process(es) "
                                   "[0] has them; both hosts lost)")
  _held(monkeypatch, 3, {0: ([36, 34], [36, 34]), 1: ([34], [34]), 2: ([36, 34], [36, 34])})  # 1 died writing 36.
  assert tier.newest(_abstract(_state()), newer_than=0) == (local_tier.Found(36, (1,)), '')
  assert tier.newest(_abstract(_state()), newer_than=50)[0] is None  # The persistent tier's 50 is newer.


def test_start_over_moves_the_local_steps_aside_and_keeps_them(tmp_path):
  tier = local_tier.LocalTier(str(tmp_path), 2, '/w', 0, 1)
  tier.save(2, _state(), {'position': 2})
  tier.wait_until_finished()
  tier.set_aside()
  [kept] = [p for p in tier.folder.parent.iterdir() if '.previous_run_' in p.name]
  assert (kept / '2' / 'own.npz').is_file() and tier.steps() == [] and tier.folder.is_dir()
