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
comes at once even while the main thread sits in a long C++ call. Whoever takes the
stop signals over for a while (launch.py's supervisor, the step loop) does it between
`hand_over()` and `take_back()`, which keep the pipe shut meanwhile: the C-level handler
writes a byte for every signal, whoever's Python handler answers it, and a watcher that
read the supervisor's byte only after the supervisor had put these handlers back (a
loaded machine, the child already stopped with its own line) printed a second line.

A launch started by the supervisor starts with its stop signals blocked (the
supervisor blocks them while it spawns it); `install_early()` unblocks them once its
handlers are in, so a signal forwarded while the child still started Python waits for
them (it was a KeyboardInterrupt traceback, or a SIGTERM that killed without a word).

A SIGUSR1 (a profile request; `pkill -USR1` on a pod reaches workers still
compiling), which would otherwise kill the process, is kept for
trainer/observe/profiling.py to trace the first steps. This module imports nothing heavy,
so it is in place within a second of start.

The tools of scripts/ (eval.py, sample.py, export_hf.py, export_params.py) call `install_for_tool(name)` as their
first import, for the same reasons: Ctrl-C printed 26-79 lines of KeyboardInterrupt traceback, a jax gc callback once
swallowed it (the export went on and exited 0), and SIGTERM or SIGHUP ended them without a word. Their line names
the tool; what they were writing sits under a temporary name (trainer/safety/tool_outputs.py), removed here on the
way out (and by the next run if a kill -9 left it).

In a multi-process run the processes stop together: one stopping here first tells
its peers over the watchdog's connections (parallel/watchdog.py), and each peer
stops at once with the same exit code and a line naming the process that received
the signal. A group-wide preemption reaches the hosts a little apart; without this
a survivor whose own signal was still on its way called the first one lost.
"""

import os
import signal
import threading

from parallel import watchdog
from trainer.supervision import attempt

_profile_requested_early = threading.Event()  # A SIGUSR1 before the profiler's handler: trace from the first step.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
# The handler and the watcher may both see one signal, and the watchdog may report a loss: one line only.
_stopping = watchdog.EXITING
_program = 'launch.py'  # Who the line names: launch.py, or the tool that called install_for_tool.
_before_exit: list = []  # A tool's cleanups (its partial output removed), run before os._exit.
_wakeup_fd: int | None = None  # The watcher's pipe, once installed; shut (-1) between hand_over() and take_back().


class OutsideTheLoop(BaseException):
  """A stop signal the step loop took but could not answer by saving (it came during the final eval or save).

  `kept` says what is on disk; launch.py prints it in one line and exits 128 + signum.
  """

  def __init__(self, signum: int, kept: str = ''):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum
    self.kept = kept


def message(signum: int, kept: str = '', by: str = '') -> str:
  """The one line for a stop signal outside the step loop; `by` names the peer that received it, if not this process."""
  name = signal.Signals(signum).name
  what = 'Ctrl-C (SIGINT)' if signum == signal.SIGINT else name
  if _program != 'launch.py':
    kept = kept or 'Nothing partial is left under its output name; run the same command again.'
    return f'{_program}: interrupted: {what} received: stopped (exit {128 + signum}). {kept}'
  kept = kept or ('No step of this launch was left unsaved by it; every checkpoint complete on disk is intact (a save '
                  'it cut short stays an incomplete folder that a relaunch skips). Relaunch the same command to '
                  'continue.')
  where = 'outside the step loop (while starting, compiling or closing)'
  if by:
    return f'launch.py: interrupted: {what} received {where} by {by}: this process stopped with it. {kept}'
  return f'launch.py: interrupted: {what} received {where}: stopped. {kept}'


def stop_now(signum: int, origin: int | None = None, num_processes: int = 1) -> None:
  """Writes the one line, tells the peers, and ends the process at once with 128 + signum (no interpreter shutdown).

  `origin`: the peer that received the signal, when this process stops with it.
  """
  if not _stopping.acquire(blocking=False):
    return  # The other path is already writing the line.
  try:
    by = ''
    if origin is not None:
      by = f'{"process 0 (the coordinator)" if origin == 0 else f"process {origin}"} of {num_processes}'
    for cleanup in _before_exit:
      try:
        cleanup()
      except Exception:  # pylint: disable=broad-except  (what it leaves, the next run removes)
        pass
    os.write(2, (message(signum, by=by) + '\n').encode())  # Not print(): the main thread may hold sys.stderr's lock.
    watchdog.announce_stop(signum, origin)
  finally:
    os._exit(128 + signum)


def _peer_stopped(origin: int, num_processes: int, signum: int) -> None:
  stop_now(signum, origin, num_processes)


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
  if not _install_stop_handlers():
    return
  watchdog.on_peer_stop(_peer_stopped)
  signal.signal(signal.SIGUSR1, lambda signum, frame: _profile_requested_early.set())
  # Every handler a launch has is in: what its supervisor held back while it spawned this process is delivered now.
  # Those alone (the supervisor names them): a signal its user blocked on purpose stays blocked.
  held = [int(s) for s in os.environ.pop(attempt.HELD_SIGNALS_ENV, '').split(',') if s.isdigit()]
  if held:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def hand_over() -> None:
  """Before another handler takes a stop signal over (the supervisor, the step loop): the watcher is given no
  signal until `take_back()`, so one that handler answered is never answered here too."""
  if _wakeup_fd is not None and threading.current_thread() is threading.main_thread():
    signal.set_wakeup_fd(-1)


def take_back() -> None:
  """After these handlers were put back: the watcher answers a stop signal again, also inside C++."""
  if _wakeup_fd is not None and threading.current_thread() is threading.main_thread():
    signal.set_wakeup_fd(_wakeup_fd, warn_on_full_buffer=False)


def install_for_tool(program: str) -> None:
  """First thing in a tool of scripts/, before its heavy imports: SIGTERM, SIGHUP and SIGINT end it in every phase
  (importing, loading, compiling, running, writing) with one line naming `program`, and exit 128 + the signal."""
  global _program
  _program = program
  _install_stop_handlers()


def on_stop(cleanup) -> None:
  """Runs `cleanup()` (quick, best effort) before a stop signal ends a tool: its partial output is removed."""
  _before_exit.append(cleanup)


def _install_stop_handlers() -> bool:
  """The handlers, and the watcher thread for a signal that comes while the main thread is inside C++."""
  global _wakeup_fd
  if threading.current_thread() is not threading.main_thread():
    return False
  read_fd, write_fd = os.pipe()
  os.set_blocking(write_fd, False)  # set_wakeup_fd's requirement: a full pipe must never block a handler.
  signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
  _wakeup_fd = write_fd
  threading.Thread(target=_watch, args=(read_fd,), daemon=True, name='stop-signal-watch').start()
  for sig in STOP_SIGNALS:
    signal.signal(sig, _on_stop_signal)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # Blocked by a supervisor that spawned this process.
  return True


def profile_requested_early() -> bool:
  return _profile_requested_early.is_set()
