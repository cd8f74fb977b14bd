"""Grain pipelines over any random-access source: shuffle, epochs, per-process shards, batches, workers, prefetch.

Sharding over processes: the globally shuffled, endlessly repeated sequence of
examples is split round-robin (`process_index::process_count`) and each process
batches its own share of `batch_size / process_count`. Batch k of every process
together is exactly global examples [k*B, (k+1)*B), so the global batch does not
depend on how many processes read it; `to_global` stitches the pieces into one
jax.Array on the batch sharding (the `data` and `fsdp` mesh axes).

Resume: `TrainIterator` counts the global examples consumed. That count (with
a fingerprint of what defines the order) is the data item of each checkpoint,
and a restored iterator restarts the pipeline at that example. Because the
count is global, a run saved by N processes resumes exactly in M processes, and
examples prefetched by threads or workers but never consumed are not counted.
"""

from collections.abc import Callable, Iterator
from typing import Any

import grain
import jax
import numpy as np
from absl import flags, logging
from jax.sharding import NamedSharding

from trainer.base.errors import UserError

STALL_WARNING_FRACTION = 0.10  # Warn when waiting for data takes more than this share of the step time...
# ...and more than this per step. On a 2-core machine that other work keeps busy, the tiny config's 30 ms steps waited
# 5-10 ms for batches that the feed had ready (the host thread was simply not scheduled): the warning fired on 7 of 12
# such runs, naming data.* knobs that cannot win back what the machine's load takes. A wait a user can act on is tens
# of milliseconds a step.
STALL_WARNING_FLOOR_S = 0.020
# ...and when the batches were not ready. On that busy machine a tiny run still waited 23 ms of a 28 ms step (82%) for
# batches the device feed had queued: the loop's thread was not scheduled. The feed says whether each batch was
# queued when asked for; when most were, no data.* knob would help, and the warning stays quiet.
STALL_READY_SHARE = 0.5


def global_examples(source, seed: int, shuffle: bool = True) -> grain.MapDataset:
  """Every example of every epoch, in the one global order all processes agree on."""
  ds = grain.MapDataset.source(source)
  if shuffle:
    ds = ds.seed(seed).shuffle()
  return ds.repeat()


def process_batches(ds: grain.MapDataset, batch_size: int, process_index: int, process_count: int,
                    start: int = 0) -> grain.MapDataset:
  """This process's share of each global batch, from global example `start` on."""
  return ds[start:][process_index::process_count].batch(batch_size // process_count, drop_remainder=True)


def to_iterator(ds: grain.MapDataset, data_config) -> Iterator[dict[str, np.ndarray]]:
  """Read threads and element read-ahead, then worker processes or a thread, reading `prefetch` batches ahead."""
  read = grain.ReadOptions(num_threads=data_config.num_threads,
                           prefetch_buffer_size=data_config.prefetch_buffer_size)
  it_ds = ds.to_iter_dataset(read)
  if data_config.worker_count:
    if not flags.FLAGS.is_parsed():  # Grain's workers read its absl flags; outside absl.app (tests, notebooks)
      flags.FLAGS.mark_as_parsed()  # take their defaults instead of failing.
    # Workers already read ahead into their own buffers: `prefetch` sizes those. A prefetch thread on
    # top only added GIL contention with the train loop (benchmarks/bench_data.py: wait share up 5-20x).
    it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=data_config.worker_count,
                                                           per_worker_buffer_size=max(1, data_config.prefetch)))
  elif data_config.prefetch:
    it_ds = grain.experimental.ThreadPrefetchIterDataset(it_ds, prefetch_buffer_size=data_config.prefetch)
  return iter(it_ds)


