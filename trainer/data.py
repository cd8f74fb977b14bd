"""Byte-level text data through Grain, sharded over processes and assembled into global batches.

Every file under `data.text_dir` (default: the running Python's standard library)
is read as raw bytes; a hash of each file's path decides whether it is held out
for eval, so the split is the same on every host and every run. Training
examples are windows of `seq_len + 1` bytes over the concatenated train files.

Sharding: the globally shuffled, repeated sequence of windows is split
round-robin over processes (`process_index::process_count`), each process batches
its own share, and `jax.make_array_from_process_local_data` stitches the
per-process pieces into one global array on the batch sharding. The Grain
iterator's state is a position in that sequence, saved with every checkpoint.
"""

import dataclasses
import os
import pathlib
import zlib

import grain
import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding

from trainer.errors import UserError


@dataclasses.dataclass(frozen=True)
class TextCorpus:
  train_tokens: np.ndarray  # uint8 bytes of the train files, concatenated.
  eval_tokens: np.ndarray  # uint8 bytes of the held-out files, concatenated.
  num_train_files: int
  num_eval_files: int
  root: pathlib.Path


def default_text_dir() -> pathlib.Path:
  """The running interpreter's standard library: real text on every machine that has Python."""
  return pathlib.Path(os.__file__).parent


def _is_eval_file(relative_path: str, eval_percent: int) -> bool:
  return zlib.crc32(relative_path.encode()) % 100 < eval_percent


def load_text_corpus(data_config) -> TextCorpus:
  """Reads and splits the corpus; raises UserError naming the path when it is unusable."""
  root = pathlib.Path(data_config.text_dir) if data_config.text_dir else default_text_dir()
  setting = f'data.text_dir={str(root)!r}' if data_config.text_dir else f'the standard library at {str(root)!r}'
  if not root.exists():
    raise UserError(f'{setting} does not exist; point data.text_dir at a folder of text files.')
  if not root.is_dir():
    raise UserError(f'{setting} is not a folder; point data.text_dir at a folder of text files.')
  if not os.access(root, os.R_OK | os.X_OK):
    raise UserError(f'{setting} is not readable by this user; fix its permissions or choose another folder.')
  paths = sorted(p for p in root.glob(data_config.file_glob)
                 if p.is_file() and not {'site-packages', 'dist-packages'} & set(p.relative_to(root).parts))
  if not paths:
    raise UserError(f'{setting} has no files matching data.file_glob={data_config.file_glob!r}; '
                    f'expected text files there (or change data.file_glob, e.g. "**/*.txt").')
  train_parts, eval_parts = [], []
  for path in paths:
    try:
      content = path.read_bytes()
    except OSError as e:
      raise UserError(f'cannot read {str(path)!r} under {setting}: {e.strerror}; fix its permissions or remove it.')
    is_eval = _is_eval_file(str(path.relative_to(root)), data_config.eval_percent)
    (eval_parts if is_eval else train_parts).append(content)
  num_train, num_eval = len(train_parts), len(eval_parts)
  train = np.frombuffer(b''.join(train_parts), np.uint8)
  eval_ = np.frombuffer(b''.join(eval_parts), np.uint8)
  if data_config.eval_percent and not (train_parts and eval_parts):
    # Too few files for a file-level split: hold out the tail of the text instead.
    everything = np.frombuffer(b''.join(train_parts + eval_parts), np.uint8)
    cut = len(everything) * (100 - data_config.eval_percent) // 100
    train, eval_ = everything[:cut], everything[cut:]
    num_train, num_eval = len(paths), 0
    logging.info('%s: %d file(s) are too few for a file-level eval split; holding out the last %d%% of the bytes.',
                 setting, len(paths), data_config.eval_percent)
  if not train.size:
    raise UserError(f'{setting}: the files matching {data_config.file_glob!r} are empty; expected text in them.')
  return TextCorpus(train, eval_, num_train, num_eval, root)


class TextWindows:
  """Grain random-access source: example i is bytes [i*L, i*L + L + 1) as inputs/targets."""

  def __init__(self, tokens: np.ndarray, seq_len: int):
    self._tokens = tokens
    self._seq_len = seq_len

  def __len__(self) -> int:
    return max(0, (len(self._tokens) - 1) // self._seq_len)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    start = index * self._seq_len
    window = self._tokens[start:start + self._seq_len + 1].astype(np.int32)
    return {'inputs': window[:-1], 'targets': window[1:]}

  def __repr__(self) -> str:
    return f'TextWindows(num_bytes={len(self._tokens)}, seq_len={self._seq_len})'


def _check_enough(source: TextWindows, batch_size: int, what: str, root: pathlib.Path, seq_len: int) -> None:
  if len(source) < batch_size:
    raise UserError(
        f'the {what} text under {str(root)!r} makes {len(source)} sequences of data.seq_len={seq_len}, fewer than '
        f'one global batch (train.batch_size={batch_size}); add text, or lower data.seq_len or train.batch_size.')


def train_iterator(corpus: TextCorpus, data_config, batch_size: int, seed: int,
                   process_index: int, process_count: int) -> grain.DatasetIterator:
  """An endless, checkpointable iterator of this process's share of each global batch (numpy)."""
  source = TextWindows(corpus.train_tokens, data_config.seq_len)
  _check_enough(source, batch_size, 'train', corpus.root, data_config.seq_len)
  ds = grain.MapDataset.source(source).seed(seed).shuffle().repeat()
  ds = ds[process_index::process_count].batch(batch_size // process_count, drop_remainder=True)
  read = grain.ReadOptions(num_threads=data_config.num_threads, prefetch_buffer_size=data_config.prefetch_buffer_size)
  return iter(ds.to_iter_dataset(read))


def eval_batches(corpus: TextCorpus, data_config, batch_size: int, num_batches: int,
                 process_index: int, process_count: int) -> list[dict[str, np.ndarray]]:
  """The fixed held-out batches (this process's share), the same at every evaluation."""
  source = TextWindows(corpus.eval_tokens, data_config.seq_len)
  if num_batches == 0 or not data_config.eval_percent:
    return []
  _check_enough(source, batch_size, 'held-out', corpus.root, data_config.seq_len)
  num_batches = min(num_batches, len(source) // batch_size)
  ds = grain.MapDataset.source(source)[:num_batches * batch_size]
  ds = ds[process_index::process_count].batch(batch_size // process_count, drop_remainder=True)
  return list(ds)


def to_global(local_batch: dict[str, np.ndarray], batch_sharding: NamedSharding,
              process_count: int) -> dict[str, jax.Array]:
  """Stitches every process's local rows into one global jax.Array per key."""
  return {
      key: jax.make_array_from_process_local_data(
          batch_sharding, value, (value.shape[0] * process_count,) + value.shape[1:])
      for key, value in local_batch.items()
  }
