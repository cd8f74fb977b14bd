"""Stragglers: which host holds the others back, by how much, every log interval.

In an SPMD step every process waits for the slowest at the first collective, so
step times are equal everywhere and say nothing. What differs is the host time
before that wait: each process measures, per step, the step's wall time less the
time it sat blocked on its devices, in dispatching the step or fetching its
results (`busy`; data
wait included, since a slow input pipeline on one host is a straggler too). A
straggler's busy time is long and its fetch short; the others' the reverse.

Processes 1..N-1 send their window's mean busy time and data wait to process 0 over
the peer watchdog's connection (parallel/watchdog.py: every multi-process launch,
one joined by jax's detection included); process 0 compares the newest log interval
every process has reported (the straggler's report arrives last, so usually the
interval before the one just logged), and logs the slowest process and its lag over
the median of the others (metrics `straggler_process`, `straggler_lag_s`,
`straggler_data_wait_s`) and warns when the same process lags by more than
`train.straggler_warn_fraction` of the step time for PERSIST log intervals in a row.
"""

import statistics
import threading

from absl import logging

from parallel import watchdog

PERSIST = 3


class StragglerWatch:
  """`at_log(step, busy_s, data_wait_s, step_time_s)` on every process at each log step; metrics on process 0."""

  def __init__(self, process_index: int, process_count: int, warn_fraction: float):
    self._index, self._count, self._warn_fraction = process_index, process_count, warn_fraction
    self._by_step: dict[int, dict[int, tuple[float, float]]] = {}  # step -> process -> (busy, data wait)
    self._lock = threading.Lock()
    self._streak: tuple[int | None, int] = (None, 0)
    if process_count > 1 and process_index == 0:
      watchdog.on_report(self._on_report)

  def _on_report(self, process: int, line: str) -> None:
    _, step, busy, wait = line.split()
    with self._lock:
      self._by_step.setdefault(int(step), {})[process] = (float(busy), float(wait))

  def at_log(self, step: int, busy_s: float, data_wait_s: float, step_time_s: float) -> dict[str, float]:
    if self._count == 1:
      return {}
    if self._index != 0:
      watchdog.report(f'stat {step} {busy_s:.6f} {data_wait_s:.6f}')
      return {}
    with self._lock:
      self._by_step.setdefault(step, {})[0] = (busy_s, data_wait_s)
      complete = [s for s, hosts in self._by_step.items() if len(hosts) == self._count]
      if not complete:
        return {}
      hosts = self._by_step[max(complete)]
      self._by_step = {s: h for s, h in self._by_step.items() if s > max(complete)}
    slowest = max(hosts, key=lambda p: hosts[p][0])
    lag = hosts[slowest][0] - statistics.median(v[0] for p, v in hosts.items() if p != slowest)
    self._warn(step, slowest, lag, step_time_s)
    return {'straggler_process': float(slowest), 'straggler_lag_s': lag,
            'straggler_data_wait_s': hosts[slowest][1]}

  def _warn(self, step: int, slowest: int, lag: float, step_time_s: float) -> None:
    lagging = lag > self._warn_fraction * step_time_s
    previous, count = self._streak
    self._streak = (slowest, count + 1 if lagging and previous == slowest else int(lagging))
    if self._streak[1] == PERSIST:
      logging.warning('step %d: process %d is a straggler: %.3fs of host time per step more than the median of the '
                      'other %d process(es), %.0f%% of the step, for %d log intervals in a row (its data wait: see '
                      'straggler_data_wait_s). Check that host (input pipeline, CPU load, thermal throttling).',
                      step, slowest, lag, self._count - 1, 100 * lag / step_time_s, PERSIST)
