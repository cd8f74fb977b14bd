"""Test hooks that inject the faults the supervisor is proven against, in a real run; inert unless set.

LAUNCH_TEST_FAULT='KIND@STEP[,process=P][,attempt=A][,seconds=S]' acts at step STEP
(and every later step for `slow`) on process P (default: every process), in attempt A
(default: every attempt, which makes a crash loop):
- kill: SIGKILL to itself (a host or process dying without a word);
- crash: an exception in the step (a bug; exit 1 with its traceback);
- stall: sleeps S seconds (default: for ever) inside the step (a wedged collective);
- stall_data: the same while waiting for the batch (a stalled input pipeline);
- slow: sleeps S seconds before every step from STEP on (a straggler);
- slow_data: sleeps S seconds while waiting for every batch from STEP on (an input-bound run).
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


def inject(fault: Fault | None, step: int, where: str) -> None:
  """Called by the loop with where='data' (before the batch) and where='step' (before the step)."""
  if fault is None or step < fault.step:
    return
  if (fault.kind, where) in (('slow', 'step'), ('slow_data', 'data')):
    time.sleep(fault.seconds)
  if step != fault.step:
    return
  if fault.kind == 'stall_data' and where == 'data':
    time.sleep(fault.seconds)
  elif where == 'step':
    if fault.kind == 'kill':
      os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == 'crash':
      raise RuntimeError(f'{_ENV}: injected crash at step {step}')
    elif fault.kind == 'stall':
      time.sleep(fault.seconds)
