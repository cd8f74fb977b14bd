"""Signals that reach a launch outside its step loop: one line and exit 128 + the signal, within a second.

launch.py calls `install_early()` first thing, before jax loads. Until the step
loop installs its own handlers (trainer/safety/preemption.py), and again once it restored
them, SIGTERM, SIGHUP (a closed terminal or SSH session) and SIGINT (Ctrl-C) end the
launch with one line and exit code 128 + the signal: no step of this launch was
trained yet, or every one was already saved, so nothing is lost.

Why the process ends with `os._exit` from here rather than an exception:
- an exception raised by a handler lands wherever the main thread happens to be:
  inside an import (numpy turned it into an ImportError with two tracebacks), in a
  gc callback (printed as "Exception ignored" and lost: the launch went on), or
  after a C++ call returns (a compile can take minutes);
- a normal interpreter shutdown while XLA's compile threads are live crashed
  (SIGSEGV about 20 s after the line, exit 139; issue 39). `os._exit` runs no
  shutdown: the kernel closes the files and drops the workdir lock (a flock).
Python runs a handler only between bytecodes of the main thread, so a watcher thread
also reads the signal numbers the C-level handler writes to a wakeup pipe: the line
comes at once even while the main thread sits in a long C++ call.

A SIGUSR1 (a profile request; `pkill -USR1` on a pod reaches workers still
compiling), which would otherwise kill the process, is kept for
trainer/observe/profiling.py to trace the first steps. This module imports nothing heavy,
so it is in place within a second of start.
"""

import os
import signal
import threading

_profile_requested_early = threading.Event()  # A SIGUSR1 before the profiler's handler: trace from the first step.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_stopping = threading.Lock()  # The handler and the watcher may both see one signal: one line only.


class OutsideTheLoop(BaseException):
  """A stop signal the step loop took but could not answer by saving (it came during the final eval or save).

  `kept` says what is on disk; launch.py prints it in one line and exits 128 + signum.
  """

  def __init__(self, signum: int, kept: str = ''):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum
    self.kept = kept


def message(signum: int, kept: str = '') -> str:
  """The one line for a stop signal outside the step loop."""
  name = signal.Signals(signum).name
  what = 'Ctrl-C (SIGINT)' if signum == signal.SIGINT else name
  kept = kept or ('No step of this launch was left unsaved by it; every checkpoint complete on disk is intact (a save '
                  'it cut short stays an incomplete folder that a relaunch skips). Relaunch the same command to '
                  'continue.')
  return (f'launch.py: interrupted: {what} received outside the step loop (while starting, compiling or closing): '
          f'stopped. {kept}')


def stop_now(signum: int) -> None:
  """Writes the one line and ends the process at once with 128 + signum (no interpreter shutdown)."""
  if not _stopping.acquire(blocking=False):
    return  # The other path is already writing the line.
  try:
    os.write(2, (message(signum) + '\n').encode())  # Not print(): the main thread may hold sys.stderr's lock.
  finally:
    os._exit(128 + signum)


def _on_stop_signal(signum, frame) -> None:  # noqa: ARG001
  stop_now(signum)


def _watch(read_fd: int) -> None:
  """Acts on a stop signal while the main thread is inside C++ (a compile), where no Python handler can run."""
  while True:
    try:
      received = os.read(read_fd, 64)
    except OSError:
      return
    if not received:
      return
    for signum in received:
      if signum in STOP_SIGNALS and signal.getsignal(signum) is _on_stop_signal:
        stop_now(signum)


def install_early() -> None:
  """First thing in launch.py, before jax loads: no signal that a run handles can kill it without a word.

  Until the step loop installs its own handlers (and again after it closed them),
  SIGTERM, SIGHUP and SIGINT stop the launch with one line, and SIGUSR1 asks for a
  profile of the first steps (trainer/observe/profiling.py).
  """
  if threading.current_thread() is not threading.main_thread():
    return
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)  # set_wakeup_fd's requirement: a full pipe must never block a handler.
  signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  threading.Thread(target=_watch, args=(read_fd,), daemon=True, name='stop-signal-watch').start()
  for sig in STOP_SIGNALS:
    signal.signal(sig, _on_stop_signal)
  signal.signal(signal.SIGUSR1, lambda signum, frame: _profile_requested_early.set())


def profile_requested_early() -> bool:
  return _profile_requested_early.is_set()
