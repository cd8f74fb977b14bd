"""Preemption: on SIGTERM, save at the current step, wait for the save, log it and exit cleanly (code 0).

Two ways to learn of it:
- multi-process runs (and TPU pods), where `jax.distributed` is initialized:
  jax's preemption service catches SIGTERM on any process and agrees with the
  others on one step at which all of them save;
  `multihost_utils.reached_preemption_sync_point(step)` turns True there, on
  every process at once (it must be asked at every step, which the loop does);
  outside the step loop (start-up, compile, and after the last step's check: the
  final eval and save) the launcher holds SIGTERM instead (trainer/safety/sigterm_handoff.py);
- a single process: a Python SIGTERM handler sets a flag, read at the next step.
Either way the loop finishes the step in flight, saves it with the data
position, waits for the write, and returns; a relaunch resumes from that step.

Ctrl-C (SIGINT) does the same, then launch.py exits with code 130 (128 +
SIGINT, what shells report for a process Ctrl-C stopped) and one line, so a
script can tell "interrupted, relaunch to continue" from "finished" (0). With
jax.distributed up, the handler turns SIGINT into a SIGTERM to this process, so
jax's preemption service syncs the save step across processes as for SIGTERM.
A second Ctrl-C exits at once (130); an interrupted save leaves only a tmp
folder, never a checkpoint that looks complete (trainer/training/checkpoint.py).
"""

import os
import signal
import sys
import threading

import jax
from jax.experimental import multihost_utils

from trainer.safety import sigterm_handoff, startup_signals


INTERRUPTED_EXIT_CODE = 130
_interrupted = threading.Event()  # Set once a Ctrl-C was honoured by saving; read by launch.py.


def interrupted_by_user() -> bool:
  """Whether the last run stopped because of Ctrl-C (after saving)."""
  return _interrupted.is_set()


class PreemptionWatch:
  """Answers `reached(step)`: should the run save at `step` and stop? Install once per run; `close()` after."""

  def __init__(self):
    self._flag = threading.Event()
    self._signal_name = None
    self._signum = None
    self._answered = False  # The loop saved for it; False with a signal set: it came during the final eval or save.
    self._previous = None
    # With jax.distributed up, jax's preemption service (on by default) owns SIGTERM in the loop and syncs the
    # processes; `_use_jax` turns False once the last step's check took SIGTERM back for the final eval and save.
    self._jax_service = jax.distributed.is_initialized() and jax.config.jax_enable_preemption_service
    self._use_jax = self._jax_service
    self._previous_int = None
    _interrupted.clear()
    self._previous_hup = None
    if threading.current_thread() is threading.main_thread():
      startup_signals.hand_over()  # These handlers answer the stop signals until close().
      if self._use_jax:
        self._previous = signal.getsignal(signal.SIGTERM)  # The launcher's handler (Python's view), for close().
        sigterm_handoff.hand_to_jax()
      else:
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
      self._previous_hup = signal.signal(signal.SIGHUP, self._on_hangup)
      self._previous_int = signal.signal(signal.SIGINT, self._on_interrupt)

  def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
    self._signal_name = signal.Signals(signum).name
    self._signum = signum
    self._flag.set()  # Only a flag: the loop saves at a step boundary, never inside a handler.

  def _on_hangup(self, signum, frame) -> None:
    if self._use_jax:
      self._signal_name = 'SIGHUP'
      os.kill(os.getpid(), signal.SIGTERM)  # jax's preemption service agrees on the step with every process.
    else:
      self._on_signal(signum, frame)

  def _on_interrupt(self, signum, frame) -> None:
    if _interrupted.is_set():
      print('launch.py: interrupted again (Ctrl-C): exiting now, without waiting for the save; the newest complete '
            'checkpoint is intact.', file=sys.stderr, flush=True)
      os._exit(INTERRUPTED_EXIT_CODE)
    _interrupted.set()
    print('Ctrl-C: saving the current step, then stopping (Ctrl-C again to exit at once).', file=sys.stderr,
          flush=True)
    if self._use_jax:
      os.kill(os.getpid(), signal.SIGTERM)  # jax's preemption service agrees on the step with every process.
    else:
      self._on_signal(signum, frame)

  def reached(self, step: int) -> bool:
    if self._jax_service:
      if not self._use_jax:  # A rollback re-entered the loop after its last step's check took SIGTERM back.
        self._hand_back_to_jax()
      return multihost_utils.reached_preemption_sync_point(step)
    self._answered = self._flag.is_set()
    return self._answered

  def done_checking(self) -> None:
    """The loop's last step was checked: a stop signal from now on is answered after the final eval and save."""
    if self._use_jax and threading.current_thread() is threading.main_thread():
      sigterm_handoff.take_back(self._on_signal)  # No sync point is asked after this one.
      self._use_jax = False

  def _hand_back_to_jax(self) -> None:
    sigterm_handoff.hand_to_jax()
    self._use_jax = True
    if self._flag.is_set():  # It came between: jax's service agrees on a step for it with the other processes.
      self._flag.clear()
      os.kill(os.getpid(), signal.SIGTERM)

  def unanswered(self) -> int | None:
    """The stop signal that came after the last step's check (during the final eval or save), if one did."""
    return self._signum if self._flag.is_set() and not self._answered else None

  def describe(self) -> str:
    return self._signal_name or 'preemption notice (SIGTERM via jax\'s preemption sync point)'

  def close(self) -> None:
    if self._previous is not None:
      if self._jax_service:
        sigterm_handoff.take_back(self._previous)  # Out of the loop: the launcher's handler again, over jax's.
      else:
        signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
    if self._previous_int is not None:
      signal.signal(signal.SIGINT, self._previous_int)
      self._previous_int = None
    if self._previous_hup is not None:
      signal.signal(signal.SIGHUP, self._previous_hup)
      self._previous_hup = None
      startup_signals.take_back()
