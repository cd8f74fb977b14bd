"""Goodput: how much of the wall time went into training steps, and where the rest went.

Goodput is productive step time over wall time, where wall time runs from the
start of the process (not of the loop: imports, joining the processes, loading
data and restoring count) to the end of the run, plus the time an earlier
attempt spent on steps that this attempt has to redo. The rest is broken down:

- start-up: process start to the first step, less the compile;
- compile: the ahead-of-time compile of the train step;
- data wait: the host waiting for the next batch. The device may still be busy
  with the step before, so this bounds, from above, the device time lost to input;
- checkpoint: the time the loop was blocked in `ckpt.save` (an async save only
  blocks while copying to host) and waiting for the last save at the end;
- eval: held-out evaluation;
- profiling: writing traces out (the traced steps themselves count as steps);
- lost to restarts: steps an earlier attempt logged beyond the checkpoint this
  one resumed from, timed from its metrics.jsonl (steps it ran but never logged
  are not known, so this is a lower bound);
- restart: the time between the previous attempt's end and this process's start
  (the supervisor's back-off; trainer/supervision/supervisor.py);
- earlier attempts: on a restarted attempt, what the attempts before it spent
  other than steps (their start-up, compile, checkpoints, evals, and their time
  after the last step they logged); their kept steps count as productive and
  their redone ones as lost to restarts, so the total is the whole run's wall
  time from the first attempt's start (trainer/observe/earlier_attempts.py);
- other: whatever is left (logging, metric fetches).

Beside the breakdown, `shrunk_s`: the step time of an elastic attempt that ran on fewer processes than the run's
full count (trainer/supervision/elastic.py). Those steps count as productive (they train the same global batches),
at a lower rate: the share says how much of the run went at reduced speed.
"""

import json
import os
import pathlib
import time

from absl import logging

from trainer.base import storage
from trainer.observe import earlier_attempts
from trainer.supervision import attempt

CATEGORIES = ('startup_s', 'compile_s', 'data_wait_s', 'checkpoint_s', 'eval_s', 'profiling_s', 'lost_to_restarts_s',
              'restart_s', 'earlier_attempts_s', 'other_s')
# Spent before this process started: added to its wall time.
_BEFORE_WALL = ('lost_to_restarts_s', 'restart_s', 'earlier_attempts_s')
_LABELS = {'productive_s': 'productive steps', 'startup_s': 'start-up', 'compile_s': 'compile',
           'data_wait_s': 'data wait', 'checkpoint_s': 'checkpoint blocking', 'eval_s': 'eval',
           'profiling_s': 'profiling', 'lost_to_restarts_s': 'lost to restarts', 'restart_s': 'restart back-off',
           'earlier_attempts_s': 'earlier attempts', 'other_s': 'other'}


def process_start_time() -> float:
  """Wall-clock time this process started (Linux /proc); the current time where that is not readable."""
  try:
    after_name = pathlib.Path('/proc/self/stat').read_text().rsplit(')', 1)[1].split()
    started_after_boot = int(after_name[19]) / os.sysconf('SC_CLK_TCK')  # Field 22, starttime, in clock ticks.
    uptime = float(pathlib.Path('/proc/uptime').read_text().split()[0])
    return time.time() - (uptime - started_after_boot)
  except (OSError, ValueError, IndexError):
    return time.time()


def lost_to_restart(records: list[dict], resumed_step: int) -> tuple[int, float]:
  """(steps, seconds) the latest earlier attempt logged beyond `resumed_step`, from its metrics.jsonl records.

  The file holds every attempt in order; the latest attempt is the tail whose
  steps rise. Each record's step_time_s is the mean over the steps since the
  record before it, so the record stands for that many steps.
  """
  tail = []
  for record in reversed(records):
    if 'step' not in record or (tail and record['step'] >= tail[-1]['step']):
      break
    tail.append(record)
  tail.reverse()
  if not tail or tail[-1]['step'] <= resumed_step:
    return 0, 0.0
  seconds = 0.0
  for i, record in enumerate(tail):
    if record['step'] > resumed_step:
      before = tail[i - 1]['step'] if i else record['step'] - 1  # An attempt logs its first step alone.
      seconds += (record['step'] - max(before, resumed_step)) * record.get('step_time_s', 0.0)
  return tail[-1]['step'] - resumed_step, seconds


