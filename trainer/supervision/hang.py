"""The hang watch: a run with no progress for too long ends, saying where every thread of this process was.

A wedged collective, a dead storage mount or a stalled input pipeline would
otherwise hold a pod until its time limit. The loop reports progress (a step
finished, or a new phase began: compile, restore, data, step, eval, checkpoint);
a daemon thread checks it. Past the limit it writes the Python stack of every
thread (faulthandler, which needs no cooperation from the stuck thread) to
WORKDIR/hangs/attempt-A-process-P.txt, prints one line naming the phase (a stall in
the `data` phase is reported as the input pipeline's, not as a device hang), and
ends the process with HANG_EXIT_CODE, which the supervisor restarts. Each process
runs its own watch, so on a pod every host writes its own stacks.

The limit, `train.hang_timeout_s`: None (default) derives it from the run: until
the first step finishes it is FIRST_STEP_S (start-up and the first compile), then
max(10 x the median of the recent step times, MIN_S); a number is used as given
for every phase, compile included; 0 turns the watch off.
"""

import faulthandler
import os
import pathlib
import statistics
import sys
import tempfile
import threading
import time

from trainer.base import confined, storage
from trainer.supervision import attempt, heartbeat

HANG_EXIT_CODE = 124  # What `timeout` returns: "ran past its time limit".
FIRST_STEP_S = 1800.0
MIN_S = 600.0
_RECENT = 50  # Step times the derived limit is taken over.


class HangWatch:
  """Install once per run (`start()`); the loop calls `phase()` and `step_done()`; `close()` at the end."""

  def __init__(self, timeout_s: float | None, workdir: str, process_index: int):
    self._explicit = timeout_s
    self._workdir = workdir
    self._process_index = process_index
    self._phase = 'start-up'
    self._last_step = None
    self._recent: list[float] = []
    self._progress_at = time.monotonic()
    self._stop = threading.Event()
    self._thread = None
    self._beat = heartbeat.Beat()  # The same progress, for the supervisor's watch a frozen process cannot silence.

  @property
  def enabled(self) -> bool:
    return self._explicit != 0

  def start(self) -> 'HangWatch':
    if self.enabled:
      self._thread = threading.Thread(target=self._watch, daemon=True, name='hang-watch')
      self._thread.start()
    self._beat_now()
    return self

  def _beat_now(self) -> None:
    self._beat.progress(self._phase, self._last_step, lambda: self.limit_s() if self.enabled else 0)

  def phase(self, name: str) -> None:
    """A new phase began: progress, and the phase a hang would be reported in."""
    self._phase = name
    self._progress_at = time.monotonic()
    self._beat_now()

  def step_done(self, step: int, step_time_s: float) -> None:
    self._last_step = step
    self._recent.append(step_time_s)
    del self._recent[:-_RECENT]
    self._progress_at = time.monotonic()
    self._beat_now()

  def limit_s(self) -> float:
    if self._explicit is not None:
      return float(self._explicit)
    if not self._recent:
      return FIRST_STEP_S
    return max(10 * statistics.median(self._recent), MIN_S)

  def close(self) -> None:
    self._stop.set()

  def _watch(self) -> None:
    while not self._stop.wait(min(5.0, max(self.limit_s() / 20, 0.2))):
      waited = time.monotonic() - self._progress_at
      if waited > self.limit_s():
        self._fire(waited)

  def _fire(self, waited: float) -> None:
    where = self._stacks_file()
    after = f'after step {self._last_step}' if self._last_step is not None else 'before the first step'
    limit = (f'train.hang_timeout_s={self._explicit:g}' if self._explicit is not None
             else f'train.hang_timeout_s unset, so {self.limit_s():.0f}s derived from the run')
    if self._phase == 'data':
      kind = 'data stall'
      what = (f'the input pipeline stalled: no batch for {waited:.0f}s {after} (data wait, not a device hang; '
              f'limit {limit})')
    else:
      kind = 'hang'
      what = f'hang: no progress for {waited:.0f}s {after}, in the {self._phase} phase (limit {limit})'
    attempt.note(stopped=kind, phase=self._phase, last_step=self._last_step)
    print(f'{pathlib.Path(sys.argv[0]).name}: error: {what}; the stack of every thread of process '
          f'{self._process_index} is in {where}. Ended this attempt'
          + (' for the supervisor to restart.' if attempt.supervised() else '; relaunch to resume from the last '
             'checkpoint.'), file=sys.stderr, flush=True)
    os._exit(HANG_EXIT_CODE)

  def _stacks_file(self) -> str:
    name = f'attempt-{attempt.number()}-process-{self._process_index}.txt'
    target = storage.path(self._workdir) / 'hangs' / name
    try:
      with tempfile.TemporaryFile('w+') as f:
        f.write(f'No progress in the {self._phase} phase; last finished step: {self._last_step}\n')
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)  # The stuck main thread included, GIL or not.
        f.seek(0)
        target.parent.mkdir(parents=True, exist_ok=True)
        confined.write_text(target, f.read())
      return str(target)
    except Exception as e:  # pylint: disable=broad-except  (a dead mount may be why it hangs)
      faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
      return f'stderr above (could not write {target}: {e})'
