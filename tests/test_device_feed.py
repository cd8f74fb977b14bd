"""The device feed (trainer/data/device_feed.py): batches reach the devices ahead of the step that reads them, and
the checkpointed data position counts only the batches handed to steps."""

import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from configs import tiny
from trainer import data


@pytest.fixture(scope='module')
def shardings():
  rows = NamedSharding(Mesh(np.array(jax.devices()), ('data',)), PartitionSpec('data'))
  return {'inputs': rows, 'targets': rows}


class _CountingHost:
  """Numbered host batches; records how many were pulled, and can fail at one of them."""

  def __init__(self, fail_at: int | None = None):
    self.pulled, self.fail_at, self.lock = 0, fail_at, threading.Lock()

  def __iter__(self):
    return self

  def __next__(self):
    with self.lock:
      self.pulled += 1
      if self.pulled == self.fail_at:
        raise OSError('disk went away')
      return {'inputs': np.full((8, 4), self.pulled, np.int32), 'targets': np.zeros((8, 4), np.int32)}


def _wait_for(condition, timeout_s: float = 10.0) -> bool:
  end = time.monotonic() + timeout_s
  while time.monotonic() < end:
    if condition():
      return True
    time.sleep(0.01)
  return False


def test_the_next_batches_are_on_the_devices_before_the_loop_asks(shardings):
  host = _CountingHost()
  feed = data.DeviceFeed(host, shardings, process_count=1, depth=2)
  first = next(feed)
  feed.release()  # As the loop does once the first step has run.
  # Without another next(): batch 1 handed out, batches 2 and 3 already read and placed; no further ones.
  assert _wait_for(lambda: host.pulled == 3)
  time.sleep(0.2)
  assert host.pulled == 3
  assert isinstance(first['inputs'], jax.Array) and first['inputs'].sharding == shardings['inputs']
  assert [int(next(feed)['inputs'][0, 0]) for _ in range(4)] == [2, 3, 4, 5]  # In order, none lost.
  assert int(first['inputs'][0, 0]) == 1
  feed.close()


def test_a_read_error_in_the_thread_is_raised_by_the_loops_next(shardings):
  feed = data.DeviceFeed(_CountingHost(fail_at=3), shardings, process_count=1)
  next(feed), next(feed)
  for _ in range(2):  # Raised again on a second call, not a hang.
    with pytest.raises(OSError, match='disk went away'):
      next(feed)
  feed.close()


def _train_iterator():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, size=20_000, dtype=np.uint8)
  docs = data.documents.InMemoryDocuments(tokens, np.array([0, 7_000, 13_000]), 'test')
  return data.train_iterator(data.StreamWindows(docs, seq_len=32), tiny.get_config().data, 8, 0, 0, 1)


def test_the_position_counts_batches_handed_out_not_read_ahead_and_restoring_rewinds(shardings):
  host = _train_iterator()
  feed = data.DeviceFeed(host, shardings, process_count=1)
  feed.release()
  for _ in range(3):
    next(feed)
  assert _wait_for(lambda: host.get_state()['examples_consumed'] == 5 * 8)  # Two batches read ahead...
  state = feed.get_state()
  assert state['examples_consumed'] == 3 * 8  # ...but the checkpoint names the three the steps took.
  later = [np.asarray(next(feed)['inputs']) for _ in range(3)]
  feed.set_state(state)  # As a restore or a rollback does: the read-ahead batches are dropped.
  assert feed.get_state() == state
  again = [np.asarray(next(feed)['inputs']) for _ in range(3)]
  assert all(np.array_equal(a, b) for a, b in zip(later, again))
  uninterrupted = _train_iterator()
  expected = [next(uninterrupted)['inputs'] for _ in range(6)][3:]  # Batches 4..6 of a run that never read ahead.
  assert all(np.array_equal(a, b) for a, b in zip(later, expected))
  feed.close()


class _Outputs:
  """A step's outputs that take `seconds` to compute; records how many transfers had started by then."""

  def __init__(self, seconds: float, transfers: list):
    self.done, self.transfers, self.transfers_when_done = threading.Event(), transfers, None
    threading.Timer(seconds, self._finish).start()

  def _finish(self):
    self.transfers_when_done = len(self.transfers)
    self.done.set()

  def block_until_ready(self):
    self.done.wait()
    return self


