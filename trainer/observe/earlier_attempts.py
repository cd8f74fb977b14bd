"""Where the earlier attempts of a supervised run spent their time, so the goodput covers the whole run.

A restarted attempt (trainer/supervision/supervisor.py) is a new process: by
itself it would report only its own wall time, leaving out everything a killed
attempt spent (its start-up, its compile, its steps). The supervisor writes one
line per attempt to WORKDIR/attempts.jsonl (start, end, the step it resumed from,
the last step it logged), and every attempt's metrics.jsonl records carry its
logged steps' times, the first record of each launch marked by its
`compile_time_s`. From those two files each earlier attempt's time splits into:

- its steps that a later attempt kept (at or before the step the next attempt
  resumed from): productive time and data wait, as for this attempt;
- its steps a later attempt redid: lost to restarts;
- the rest (its start-up, compile, checkpoints, evals, and whatever it did after
  its last logged step before it died): the "earlier attempts" row;

and the time between attempts (the back-off) is the restart row.
"""

import dataclasses
import json

from trainer.base import storage


@dataclasses.dataclass(frozen=True)
class Earlier:
  """The earlier attempts' seconds by goodput category, and when the run's first attempt started."""
  count: int
  run_started: float  # time.time() at which attempt 1 started.
  productive_s: float
  data_wait_s: float
  lost_steps: int
  lost_to_restarts_s: float
  earlier_attempts_s: float
  restart_s: float


def _read_jsonl(path) -> list[dict]:
  records = []
  if not path.exists():
    return records
  for line in path.read_text().splitlines():
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:  # A line cut short by a kill.
      continue
  return records


def _launch_segments(metrics: list[dict]) -> list[list[dict]]:
  """metrics.jsonl's step records cut into launches: each launch's first record carries its compile_time_s."""
  segments = []
  for record in metrics:
    if 'step' not in record:
      continue
    if 'compile_time_s' in record or not segments:
      segments.append([])
    segments[-1].append(record)
  return segments


def _split(segment: list[dict], resumed_step: int, kept_until: int) -> tuple[float, float, int, float]:
  """(productive, data wait) seconds of a launch's steps up to `kept_until`, and (steps, seconds) beyond it."""
  productive = wait = lost = 0.0
  lost_steps = 0
  before = resumed_step
  for record in segment:
    steps = record['step'] - before
    kept = max(min(record['step'], kept_until) - before, 0)
    step_time = record.get('step_time_s', 0.0)
    waited = min(record.get('data_wait_s', 0.0), step_time)
    productive += kept * (step_time - waited)
    wait += kept * waited
    lost_steps += steps - kept
    lost += (steps - kept) * step_time
    before = record['step']
  return productive, wait, lost_steps, lost


def read(workdir: str, attempt_number: int, resumed_step: int, process_started: float) -> Earlier | None:
  """The attempts before `attempt_number` of this supervised run; None on attempt 1 or without their records."""
  if attempt_number <= 1:
    return None
  root = storage.path(workdir)
  attempts = _read_jsonl(root / 'attempts.jsonl')
  earlier = attempts[-(attempt_number - 1):]
  if len(earlier) != attempt_number - 1 or [a.get('attempt') for a in earlier] != list(range(1, attempt_number)):
    return None  # Another process's supervisor writes the file (multi-host), or it was lost: this attempt alone.
  # The launches' records, newest last, matched to the attempts from the newest back: an attempt's launch starts at
  # the step after the one it resumed from; an attempt that logged nothing has none (its status's last_step cannot
  # tell: it is written at most once a second, so an attempt killed in its first second reports none).
  segments, by_attempt = _launch_segments(_read_jsonl(root / 'metrics.jsonl')), {}
  for record in reversed(earlier):
    if segments and segments[-1][0]['step'] == (record.get('resumed_step') or 0) + 1:
      by_attempt[record['attempt']] = segments.pop()
  productive = wait = lost = 0.0
  lost_steps = 0
  for i, record in enumerate(earlier):
    segment = by_attempt.get(record['attempt'])
    started_at = record.get('resumed_step') or 0
    if not segment:
      continue  # Nothing logged: all of its time stays in the "earlier attempts" row.
    kept_until = (earlier[i + 1].get('resumed_step') or 0) if i + 1 < len(earlier) else resumed_step
    p, w, n, l = _split(segment, started_at, kept_until)
    productive, wait, lost_steps, lost = productive + p, wait + w, lost_steps + n, lost + l
  spent = sum(max(a['end'] - a['start'], 0.0) for a in earlier)
  run_started = earlier[0]['start']
  return Earlier(count=len(earlier), run_started=run_started, productive_s=productive, data_wait_s=wait,
                 lost_steps=lost_steps, lost_to_restarts_s=lost,
                 earlier_attempts_s=max(spent - productive - wait - lost, 0.0),
                 restart_s=max(process_started - run_started - spent, 0.0))