class TrainIterator:
  """Endless batches (this process's rows, numpy) whose position is a count of global examples.

  `get_state()` / `set_state()` are what the checkpoint saves and restores: a
  small JSON-able dict, the same on every process.
  """

  def __init__(self, make: Callable[[int], Iterator[dict[str, np.ndarray]]], batch_size: int,
               fingerprint: dict[str, Any]):
    self._make, self._batch_size, self._fingerprint = make, batch_size, fingerprint
    self._consumed, self._iterator = 0, None

  def __iter__(self) -> 'TrainIterator':
    return self

  @property
  def examples_per_epoch(self) -> int:
    """Global examples in one pass over the training data (the loop logs the passes made as `epochs`)."""
    return int(self._fingerprint['num_examples'])

  def __next__(self) -> dict[str, np.ndarray]:
    if self._iterator is None:  # Built on first use: a resumed run starts its workers once, at the right place.
      self._iterator = self._make(self._consumed)
    batch = next(self._iterator)
    self._consumed += self._batch_size
    return batch

  def close(self) -> None:
    """Stops read threads and worker processes now rather than at garbage collection."""
    if self._iterator is not None and hasattr(self._iterator, 'close'):
      self._iterator.close()
    self._iterator = None

  def get_state(self) -> dict[str, Any]:
    return {'examples_consumed': self._consumed, **self._fingerprint}

  def set_state(self, state: dict[str, Any]) -> None:
    saved = {k: state.get(k) for k in self._fingerprint}
    if saved != self._fingerprint:
      diffs = '; '.join(f'{k}: checkpoint {saved[k]!r} vs now {v!r}' for k, v in self._fingerprint.items()
                        if saved[k] != v)
      raise UserError(f'the checkpoint\'s data position belongs to a different data order ({diffs}); resume with '
                      f'the data.* settings and train.seed it was saved with, or use a fresh --workdir.')
    self._consumed, self._iterator = int(state['examples_consumed']), None


def train_iterator(source, data_config, batch_size: int, seed: int, process_index: int, process_count: int,
                   fingerprint: dict[str, Any] | None = None) -> TrainIterator:
  """Endless shuffled epochs of `source`, this process's share of each global batch, resumable."""
  examples = global_examples(source, seed)
  make = lambda start: to_iterator(process_batches(examples, batch_size, process_index, process_count, start),
                                   data_config)
  fingerprint = {**(fingerprint or {}), 'num_examples': len(source), 'seq_len': data_config.seq_len, 'seed': seed}
  return TrainIterator(make, batch_size, fingerprint)


def eval_batches(source, batch_size: int, num_batches: int, process_index: int,
                 process_count: int) -> list[dict[str, np.ndarray]]:
  """The first `num_batches` global batches of `source`, unshuffled (this process's rows): the same every eval."""
  num_batches = min(num_batches, len(source) // batch_size)
  ds = grain.MapDataset.source(source)[:num_batches * batch_size]
  return list(ds[process_index::process_count].batch(batch_size // process_count, drop_remainder=True))


def check_enough(source, batch_size: int, what: str, fix: str) -> None:
  if len(source) < batch_size:
    raise UserError(f'{what} makes {len(source)} examples, fewer than one global batch '
                    f'(train.batch_size={batch_size}); {fix}')


def to_global(local_batch: dict[str, np.ndarray], batch_shardings: dict[str, NamedSharding],
              process_count: int) -> dict[str, jax.Array]:
  """Stitches every process's local rows into one global jax.Array per key, on that key's sharding (the Job's)."""
  return {
      key: jax.make_array_from_process_local_data(batch_shardings[key], value,
                                                  (value.shape[0] * process_count,) + value.shape[1:])
      for key, value in local_batch.items()
  }


def warn_if_stalled(step: int, summary: dict[str, float], ready_share: float | None = None) -> bool:
  """Logs a warning when the window's data wait exceeds 10% of its step time and 20 ms a step while the pipeline had
  no batch ready for most of its steps (`ready_share`, from the device feed); returns whether it did."""
  share = summary['data_wait_s'] / summary['step_time_s']
  if step <= 1 or share <= STALL_WARNING_FRACTION:  # Step 1 includes starting the read threads and workers.
    return False
  if summary['data_wait_s'] <= STALL_WARNING_FLOOR_S:
    return False
  if ready_share is not None and ready_share >= STALL_READY_SHARE:
    return False
  logging.log_every_n_seconds(
      logging.WARNING, 'step %d: waiting for input took %.0f%% of the step time (%.1f ms of %.1f ms); the pipeline '
      'is too slow: raise data.worker_count (worker processes), data.prefetch (batches read ahead) or '
      'data.num_threads (read threads). See benchmarks/bench_data.py.', 300, step, 100 * share,
      1e3 * summary['data_wait_s'], 1e3 * summary['step_time_s'])
  return True
