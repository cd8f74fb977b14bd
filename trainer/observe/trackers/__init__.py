"""Experiment trackers beside TensorBoard and metrics.jsonl: Weights & Biases and MLflow (`log.trackers`).

metrics.jsonl and TensorBoard stay the source of truth; a tracker gets a copy of the same records under the same
names as TensorBoard's tags (train/loss, eval/loss, goodput/...), the resolved config (as the run's config or
parameters, and as text), the run's name and the goodput table. Only process 0 writes.

Training never waits on a tracker: every call here only puts an event on a bounded queue that one background
thread drains, where each tracker is started (its login, its first request) and written. A tracker that fails,
cannot be reached, or falls a queue behind is named in one warning and dropped; the run goes on. At close the
thread gets log.tracker_close_timeout_s to send what is left.
"""

import queue
import threading
from collections.abc import Callable

from absl import logging

from trainer.base import storage
from trainer.base.errors import UserError

CHOICES = ('wandb', 'mlflow')
QUEUE_EVENTS = 10_000  # Logged steps (~30 scalars each) a tracker may lag behind before its events are dropped.


def tag(key: str) -> str:
  """A metrics.jsonl key as TensorBoard names it (trainer/observe/metrics.py): 'eval_loss' -> 'eval/loss', 'loss' ->
  'train/loss'; goodput keys keep their 'goodput/' prefix."""
  if key.startswith('goodput/'):
    return key
  return f'eval/{key[len("eval_"):]}' if key.startswith('eval_') else f'train/{key}'


def _builders() -> dict[str, Callable]:
  from trainer.observe.trackers import mlflow_tracker, wandb_tracker
  return {'wandb': wandb_tracker.WandbTracker, 'mlflow': mlflow_tracker.MlflowTracker}


def check(log_config) -> None:
  """log.trackers names known trackers whose package is installed: checked before the compile."""
  import importlib.util
  names = tuple(log_config.get('trackers', ()))
  unknown = [n for n in names if n not in CHOICES]
  if unknown:
    raise UserError(f'log.trackers={names}: unknown {unknown}; choose from {CHOICES} (TensorBoard and metrics.jsonl '
                    f'are always written).')
  packages = {'wandb': 'wandb', 'mlflow': 'mlflow'}
  for name in names:
    if importlib.util.find_spec(packages[name]) is None:
      pip = 'wandb' if name == 'wandb' else 'mlflow-skinny'
      raise UserError(f'log.trackers includes {name!r} but the {packages[name]} package is not installed: '
                      f'pip install {pip} (requirements-test.txt pins a version), or leave it out of log.trackers.')


class Trackers:
  """The run's trackers behind one queue and one thread; every method returns at once."""

  def __init__(self, log_config, workdir: str, enabled: bool):
    names = tuple(log_config.get('trackers', ())) if enabled else ()
    self._names = names
    self._close_timeout_s = float(log_config.get('tracker_close_timeout_s', 60.0))
    self._run_name = log_config.get('run_name') or storage.path(workdir).name
    self._settings, self._workdir = log_config, workdir
    self._queue: queue.Queue = queue.Queue(QUEUE_EVENTS)
    self._warned: set[str] = set()
    self._thread = None
    if names:
      self._thread = threading.Thread(target=self._drain, name='trackers', daemon=True)
      self._thread.start()

  def _warn_once(self, name: str, message: str) -> None:
    if name not in self._warned:
      self._warned.add(name)
      logging.warning('Tracker %s: %s. The run goes on without it (metrics.jsonl and TensorBoard have everything).',
                      name, message)

  def _put(self, event: tuple) -> None:
    if self._thread is None:
      return
    try:
      self._queue.put_nowait(event)
    except queue.Full:
      for name in self._names:
        self._warn_once(name, f'{QUEUE_EVENTS} events behind (too slow or unreachable); later events are dropped')

  def start(self, config_dict: dict, config_text: str) -> None:
    """Opens every tracker's run with the resolved config."""
    self._put(('start', config_dict, config_text))

  def log(self, step: int, record: dict[str, float]) -> None:
    """One metrics.jsonl record (its 'step' key aside), under TensorBoard's names."""
    self._put(('log', step, {tag(k): v for k, v in record.items() if k != 'step'}))

  def goodput(self, step: int, summary: dict[str, float], table: str) -> None:
    self._put(('goodput', step, {f'goodput/{k}': v for k, v in summary.items()}, table))

  def close(self) -> None:
    """Finishes every tracker's run, waiting at most log.tracker_close_timeout_s."""
    if self._thread is None:
      return
    self._put(('close',))
    self._thread.join(self._close_timeout_s)
    if self._thread.is_alive():
      for name in self._names:
        self._warn_once(name, f'not done {self._close_timeout_s:.0f}s after the run ended '
                              f'(log.tracker_close_timeout_s); what it had not sent is lost')
    self._thread = None

  def _drain(self) -> None:
    live = {}
    while True:
      event = self._queue.get()
      kind = event[0]
      if kind == 'start':
        for name in self._names:
          try:
            live[name] = _builders()[name](self._settings, self._workdir, self._run_name, event[1], event[2])
          except Exception as e:  # pylint: disable=broad-except
            self._warn_once(name, f'could not start ({type(e).__name__}: {" ".join(str(e).split())[:300]})')
        continue
      for name, tracker in list(live.items()):
        try:
          if kind == 'log':
            tracker.log(event[1], event[2])
          elif kind == 'goodput':
            tracker.goodput(event[1], event[2], event[3])
          elif kind == 'close':
            tracker.close()
        except Exception as e:  # pylint: disable=broad-except
          self._warn_once(name, f'failed to write ({type(e).__name__}: {" ".join(str(e).split())[:300]})')
          del live[name]
      if kind == 'close':
        return


def build(log_config, workdir: str, enabled: bool) -> Trackers:
  """The run's trackers (none unless log.trackers names some and `enabled`: process 0); checked before a compile."""
  check(log_config)
  return Trackers(log_config, workdir, enabled)
