"""A live progress bar for people at a terminal; nothing at all in files, CI logs and pods.

`log.progress_bar='auto'` draws it only when stderr is a terminal. The periodic
log lines (trainer/observe/metrics.py) are written either way, so a terminal keeps a
scroll-back of them above the bar. Log records would otherwise land in the
middle of the bar's line, so while the bar is up a filter on absl's handler
wipes the line before each record, and the next update redraws it.
"""

import logging as py_logging
import sys
import time

from absl import logging

from trainer.base.errors import UserError

MODES = ('auto', 'on', 'off')
_WIDTH = 24  # Characters of the bar itself.
_REDRAW_S = 0.1  # At most ten redraws a second: a fast run must not spend its time on the terminal.


def duration(seconds: float) -> str:
  seconds = int(round(seconds))
  hours, rest = divmod(seconds, 3600)
  return f'{hours}h{rest // 60:02d}m{rest % 60:02d}s' if hours else f'{rest // 60}m{rest % 60:02d}s'


def render(step: int, total: int, loss: float, tokens_per_s: float, eta_s: float) -> str:
  done = min(step / total, 1.0) if total else 1.0
  filled = int(done * _WIDTH)
  bar = '=' * filled + ('>' if filled < _WIDTH else '') + ' ' * max(_WIDTH - filled - 1, 0)
  # The log lines show means over the steps since the previous line; the bar, the latest step's loss and a moving
  # average of the recent speed. Labelled, so the two never seem to disagree about the same step.
  return (f'[{bar}] {done:4.0%} step {step}/{total} | loss {loss:.4f} (this step) | {tokens_per_s:,.0f} tok/s '
          f'(recent) | ETA {duration(eta_s)}')


def check_mode(mode: str) -> None:
  if mode not in MODES:
    raise UserError(f"log.progress_bar={mode!r}: expected one of {', '.join(map(repr, MODES))}.")


class _WipeBarFirst(py_logging.Filter):

  def __init__(self, bar: 'ProgressBar'):
    super().__init__()
    self._bar = bar

  def filter(self, record: py_logging.LogRecord) -> bool:
    self._bar.wipe()
    return True


class ProgressBar:
  """One line redrawn in place on `stream`; `update` after each step, `close` at the end."""

  def __init__(self, total_steps: int, mode: str, stream=None):
    check_mode(mode)
    self._stream = stream or sys.stderr
    self._total = total_steps
    interactive = getattr(self._stream, 'isatty', lambda: False)()
    self.enabled = mode == 'on' or (mode == 'auto' and interactive)
    self._shown = False
    self._last_draw = 0.0
    self._step_time_s = None  # Moving average: the ETA follows the recent speed, not the first steps'.
    self._filter = None
    if self.enabled:
      self._filter = _WipeBarFirst(self)
      logging.get_absl_handler().addFilter(self._filter)

  def update(self, step: int, loss: float, step_time_s: float, tokens_per_step: int) -> None:
    if not self.enabled:
      return
    avg = self._step_time_s
    self._step_time_s = step_time_s if avg is None else 0.7 * avg + 0.3 * step_time_s
    now = time.monotonic()
    if now - self._last_draw < _REDRAW_S and step < self._total:
      return
    self._last_draw = now
    line = render(step, self._total, loss, tokens_per_step / self._step_time_s,
                  self._step_time_s * (self._total - step))
    self._stream.write('\r\x1b[K' + line)
    self._stream.flush()
    self._shown = True

  def wipe(self) -> None:
    """Clears the bar's line so the next write starts on a clean one; the next update draws it again."""
    if self._shown:
      self._stream.write('\r\x1b[K')
      self._stream.flush()
      self._shown = False
      self._last_draw = 0.0

  def close(self) -> None:
    if self._filter is not None:
      self.wipe()
      logging.get_absl_handler().removeFilter(self._filter)
      self._filter = None