@pytest.fixture
def transfers(monkeypatch):
  """Every transfer the feed starts, in order (trainer/data/device_feed.py's call of `to_global`)."""
  from trainer.data import device_feed
  started = []
  real = device_feed.to_global

  def recording(*args, **kwargs):
    started.append(time.monotonic())
    return real(*args, **kwargs)

  monkeypatch.setattr(device_feed, 'to_global', recording)
  return started


def test_no_transfer_while_the_first_step_runs_then_the_feed_reads_ahead(shardings, transfers):
  host = _CountingHost()
  feed = data.DeviceFeed(host, shardings, process_count=1, depth=2)
  first = next(feed)  # The first step's batch.
  outputs = _Outputs(0.5, transfers)  # The first step, running for half a second.
  feed.release_after(outputs)  # Returns once the step is done.
  assert outputs.done.is_set() and outputs.transfers_when_done == 1
  assert _wait_for(lambda: len(transfers) == 3)  # Released: two batches ahead, as before.
  assert int(first['inputs'][0, 0]) == 1 and [int(next(feed)['inputs'][0, 0]) for _ in range(3)] == [2, 3, 4]
  feed.close()


def test_a_held_feed_transfers_only_what_the_loop_waits_for(shardings, transfers):
  host = _CountingHost()
  feed = data.DeviceFeed(host, shardings, process_count=1, depth=2)
  feed.release()
  next(feed)
  assert _wait_for(lambda: len(transfers) == 3)
  feed.hold()  # As before an eval: no transfer in flight once hold() returns, none started after.
  held_at = len(transfers)
  time.sleep(0.3)
  assert len(transfers) == held_at
  # Two batches were already on the devices: handed out without a transfer; the third is made on demand only.
  assert [int(next(feed)['inputs'][0, 0]) for _ in range(3)] == [2, 3, 4]
  assert len(transfers) == held_at + 1
  time.sleep(0.3)
  assert len(transfers) == held_at + 1
  feed.release()
  assert _wait_for(lambda: len(transfers) == held_at + 3)
  feed.close()


def test_a_run_transfers_nothing_while_its_first_step_or_an_eval_runs(tmp_path, monkeypatch, transfers):
  """The loop (trainer/run/loop.py) releases the feed only with step 1's outputs computed, and holds it during evals."""
  from trainer.run import evaluation, loop
  from trainer.data import device_feed
  events = []
  real_release_after, real_evaluate = device_feed.DeviceFeed.release_after, evaluation.held_out

  def release_after(feed, outputs):
    real_release_after(feed, outputs)
    events.append(('first step done', len(transfers),
                   all(x.is_ready() for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array))))

  def evaluate(*args):
    before = len(transfers)
    summary = real_evaluate(*args)
    events.append(('eval', before, len(transfers)))
    return summary

  monkeypatch.setattr(device_feed.DeviceFeed, 'release_after', release_after)
  monkeypatch.setattr(evaluation, 'held_out', evaluate)
  config = tiny.get_config()
  config.train.steps, config.train.eval_every_steps = 6, 3
  loop.run(config, str(tmp_path / 'run'))
  assert events[0] == ('first step done', 1, True)  # Only step 1's own batch went over before it finished.
  assert [e[0] for e in events[1:]] == ['eval', 'eval']
  assert all(before == after for _, before, after in events[1:])
  assert len(transfers) >= 6


class _SlowHost(_CountingHost):
  """A pipeline slower than its consumer: every batch takes `delay_s` to read."""

  def __init__(self, delay_s: float):
    super().__init__()
    self.delay_s = delay_s

  def __next__(self):
    time.sleep(self.delay_s)
    return super().__next__()


def test_the_feed_says_whether_the_batches_were_ready_when_asked_for(shardings):
  fast = data.DeviceFeed(_CountingHost(), shardings, process_count=1, depth=2)
  next(fast)
  fast.release()
  assert fast.ready_share() == 0.0  # The first batch is read only once asked for.
  for _ in range(5):
    assert _wait_for(lambda: fast._queued == 2)  # A step long enough for the feed to fill up.
    next(fast)
  assert fast.ready_share() == 1.0
  assert fast.ready_share() is None  # Counted since the last call.
  fast.close()
  slow = data.DeviceFeed(_SlowHost(0.1), shardings, process_count=1, depth=2)
  next(slow)
  slow.release()
  slow.ready_share()
  for _ in range(4):
    next(slow)  # Asked for at once: the pipeline is the bottleneck.
  assert slow.ready_share() <= 0.25
  slow.close()
