"""Global train batches already on the devices: a thread reads and transfers the next ones while a step runs.

The loop's data wait used to be the host read plus the host-to-device copy of
each batch, paid between two steps (1.7-2.7 ms a step on an H100, 32% of the
default job's step). `DeviceFeed` moves both off the loop's path: a background
thread pulls host batches, stitches each into global jax Arrays on the Job's
per-key batch shardings (`to_global`) and keeps up to `depth` of them queued,
so the loop's `next()` is a queue pop.

Exact resume: the checkpoint must name the batches the steps consumed, not the
ones read ahead. The thread records the host iterator's state right after each
pull and queues it with the batch; `get_state()` answers the state queued with
the last batch handed out. `set_state()` (restore, rollback) stops the thread,
drops what it read ahead and rewinds the host iterator, so the next batch is
exactly the one after the restored step.

No transfer while an executable runs for the first time: XLA:GPU records a
step into CUDA graphs on its first run, and CUDA forbids device work from other
threads of the process while a stream is captured. On an H100 the default job's
first step died in 2 of 4 launches with a failed capture (issue 38), with this
thread transferring the next batches meanwhile. So a feed starts *held*: it
transfers only a batch the loop is waiting for, until the loop calls
`release_after(outputs)` with the first step's outputs (which waits for them);
`hold()` / `release()` bracket an eval the same way. Host reads go on while
held: they touch no device.
"""

import queue
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from trainer.data.pipeline import to_global

# Two batches ahead: one being copied while the other waits for the step; more only pins device memory.
DEPTH = 2
_POLL_S = 0.05  # How often a thread waiting for a free slot checks whether it was asked to stop.
_END = object()


class DeviceFeed:
  """Endless global batches on the devices, `depth` ahead of the consumer; checkpointable like its host iterator.

  `host_batches` yields this process's rows (numpy dicts); when it has
  `get_state`/`set_state` (the Grain `TrainIterator`), so does the feed.
  """

  def __init__(self, host_batches: Iterator[dict[str, np.ndarray]], batch_shardings: dict[str, NamedSharding],
               process_count: int, depth: int = DEPTH):
    self._host, self._shardings, self._process_count, self._depth = host_batches, batch_shardings, process_count, depth
    self._thread, self._queue, self._slots, self._stop = None, None, None, threading.Event()
    self._state = None  # The host iterator's state after the last batch handed out; None = not started yet.
    # Held: transfer only for a waiting consumer. `_waiting` consumers in next(), `_queued` batches not yet taken,
    # `_transferring` while the thread puts one on the devices (hold() waits for it to end).
    self._turn = threading.Condition()
    self._held, self._waiting, self._queued, self._transferring = True, 0, 0, False
    self._takes, self._ready_takes = 0, 0  # Batches handed out, and how many of them were queued when asked for.

  def __iter__(self) -> 'DeviceFeed':
    return self

  def __next__(self) -> dict[str, jax.Array]:
    if self._thread is None:
      self._start()
    with self._turn:
      self._takes += 1
      self._ready_takes += self._queued > 0
      self._waiting += 1
      self._turn.notify_all()
    try:
      item = self._queue.get()
    finally:
      with self._turn:
        self._waiting -= 1
        self._queued -= 1
    self._slots.release()
    if item is _END or isinstance(item, BaseException):
      with self._turn:
        self._queued += 1
      self._queue.put(item)  # The thread has stopped: every later call ends the same way instead of blocking.
      self._slots.acquire()
      if item is _END:
        raise StopIteration
      raise item  # A read error in the thread surfaces in the loop, with its traceback.
    batch, self._state = item
    return batch

  def ready_share(self) -> float | None:
    """The share of the batches handed out since the last call that were already queued when asked for (None if
    none was): a wait for a batch that was ready is the host not scheduling the loop, not a slow pipeline."""
    with self._turn:
      takes, ready = self._takes, self._ready_takes
      self._takes, self._ready_takes = 0, 0
    return ready / takes if takes else None

  def get_state(self) -> dict[str, Any]:
    return self._host.get_state() if self._state is None else self._state

  def hold(self) -> None:
    """From now on transfer only a batch the consumer waits for; returns once no transfer is in flight."""
    with self._turn:
      self._held = True
      self._turn.wait_for(lambda: not self._transferring)

  def release(self) -> None:
    """Transfer ahead again, up to `depth` batches."""
    with self._turn:
      self._held = False
      self._turn.notify_all()

  def release_after(self, outputs: Any) -> None:
    """Waits until `outputs` (a step's results) are computed, then releases: the executable that made them has
    finished its first run before the next transfer starts."""
    jax.block_until_ready(outputs)
    self.release()

  def set_state(self, state: dict[str, Any]) -> None:
    self._halt()
    self._host.set_state(state)

  def close(self) -> None:
    """Stops the thread and drops the batches it read ahead; closes the host iterator."""
    self._halt()
    if hasattr(self._host, 'close'):
      self._host.close()

  def _start(self) -> None:
    self._state = self._host.get_state() if hasattr(self._host, 'get_state') else {}
    self._queue, self._slots, self._stop = queue.Queue(), threading.Semaphore(self._depth), threading.Event()
    self._thread = threading.Thread(target=self._fill, args=(self._queue, self._slots, self._stop), daemon=True,
                                    name='device-feed')
    self._thread.start()

  def _fill(self, out: queue.Queue, slots: threading.Semaphore, stop: threading.Event) -> None:
    with_state = hasattr(self._host, 'get_state')
    while not stop.is_set():
      if not slots.acquire(timeout=_POLL_S):  # `depth` batches already read ahead: wait for the loop to take one.
        continue
      try:
        local = next(self._host)
        position = self._host.get_state() if with_state else {}
        if not self._may_transfer(stop):
          return
        try:
          item = (to_global(local, self._shardings, self._process_count), position)
        finally:
          with self._turn:
            self._transferring = False
            self._turn.notify_all()
      except StopIteration:
        item = _END
      except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it.
        item = e
      with self._turn:
        self._queued += 1
      out.put(item)
      if item is _END or isinstance(item, BaseException):
        return

  def _may_transfer(self, stop: threading.Event) -> bool:
    """Waits until a transfer is allowed (released, or a consumer waits with nothing queued) and marks one in
    flight; False when asked to stop meanwhile."""
    with self._turn:
      while not stop.is_set():
        if not self._held or self._waiting > self._queued:
          self._transferring = True
          return True
        self._turn.wait(_POLL_S)
    return False

  def _halt(self) -> None:
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
    self._thread, self._queue, self._slots, self._state = None, None, None, None
    with self._turn:
      self._queued = 0
