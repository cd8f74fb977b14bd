"""The training process's side of the supervisor contract: which attempt this is, and a status it keeps current.

The supervisor (trainer/supervision/supervisor.py) starts each attempt with
LAUNCH_ATTEMPT (1, 2, ...) and LAUNCH_STATUS_FILE (a local file) in its
environment. The child rewrites that file, whole and atomically, when it knows
something the supervisor needs after it is gone (a kill -9 leaves no chance to say
it at exit): the step it resumed from, the last step it logged, what it was doing
when a watch ended it, and how it stopped. It is written at start and at the end,
and the last logged step at most every _PROGRESS_EVERY_S seconds, so a run logging
every step does no file I/O per step for it. Without a supervisor every call here is
a no-op.
"""

import json
import os
import time

from trainer.base import confined

_ATTEMPT_ENV = 'LAUNCH_ATTEMPT'
_STATUS_ENV = 'LAUNCH_STATUS_FILE'
_RESTART_GAP_ENV = 'LAUNCH_RESTART_GAP_S'
_PROGRESS_EVERY_S = 1.0
_status: dict = {}
_written_at = [0.0]


def number() -> int:
  """This attempt's number (1 for the first, or when no supervisor started this process)."""
  return int(os.environ.get(_ATTEMPT_ENV, '1'))


def supervised() -> bool:
  return _ATTEMPT_ENV in os.environ


def restart_gap_s() -> float:
  """Seconds between the previous attempt's end and this process's start (back-off included); 0 on attempt 1."""
  return float(os.environ.get(_RESTART_GAP_ENV, '0'))


def progress(last_step: int) -> None:
  """The last logged step, written at most every _PROGRESS_EVERY_S seconds (it only sizes the steps redone)."""
  _status['last_step'] = last_step
  if time.monotonic() - _written_at[0] >= _PROGRESS_EVERY_S:
    note()


def note(**fields) -> None:
  """Merges `fields` into the status and rewrites the status file (atomically: write, then rename)."""
  path = os.environ.get(_STATUS_ENV)
  if not path:
    return
  _written_at[0] = time.monotonic()
  _status.update(fields, updated=time.time())
  try:
    # Renamed over it from a temporary file of a name nobody can guess: never through a link planted in /tmp.
    confined.write_text(path, json.dumps(_status))
  except (OSError, confined.Planted):
    pass  # The supervisor then knows less about this attempt; training is not stopped for it.


def read(path: str) -> dict:
  """The status a child left in `path` ({} if it wrote none)."""
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return {}
