"""Preemption notices beyond SIGTERM: a notice file, or another signal, that makes the run save and stop.

Schedulers warn in different ways: SLURM sends a chosen signal some time before the
time limit (`sbatch --signal=USR2@120`), GKE runs a preStop hook within the pod's
terminationGracePeriodSeconds (which can touch a file), and some clusters write a
drain file on every node. `train.preemption_signals` names extra signals handled
like SIGTERM; `train.preemption_notice_file` names a file whose appearance (or a
change after this attempt started: a notice left from before a restart is not a
new one) means the same. The loop asks `reached()` each step, next to SIGTERM's
check (trainer/safety/preemption.py); the save that follows is timed from the notice.
"""

import os
import signal
import threading
import time

import jax

from trainer.supervision import settings

_POLL_EVERY_STEPS = 10  # A stat() of the notice file every 10 steps: nothing on the step's time.


def check_config(train) -> None:
  """One line for a signal name that is not one, or that the launcher uses for something else."""
  settings.check_preemption_signals(train.preemption_signals)


class Notices:
  """`reached(step)`: was a notice given? `describe()` names it and how long ago; `close()` restores handlers."""

  def __init__(self, signals: tuple[str, ...], notice_file: str | None):
    self._file = notice_file
    # With jax.distributed up, a notice becomes a SIGTERM to this process, which jax's preemption service syncs
    # across processes (as Ctrl-C does in trainer/safety/preemption.py); alone, `reached` answers directly.
    self._synced = jax.distributed.is_initialized() and jax.config.jax_enable_preemption_service
    self._started = time.time()
    self._given_at = None
    self._what = None
    self._previous = {}
    if threading.current_thread() is threading.main_thread():
      for name in signals:
        if name != 'SIGTERM':  # trainer/safety/preemption.py owns SIGTERM.
          sig = signal.Signals[name]
          self._previous[sig] = signal.signal(sig, self._on_signal)

  def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
    self._give(signal.Signals(signum).name)

  def _give(self, what: str) -> None:
    if self._given_at is not None:
      return
    self._given_at, self._what = time.monotonic(), what
    if self._synced:  # Every process must save at the same step: jax's preemption service agrees on it for SIGTERM.
      os.kill(os.getpid(), signal.SIGTERM)

  def reached(self, step: int) -> bool:
    if self._given_at is None and self._file and step % _POLL_EVERY_STEPS == 0:
      try:
        if os.stat(self._file).st_mtime >= self._started:
          self._give(f'notice file {self._file}')
      except OSError:
        pass
    return self._given_at is not None and not self._synced

  def describe(self) -> str:
    return f'{self._what} ({time.monotonic() - self._given_at:.1f}s ago)'

  def close(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