class Goodput:
  """Adds up where the time goes; `summary()` at the end. Cheap enough to run on every process."""

  def __init__(self, workdir: str, resumed_step: int | None, started: float | None = None, shrunk: bool = False):
    self._started = process_start_time() if started is None else started
    self._shrunk = shrunk
    self._totals = dict.fromkeys(('productive_s', *CATEGORIES), 0.0)
    self._totals['restart_s'] = attempt.restart_gap_s()
    self._window = {'checkpoint_blocking_s': 0.0, 'evaluation_time_s': 0.0}
    self._first_step_at = None
    self._compile_pending = None
    self.steps = 0
    self.lost_steps = 0
    metrics_file = storage.path(workdir) / 'metrics.jsonl'
    if resumed_step is not None and metrics_file.exists():
      records = []
      for line in metrics_file.read_text().splitlines():
        try:
          records.append(json.loads(line))
        except json.JSONDecodeError:  # A line cut short when the earlier attempt was killed.
          continue
      self.lost_steps, self._totals['lost_to_restarts_s'] = lost_to_restart(records, resumed_step)
      if self.lost_steps:
        logging.info('Resumed from step %d: the previous attempt had logged up to step %d; about %.1fs of its '
                     'steps are redone (counted as lost to restarts in the goodput).', resumed_step,
                     resumed_step + self.lost_steps, self._totals['lost_to_restarts_s'])
    self._earlier = earlier_attempts.read(workdir, attempt.number(), resumed_step or 0, self._started)
    if self._earlier is not None:  # The whole run's attempts replace the latest one's view of the one before it.
      self.lost_steps = self._earlier.lost_steps
      for key in _BEFORE_WALL:
        self._totals[key] = getattr(self._earlier, key)

  def compiled(self, seconds: float) -> None:
    self._totals['compile_s'] += seconds
    self._compile_pending = seconds

  def record_step(self, step_time_s: float, data_wait_s: float) -> None:
    """One step as the loop measured it: wall time between metric fetches, less eval and checkpoint time."""
    if self._first_step_at is None:
      self._first_step_at = time.time() - step_time_s
    self.steps += 1
    wait = min(data_wait_s, step_time_s)
    self._totals['data_wait_s'] += wait
    self._totals['productive_s'] += step_time_s - wait

  def record_side(self, eval_s: float = 0.0, checkpoint_s: float = 0.0, profiling_s: float = 0.0) -> None:
    """Time the loop spent evaluating, blocked on a checkpoint save, or writing a trace out."""
    self._totals['eval_s'] += eval_s
    self._totals['profiling_s'] += profiling_s
    self._totals['checkpoint_s'] += checkpoint_s
    self._window['evaluation_time_s'] += eval_s
    self._window['checkpoint_blocking_s'] += checkpoint_s

  def take_window(self) -> dict[str, float]:
    """Eval and checkpoint seconds since the last call (and the compile time, once), for the metrics log."""
    window = dict(self._window)
    self._window = dict.fromkeys(self._window, 0.0)
    if self._compile_pending is not None:
      window['compile_time_s'] = self._compile_pending
      self._compile_pending = None
    return window

  def summary(self) -> dict[str, float]:
    now = time.time()
    totals = dict(self._totals)
    wall = now - self._started
    first_step_at = self._first_step_at if self._first_step_at is not None else now
    totals['startup_s'] = max(first_step_at - self._started - totals['compile_s'], 0.0)
    accounted = sum(v for k, v in totals.items() if k not in (*_BEFORE_WALL, 'other_s'))
    totals['other_s'] = max(wall - accounted, 0.0)
    total = wall + sum(totals[k] for k in _BEFORE_WALL)
    attempts = 1
    if self._earlier is not None:  # Their kept steps are productive; the total runs from attempt 1's start.
      totals['productive_s'] += self._earlier.productive_s
      totals['data_wait_s'] += self._earlier.data_wait_s
      total += self._earlier.productive_s + self._earlier.data_wait_s
      attempts += self._earlier.count
    shrunk = self._totals['productive_s'] + self._totals['data_wait_s'] if self._shrunk else 0.0
    return {'goodput': totals['productive_s'] / total if total > 0 else 0.0, 'wall_s': wall, 'total_s': total,
            'steps': float(self.steps), 'lost_steps': float(self.lost_steps), 'attempts': float(attempts),
            'shrunk_s': shrunk, **totals}


def format_summary(summary: dict[str, float]) -> str:
  """The end-of-run table: each category's seconds and share of the total."""
  total = summary['total_s'] or 1.0
  if summary.get('attempts', 1) > 1:
    earlier = int(summary['attempts']) - 1
    lines = [f'Goodput {summary["goodput"]:.1%}: productive step time over {summary["total_s"]:.1f}s, the whole run '
             f'since attempt 1 started ({summary["wall_s"]:.1f}s wall of this attempt + '
             f'{summary["total_s"] - summary["wall_s"]:.1f}s of {earlier} earlier attempt{"s" if earlier > 1 else ""} '
             f'and the restarts between attempts; {int(summary["steps"])} steps this attempt)']
  else:
    lines = [f'Goodput {summary["goodput"]:.1%}: productive step time over {summary["total_s"]:.1f}s '
             f'({summary["wall_s"]:.1f}s wall since the process started'
             + (f' + {summary["lost_to_restarts_s"]:.1f}s of an earlier attempt\'s steps redone' if
                summary['lost_steps'] else '')
             + (f' + {summary["restart_s"]:.1f}s between attempts' if summary.get('restart_s') else '')
             + f'; {int(summary["steps"])} steps)']
  for key in ('productive_s', *CATEGORIES):
    lines.append(f'  {_LABELS[key]:<20} {summary[key]:9.1f}s {summary[key] / total:7.1%}')
  if summary.get('shrunk_s'):
    lines.append(f'  (steps run shrunk, elastic: {summary["shrunk_s"]:.1f}s, {summary["shrunk_s"] / total:.1%})')
  return '\n'.join(lines)
