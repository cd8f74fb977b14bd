"""A lost peer in a multi-process launch: every survivor exits in one line naming it, not a C++ abort.

Without this, when one process of a hand-started run dies, the others block in
their next collective until jax's coordination service misses its heartbeats
(about 100 s), then abort with exit 134 and a C++ stack trace; when process 0
(which hosts that service) dies, the others abort at once without a word.

Each process keeps one TCP connection to process 0 for the whole run (process 0
listens on a free port it announced during the check-in, or in a launch jax's
detection joined through jax's key-value store, parallel/distributed.py)
and both ends send a heartbeat line every HEARTBEAT_S seconds:
- a connection that closes (the process died: the kernel closes its sockets,
  kill -9 included) is a loss at once; silence for SILENT_AFTER_S seconds (a
  stopped or wedged process) is a loss too;
- process 0 tells every other process which process it lost, then exits;
  the others, on that message or on losing process 0 itself, exit;
- a process that finishes normally says `bye` first, so it is never reported;
- a process stopping on a signal outside its step loop (trainer/safety/startup_signals.py)
  says `stopping N K` first (signal N, received by process K): the survivors stop with it and name the signal, not a
  loss (a group-wide preemption during compile reaches the processes a little
  apart, and a survivor whose own signal was still on its way called the first
  process to stop lost).
Every survivor prints `<launcher>: error: process K of N ... was lost ...` and
exits with PEER_LOST_EXIT_CODE. A collective that fails because its peer is
gone raises in the main thread at the same moment; `grace()` lets launch.py
give the watchdog a few seconds to name the lost process before that error
would be shown as a bug.

A race left open: when process 0 dies, jax's coordination client on each
survivor polls an error from the lost service and may abort the interpreter
(C++, exit 134) before the watchdog's line; in 3 of 3 runs here the line came
first (BENCHMARKS.md). Its `missed_heartbeat_callback` cannot be used to close
the race in jax 0.10.2: passing a Python callable made the survivor die of
`std::bad_cast` when it was called.
"""

import atexit
import os
import pathlib
import socket
import sys
import threading
import time

HEARTBEAT_S = 2
SILENT_AFTER_S = 20
# 75 is EX_TEMPFAIL in sysexits.h ("try again later"): a scheduler may relaunch; 2 stays "fix the config".
PEER_LOST_EXIT_CODE = 75
# One line per process: a loss reported here or a stop signal's (trainer/safety/startup_signals.py takes this lock
# too), whichever comes first; the other path then says nothing.
EXITING = threading.Lock()
_watching = threading.Event()
GRACE_S = 5
# The same connections carry reports to process 0 (trainer/supervision/stragglers.py): `stat ...` lines.
_to_coordinator: list['_Line'] = []
_on_report = None
_lines: list['_Line'] = []  # Every connection this process holds: to process 0, or (process 0) to each other one.
_on_peer_stop = None
_process_index = None
# How long a stopping process gives its `stopping` line to leave the host before os._exit closes the sockets.
_SEND_BEFORE_EXIT_S = 0.1


def report(line: str) -> None:
  """Processes 1..N-1: sends one line to process 0's report callback; a no-op where no peers are watched."""
  for line_to_0 in _to_coordinator:
    line_to_0.send(line)


def on_report(callback) -> None:
  """Process 0: `callback(process, line)` receives each line other processes `report()`."""
  global _on_report
  _on_report = callback


def on_peer_stop(callback) -> None:
  """`callback(origin, num_processes, signum)` ends this process: process `origin` received stop signal `signum`."""
  global _on_peer_stop
  _on_peer_stop = callback


def announce_stop(signum: int, origin: int | None = None) -> None:
  """Tells every watched peer this process stops now on `signum`, received by process `origin` (default: this one).

  It ends with os._exit, so no `bye` follows; the line names the process that received the signal, so that a process
  stopping with a peer passes on who that was.
  """
  origin = _process_index if origin is None else origin
  for line in _lines:
    line.finished = True  # Its own reader then takes the closing connection as expected.
    line.send(f'stopping {signum} {origin}', timeout=1)
    try:
      line.conn.shutdown(socket.SHUT_WR)
    except OSError:
      pass
  if _lines:
    time.sleep(_SEND_BEFORE_EXIT_S)


def _peer_stopped(message: str, num_processes: int) -> None:
  """`stopping N K` from a peer: process K received signal N and stopped."""
  _, signum, origin = message.split()
  if _on_peer_stop is not None:
    _on_peer_stop(int(origin), num_processes, int(signum))  # Returns only when this process is already ending.
    return
  _die(_lost(int(origin), num_processes, f'it stopped on signal {signum}'))


def grace() -> None:
  """If peers are watched, waits GRACE_S seconds: a lost peer is then reported (and the process ended) by the watchdog."""
  if _watching.is_set():
    time.sleep(GRACE_S)


