"""Eval calls dispatched a bounded number ahead of their fetch, so an eval of any size runs on any device count.

An eval is many calls of one jitted function (held-out batches, rows of task questions) whose results are only
read at the end. Dispatching all of them before one fetch queues every call on the devices at once. On XLA:CPU
(jaxlib 0.10.2) each device admits at most 32 computations in flight (the PjRt CPU client's
`max_inflight_computations_per_device`); a 33rd blocks the dispatching thread partway through a program, after
some devices have started it and entered its all-reduce, and the rendezvous waits for participants that never
come: `rendezvous ... may be stuck`, then `Termination timeout` and an abort (exit 134) 40 s later. Observed with
the tiny config's eval step on 8 CPU devices: 32 calls in flight finished and 33 aborted, 3 of 3 tries each (33,
34, 40, 64 all aborted); scripts/eval.py's scoring calls, whose rows are copied in call by call, ran behind far
enough to abort too once rows were 128 tokens (2000 questions) or 256 (300 questions).

IN_FLIGHT = 2 is what the training loop itself keeps (a step runs while the next is dispatched, its metrics
fetched a step late): the device always has the next call queued while the host fetches one result, far below
the 32 that the last train step, a checkpoint's copies or the next eval call also count against. Measured on the
same 2-core machine (500 eval batches, 3 interleaved rounds, best): 1 in flight 2.35 s, 2: 2.46 s, 4: 4.11 s,
8: 3.93 s, 16: 3.55 s: a deeper queue buys nothing on CPU (its devices share the host's cores) and on an
accelerator one queued call already hides the host's dispatch.
"""

import collections
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jax

T = TypeVar('T')
IN_FLIGHT = 2


def fetched(call: Callable[[T], Any], items: Iterable[T], in_flight: int = IN_FLIGHT) -> list:
  """[jax.device_get(call(item)) for item in items], with at most `in_flight` calls dispatched and not yet fetched."""
  pending, results = collections.deque(), []
  for item in items:
    if len(pending) >= in_flight:
      results.append(jax.device_get(pending.popleft()))
    pending.append(call(item))
  results.extend(jax.device_get(list(pending)))
  return results
