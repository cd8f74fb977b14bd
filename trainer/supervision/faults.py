"""Test hooks that inject the faults the supervisor is proven against, in a real run; inert unless set.

LAUNCH_TEST_FAULT='KIND@STEP[,process=P][,attempt=A][,seconds=S]' acts at step STEP
(and every later step for `slow`) on process P (default: every process), in attempt A
(default: every attempt, which makes a crash loop):
- kill: SIGKILL to itself (a host or process dying without a word), once the local checkpoint tier's write in flight
  is done (so a test knows which step that tier holds);
- lose: SIGKILL to its supervisor (its launch.py, when it has one), then to itself: a host lost for good, with
  nothing left on it to restart the training process;
- crash: an exception in the step (a bug; exit 1 with its traceback);
- stall: sleeps S seconds (default: for ever) inside the step (a wedged collective);
- stall_data: the same while waiting for the batch (a stalled input pipeline);
- slow: sleeps S seconds before every step from STEP on (a straggler);
- slow_data: every batch from STEP's on takes S seconds longer to read, in the input pipeline's own thread (an
  input-bound run, as a slow source makes one: the device feed has no batch ready when the loop asks).
"""

import dataclasses
import os
import signal
import time

from trainer.supervision import attempt

_ENV = 'LAUNCH_TEST_FAULT'


@dataclasses.dataclass(frozen=True)
class Fault:
  kind: str
  step: int
  seconds: float
  process: int | None
  attempt: int | None

  @classmethod
  def parse(cls, text: str) -> 'Fault':
    head, *options = text.split(',')
    kind, step = head.split('@')
    fields = dict(option.split('=') for option in options)
    return cls(kind=kind, step=int(step), seconds=float(fields.get('seconds', 1e9)),
               process=int(fields['process']) if 'process' in fields else None,
               attempt=int(fields['attempt']) if 'attempt' in fields else None)


def for_process(process_index: int) -> Fault | None:
  """The fault this process of this attempt is to suffer, if a test asked for one."""
  text = os.environ.get(_ENV)
  if not text:
    return None
  fault = Fault.parse(text)
  if fault.process not in (None, process_index) or fault.attempt not in (None, attempt.number()):
    return None
  return fault


def inject(fault: Fault | None, step: int, where: str, settle=lambda: None) -> None:
  """Called by the loop with where='data' (before the batch) and where='step' (before the step); `settle` before a
  kill."""
  if fault is None or step < fault.step:
    return
  if (fault.kind, where) == ('slow', 'step'):
    time.sleep(fault.seconds)
  if step != fault.step:
    return
  if fault.kind == 'stall_data' and where == 'data':
    time.sleep(fault.seconds)
  elif where == 'step':
    if fault.kind == 'lose' and attempt.supervised():
      os.kill(os.getppid(), signal.SIGKILL)
    if fault.kind == 'kill':
      settle()
    if fault.kind in ('kill', 'lose'):
      os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == 'crash':
      raise RuntimeError(f'{_ENV}: injected crash at step {step}')
    elif fault.kind == 'stall':
      time.sleep(fault.seconds)


class _SlowReads:
  """The host batches of a 'slow_data' fault: each batch for step `fault.step` or later sleeps before it is read."""

  def __init__(self, batches, fault: Fault, global_batch: int):
    self._batches, self._fault, self._global_batch = batches, fault, global_batch

  def __iter__(self):
    return self

  def __next__(self):
    consumed = self._batches.get_state()['examples_consumed']
    if consumed // self._global_batch + 1 >= self._fault.step:
      time.sleep(self._fault.seconds)
    return next(self._batches)

  def __getattr__(self, name):  # get_state, set_state, close: the wrapped iterator's.
    return getattr(self._batches, name)


def slow_reads(fault: Fault | None, batches, global_batch: int):
  """`batches` as they are, or slowed as a 'slow_data' fault asks."""
  return _SlowReads(batches, fault, global_batch) if fault is not None and fault.kind == 'slow_data' else batches
