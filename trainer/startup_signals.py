"""Signals that reach a launch before (or after) its step loop: never a silent death.

launch.py calls `install_early()` first thing, before jax loads. Until the step
loop installs its own handlers (trainer/preemption.py), and again once it restored
them, SIGTERM and SIGHUP (a closed terminal or SSH session) raise `OutsideTheLoop`,
which launch.py turns into one line and exit code 128 + the signal: no step of this
launch was trained yet, or every one was already saved, so nothing is lost. A SIGUSR1
(a profile request; `pkill -USR1` on a pod reaches workers still compiling), which
would otherwise kill the process, is kept for trainer/profiling.py to trace the first
steps. This module imports nothing heavy, so it is in place within a second of start.
"""

import signal
import threading

_profile_requested_early = threading.Event()  # A SIGUSR1 before the profiler's handler: trace from the first step.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class OutsideTheLoop(BaseException):
  """A SIGTERM or SIGHUP while no step loop could save (start-up, compile, closing): launch.py says so in one line."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


def _raise_outside_the_loop(signum, frame) -> None:  # noqa: ARG001
  raise OutsideTheLoop(signum)


def install_early() -> None:
  """First thing in launch.py, before jax loads: no signal that a run handles can kill it with no word.

  Until the step loop installs its own handlers (and again after it closed them),
  SIGTERM and SIGHUP stop the launch with one line (nothing of this launch was
  trained, so nothing is lost), and SIGUSR1, which would otherwise kill the process,
  asks for a profile of the first steps (trainer/profiling.py), as `pkill -USR1` on
  a pod reaches workers still compiling.
  """
  if threading.current_thread() is not threading.main_thread():
    return
  for sig in STOP_SIGNALS:
    signal.signal(sig, _raise_outside_the_loop)
  signal.signal(signal.SIGUSR1, lambda signum, frame: _profile_requested_early.set())


def profile_requested_early() -> bool:
  return _profile_requested_early.is_set()
