"""The training process's side of the supervisor contract: which attempt this is, and a status it keeps current.

The supervisor (trainer/supervision/supervisor.py) starts each attempt with
LAUNCH_ATTEMPT (1, 2, ...) and LAUNCH_STATUS_FILE (a local file) in its
environment. The child rewrites that file, whole and atomically, when it knows
something the supervisor needs after it is gone (a kill -9 leaves no chance to say
it at exit): the step it resumed from, the last step it logged, what it was doing
when a watch ended it, and how it stopped. It is written at start and at the end,
and each logged step by a thread of its own, so the step loop does no file I/O for it
(a write took 1.1 ms on a busy 2-core machine), and a process killed right after it
logged a step still reports that step (written at most once a second, the record
said step 4 where step 5 had been logged). Without a supervisor every call here is a
no-op.
"""

import json
import os
import threading
import time

from trainer.base import confined

_ATTEMPT_ENV = 'LAUNCH_ATTEMPT'
_STATUS_ENV = 'LAUNCH_STATUS_FILE'
_RESTART_GAP_ENV = 'LAUNCH_RESTART_GAP_S'
HELD_SIGNALS_ENV = 'LAUNCH_HELD_SIGNALS'  # Signals the supervisor blocked while it spawned this attempt (numbers).
_status: dict = {}
_lock = threading.Lock()  # The status is changed by the loop and written by the progress thread.
_write_lock = threading.Lock()
_logged = threading.Event()  # A logged step not yet written.
_writer: list[threading.Thread] = []


def number() -> int:
  """This attempt's number (1 for the first, or when no supervisor started this process)."""
  return int(os.environ.get(_ATTEMPT_ENV, '1'))


def supervised() -> bool:
  return _ATTEMPT_ENV in os.environ


def restart_gap_s() -> float:
  """Seconds between the previous attempt's end and this process's start (back-off included); 0 on attempt 1."""
  return float(os.environ.get(_RESTART_GAP_ENV, '0'))


def progress(last_step: int) -> None:
  """The last logged step, written by the progress thread (it sizes the steps a restart redoes)."""
  if not os.environ.get(_STATUS_ENV):
    return
  with _lock:
    _status['last_step'] = last_step
  if not _writer:
    _writer.append(threading.Thread(target=_write_progress, daemon=True, name='attempt-status'))
    _writer[0].start()
  _logged.set()


def _write_progress() -> None:
  while True:
    _logged.wait()
    _logged.clear()
    note()


def note(**fields) -> None:
  """Merges `fields` into the status and rewrites the status file (atomically: write, then rename)."""
  path = os.environ.get(_STATUS_ENV)
  if not path:
    return
  with _write_lock:  # Whole writes, one at a time, each of the newest status; progress() takes only _lock.
    with _lock:
      _status.update(fields, updated=time.time())
      text = json.dumps(_status)
    try:
      # Renamed over it from a temporary file of a name nobody can guess: never through a link planted in /tmp.
      confined.write_text(path, text)
    except (OSError, confined.Planted):
      pass  # The supervisor then knows less about this attempt; training is not stopped for it.


def read(path: str) -> dict:
  """The status a child left in `path` ({} if it wrote none)."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}
