"""The hang watch seen from outside: a heartbeat the child writes, a timer in the supervisor that reads it.

The child's own hang watch (trainer/supervision/hang.py) is a thread of the child:
a process that is frozen whole (SIGSTOP, a debugger, a swapped-out or D-state host)
freezes its watch with it, and the run waited for ever (issue 39). So the child also
writes, when it makes progress, the wall time of that progress and the limit its
watch applies (`Beat`); the supervisor, on its own timer, ends a child whose last
progress is older than that limit plus MARGIN_S (the child's own watch, which writes
every thread's stack, gets the first chance): SIGTERM, then SIGKILL after GRACE_S
(a stopped process acts on nothing but SIGKILL).

Only progress writes the file, never a timer in the child: a frozen main thread with
a live thread beside it must still look frozen. Writes are at most one a second, so
a run taking hundreds of steps a second does no file I/O per step for it. Until the
child's first beat (imports, joining the other processes) the supervisor waits
FIRST_BEAT_S, the child's own limit before its first step. Imports nothing heavy:
the supervisor, which holds no jax, reads it.
"""

import json
import os
import time

from trainer.base import confined

ENV = 'LAUNCH_HEARTBEAT_FILE'
MARGIN_S = 5.0
GRACE_S = 10.0
FIRST_BEAT_S = 1800.0
_EVERY_S = 1.0


class Beat:
  """The child's side: `progress(phase, last_step, limit_s)` whenever the hang watch sees progress."""

  def __init__(self):
    self._path = os.environ.get(ENV)
    self._written_at = 0.0

  def progress(self, phase: str, last_step: int | None, limit_s) -> None:
    """`limit_s`: a callable giving the watch's limit now (0: off), only called when the file is written."""
    now = time.monotonic()
    if not self._path or now - self._written_at < _EVERY_S:
      return
    self._written_at = now
    try:
      beat = {'progress_at': time.time(), 'limit_s': limit_s(), 'phase': phase, 'last_step': last_step}
      confined.write_text(self._path, json.dumps(beat))  # Renamed over it: never through a link planted in /tmp.
    except (OSError, confined.Planted):
      pass  # The supervisor then waits for the child's own watch; training is not stopped for it.


def overdue(path: str, started_at: float) -> str | None:
  """The supervisor's side: why the child is taken as frozen, or None while it is not (yet)."""
  try:
    with open(path) as f:
      beat = json.load(f)
  except (OSError, ValueError):
    beat = None
  if beat is None:
    waited = time.time() - started_at
    return (f'no heartbeat {waited:.0f}s after it started (limit {FIRST_BEAT_S:.0f}s until the first)'
            if waited > FIRST_BEAT_S + MARGIN_S else None)
  limit = float(beat.get('limit_s') or 0)
  waited = time.time() - float(beat['progress_at'])
  if limit <= 0 or waited <= limit + MARGIN_S:
    return None
  after = f'after step {beat["last_step"]}' if beat.get('last_step') is not None else 'before the first step'
  return f'no progress for {waited:.0f}s {after}, in the {beat.get("phase")} phase (limit {limit:g}s)'