def _die(message: str) -> None:
  """Prints the one line and ends this process now: its collectives can never complete."""
  if not EXITING.acquire(blocking=False):
    return  # Another thread is already reporting.
  print(f'{pathlib.Path(sys.argv[0]).name}: error: {message}', file=sys.stderr, flush=True)
  os._exit(PEER_LOST_EXIT_CODE)


def _lost(process: int, num_processes: int, how: str) -> str:
  who = 'process 0 (the coordinator)' if process == 0 else f'process {process}'
  return (f'{who} of {num_processes} was lost ({how}); this run cannot continue without it. Stopped; relaunch every '
          f'process with the same command to resume from the last checkpoint.')


class _Line:
  """One heartbeat connection: a writer thread sending `beat`, a reader thread watching the other end."""

  def __init__(self, conn: socket.socket, peer: int, num_processes: int, on_message):
    self.conn, self.peer, self.num_processes, self._on_message = conn, peer, num_processes, on_message
    self.finished = False
    self._send_lock = threading.Lock()
    threading.Thread(target=self._beat, daemon=True, name=f'peer-{peer}-heartbeat').start()
    threading.Thread(target=self._watch, daemon=True, name=f'peer-{peer}-watch').start()

  def send(self, line: str, timeout: float = -1) -> None:
    """Sends one line; with a `timeout`, gives up if the connection stays busy that long (a stop must not wait)."""
    if not self._send_lock.acquire(timeout=timeout):
      return
    try:
      self.conn.sendall(line.encode() + b'\n')
    except OSError:
      pass  # The reader reports the loss.
    finally:
      self._send_lock.release()

  def _beat(self) -> None:
    while not self.finished:
      self.send('beat')
      time.sleep(HEARTBEAT_S)

  def _watch(self) -> None:
    self.conn.settimeout(SILENT_AFTER_S)
    reader = self.conn.makefile('r')
    while True:
      try:
        line = reader.readline()
      except TimeoutError:
        self._on_message(self, f'lost silent for {SILENT_AFTER_S}s')
        return
      except OSError as e:
        line = ''
        del e
      if not line:
        if not self.finished:
          self._on_message(self, 'lost its connection closed: the process exited or was killed')
        return
      words = line.strip()
      if words == 'bye':
        self.finished = True
        return
      if words != 'beat':
        self._on_message(self, words)


def serve(server: socket.socket, num_processes: int, timeout_s: float) -> None:
  """Process 0: accepts one heartbeat connection per other process on `server`, then watches them all."""
  global _process_index
  _process_index = 0
  lines: dict[int, _Line] = {}

  def on_message(line: _Line, message: str) -> None:
    if message.startswith('stat ') and _on_report is not None:
      _on_report(line.peer, message)
    elif message.startswith('stopping '):
      if not EXITING.locked():  # Else this process's own stop is telling them already.
        for other in lines.values():
          if other is not line:
            other.send(message)
      _peer_stopped(message, num_processes)
    elif message.startswith('lost '):
      for other in lines.values():
        if other is not line:
          other.send(f'peer {line.peer} {message[len("lost "):]}')
      _die(_lost(line.peer, num_processes, message[len('lost '):]))

  _watching.set()
  server.settimeout(timeout_s)
  with server:
    while len(lines) < num_processes - 1:
      conn, _ = server.accept()
      words = conn.makefile('r').readline().split()
      if len(words) == 2 and words[0] == 'peer' and words[1].isdigit():
        lines[int(words[1])] = _Line(conn, int(words[1]), num_processes, on_message)
        _lines.append(lines[int(words[1])])
  _say_bye_at_exit(lines.values())


def join(host: str, port: int, process_id: int, num_processes: int, timeout_s: float) -> None:
  """Process 1..N-1: connects to process 0's heartbeat port and watches it."""
  conn = socket.create_connection((host, port), timeout=timeout_s)
  global _process_index
  _process_index = process_id
  conn.sendall(f'peer {process_id}\n'.encode())
  _watching.set()

  def on_message(line: _Line, message: str) -> None:
    if message.startswith('peer '):  # Process 0 lost another process: `peer K HOW`.
      _, other, how = message.split(' ', 2)
      _die(_lost(int(other), num_processes, how))
    elif message.startswith('lost '):
      _die(_lost(0, num_processes, message[len('lost '):]))
    elif message.startswith('stopping '):  # From process 0, or passed on by it.
      _peer_stopped(message, num_processes)

  _to_coordinator.append(_Line(conn, 0, num_processes, on_message))
  _lines.append(_to_coordinator[-1])
  _say_bye_at_exit(_to_coordinator)


def _say_bye_at_exit(lines) -> None:
  lines = list(lines)

  def bye():
    for line in lines:
      line.finished = True
      line.send('bye')

  atexit.register(bye)  # Registered after jax's own atexit shutdown, so it runs before it (atexit is LIFO).
