"""SIGTERM in a multi-process run: the launcher answers it outside the step loop, jax's preemption service inside.

`jax.distributed.initialize` starts jax's preemption service, whose C++ notifier
installs its own C-level SIGTERM handler (measured, jax 0.10.2: the handler that
libc's sigaction reports changes inside the call, while Python's
`signal.getsignal` still names the launcher's). From then on a SIGTERM only set a
flag that `reached_preemption_sync_point` reads at a step boundary: a SIGTERM while
the processes imported, traced or compiled was held until step 1, which every
process saved before exiting 0, about 20 s after the signal (BENCHMARKS.md), where a
single process stops at once with one line and 128 + the signal
(trainer/safety/startup_signals.py).

So right after the join, `hold_back()` keeps a copy of jax's disposition (libc's
sigaction into an opaque buffer: nothing here reads its fields) and reinstalls the
Python handler; `hand_to_jax()` puts jax's back when the step loop starts
(trainer/safety/preemption.py), and the loop takes SIGTERM back again for the final eval
and save. jax's notice listener keeps running all along, so a notice that another
process published while this one was still compiling still brings every process to
one save step. The config flag `jax_enable_preemption_service` alone cannot do
this: with it off at the join the service never starts, and jax has no public call
to start it later.
"""

import ctypes
import signal
import threading

import jax

_SIGACTION_BYTES = 1024  # glibc's struct sigaction is 152 bytes on x86-64 and aarch64; never read, only copied back.
_jax_disposition: ctypes.Array | None = None  # jax's SIGTERM disposition, while the launcher holds SIGTERM.


def _sigaction(new, old) -> None:
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.sigaction(signal.SIGTERM, new, old) != 0:
    raise OSError(ctypes.get_errno(), 'sigaction(SIGTERM) failed')


def hold_back() -> None:
  """After jax.distributed.initialize: SIGTERM goes to the Python handler again until the step loop starts."""
  global _jax_disposition
  if threading.current_thread() is not threading.main_thread() or _jax_disposition is not None:
    return
  if not (jax.distributed.is_initialized() and jax.config.jax_enable_preemption_service):
    return  # No preemption service: nothing took SIGTERM.
  ours = signal.getsignal(signal.SIGTERM)
  if ours is None:
    return  # SIGTERM was never set from Python here: there is nothing to put back.
  saved = ctypes.create_string_buffer(_SIGACTION_BYTES)
  _sigaction(None, saved)
  _jax_disposition = saved
  signal.signal(signal.SIGTERM, ours)  # Python installs its C handler again, over jax's.


def hand_to_jax() -> None:
  """At the start of the step loop: jax's preemption service answers SIGTERM again (its sync point)."""
  global _jax_disposition
  if _jax_disposition is not None:
    _sigaction(_jax_disposition, None)
    _jax_disposition = None


def take_back(handler) -> None:
  """Out of the step loop again: SIGTERM goes to `handler`; `hand_to_jax()` gives it back to jax."""
  global _jax_disposition
  if _jax_disposition is None:
    saved = ctypes.create_string_buffer(_SIGACTION_BYTES)
    _sigaction(None, saved)
    _jax_disposition = saved
  signal.signal(signal.SIGTERM, handler)
