"""Preemption: on SIGTERM, save at the current step, wait for the save, log it and exit cleanly (code 0).

Two ways to learn of it:
- multi-process runs (and TPU pods), where `jax.distributed` is initialized:
  jax's preemption service catches SIGTERM on any process and agrees with the
  others on one step at which all of them save;
  `multihost_utils.reached_preemption_sync_point(step)` turns True there, on
  every process at once (it must be asked at every step, which the loop does);
- a single process: a Python SIGTERM handler sets a flag, read at the next step.
Either way the loop finishes the step in flight, saves it with the data
position, waits for the write, and returns; a relaunch resumes from that step.
"""

import signal
import threading

import jax
from jax.experimental import multihost_utils


class PreemptionWatch:
  """Answers `reached(step)`: should the run save at `step` and stop? Install once per run; `close()` after."""

  def __init__(self):
    self._flag = threading.Event()
    self._signal_name = None
    self._previous = None
    # With jax.distributed up, jax's preemption service (on by default) owns SIGTERM and syncs the processes.
    self._use_jax = jax.distributed.is_initialized() and jax.config.jax_enable_preemption_service
    if not self._use_jax and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_signal)

  def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
    self._signal_name = signal.Signals(signum).name
    self._flag.set()  # Only a flag: the loop saves at a step boundary, never inside a handler.

  def reached(self, step: int) -> bool:
    if self._use_jax:
      return multihost_utils.reached_preemption_sync_point(step)
    return self._flag.is_set()

  def describe(self) -> str:
    return self._signal_name or 'preemption notice (jax preemption sync point)'

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
