"""ArrayRecord token shards, as written by scripts/prepare_data.py: one record per document.

Layout of a prepared folder (`data.path`):
  meta.json                                   {"format": ..., "dtype", "vocab_size", "tokenizer", "splits",
                                               "loss_mask" (fine-tuning data: true)}
  train-00000-of-00004.array_record, ...      records: the document's tokens, raw little-endian `dtype`; with
                                              "loss_mask", followed by as many mask values (1 = trained)
  train.lengths.npy                           tokens per document, in shard order
  eval-00000-of-00001.array_record, eval.lengths.npy   (when prepare_data held files out)

The lengths index lets the pipeline pack and shuffle without reading the data
first; every shard is opened and its record count checked against the index
before training starts, so a missing, truncated or foreign file fails in
seconds with its name.
"""

import io
import json
import pathlib

import grain
import numpy as np

from trainer.base import confined
from trainer.base.errors import UserError
from trainer.data.documents import Documents

FORMAT = 'jax-launch token shards v1'
REPREPARE = 're-run scripts/prepare_data.py into a fresh folder and point data.path at it'


def shard_name(split: str, index: int, count: int) -> str:
  return f'{split}-{index:05d}-of-{count:05d}.array_record'


class ShardDocuments(Documents):
  """Documents read lazily, record by record, from ArrayRecord shards (picklable for Grain workers)."""

  def __init__(self, paths: list[pathlib.Path], lengths: np.ndarray, dtype: str, name: str, has_mask: bool = False):
    self.paths, self.lengths, self.dtype, self.name = paths, lengths, np.dtype(dtype), name
    self.has_mask = has_mask
    self._source = None

  def _records(self):
    if self._source is None:  # Opened in the process that reads, so a Grain worker opens its own.
      self._source = grain.sources.ArrayRecordDataSource([str(p) for p in self.paths])
    return self._source

  def span(self, d, a, b):
    return np.frombuffer(self._records()[d], self.dtype)[a:b]

  def mask_span(self, d, a, b):
    n = int(self.lengths[d])
    return np.frombuffer(self._records()[d], self.dtype)[n + a:n + b]

  def __getstate__(self):
    return dict(self.__dict__, _source=None)


def read_meta(root: pathlib.Path) -> dict:
  if not root.is_dir():
    raise UserError(f'data.path={str(root)!r} does not exist or is not a folder; point it at a folder written by '
                    f'scripts/prepare_data.py.')
  meta_path = root / 'meta.json'
  try:
    meta = json.loads(meta_path.read_text())
  except (OSError, ValueError) as e:
    raise UserError(f'{str(meta_path)!r} is missing or unreadable ({type(e).__name__}): data.path must be a folder '
                    f'written by scripts/prepare_data.py; {REPREPARE}.') from e
  if meta.get('format') != FORMAT:
    raise UserError(f'{str(meta_path)!r} is not a {FORMAT!r} folder; {REPREPARE}.')
  return meta


def load_documents(root: pathlib.Path, split: str) -> ShardDocuments | None:
  """The split's documents, every shard checked; None if the folder has no such split."""
  meta = read_meta(root)
  if split not in meta['splits']:
    return None
  info = meta['splits'][split]
  paths = [root / name for name in info['shards']]
  lengths_path = root / info['lengths']
  try:
    lengths = np.load(lengths_path).astype(np.int64)
  except (OSError, ValueError) as e:
    raise UserError(f'{str(lengths_path)!r} is missing or damaged ({type(e).__name__}); {REPREPARE}.') from e
  first, arrays = 0, 2 if meta.get('loss_mask') else 1  # Tokens, and their mask.
  for path, count in zip(paths, info['records_per_shard']):
    _check_shard(path, count, lengths[first:first + count] * arrays, meta['dtype'])
    first += count
  if first != len(lengths):
    raise UserError(f'{str(lengths_path)!r} lists {len(lengths)} documents but the shards hold {first}; {REPREPARE}.')
  short = np.flatnonzero(lengths < 2)
  if short.size:
    path, record = _locate(paths, info['records_per_shard'], int(short[0]))
    raise UserError(f'{str(path)!r} record {record} holds {lengths[short[0]]} token(s) ({short.size} such document(s) '
                    f'in the {split} split): a document needs at least 2 tokens (an input and its next-token target). '
                    f'scripts/prepare_data.py drops such documents; {REPREPARE}.')
  return ShardDocuments(paths, lengths, meta['dtype'], f'the {split} shards in {str(root)!r}',
                        has_mask=bool(meta.get('loss_mask')))


def _check_shard(path: pathlib.Path, count: int, lengths: np.ndarray, dtype: str) -> None:
  """Opens one shard and reads its first and last record: a truncated or foreign file fails here, by name."""
  if not path.is_file():
    raise UserError(f'shard {str(path)!r} listed in meta.json is missing; {REPREPARE}.')
  try:
    source = grain.sources.ArrayRecordDataSource([str(path)])
    ok = len(source) == count and all(
        len(source[i]) == lengths[i] * np.dtype(dtype).itemsize for i in {0, count - 1} if count)
  except Exception as e:  # array_record raises bare RuntimeErrors (often with no message) on damaged files.
    raise UserError(f'shard {str(path)!r} is corrupt or truncated (array_record: {type(e).__name__} '
                    f'{str(e)[:120]!r}); {REPREPARE}.') from e
  if not ok:
    raise UserError(f'shard {str(path)!r} does not match meta.json and its lengths index (expected {count} records); '
                    f'{REPREPARE}.')


def _locate(paths, records_per_shard, index: int) -> tuple[pathlib.Path, int]:
  for path, count in zip(paths, records_per_shard):
    if index < count:
      return path, index
    index -= count
  raise IndexError(index)


def write_shards(root: pathlib.Path, splits: dict[str, list[np.ndarray]], vocab_size: int, tokenizer: str,
                 num_shards: int, masks: dict[str, list[np.ndarray]] | None = None) -> dict:
  """Writes each split's documents round-robin into `num_shards` shards, plus lengths and meta.json; returns meta.

  `masks` (per split, one array per document, as long as it): each record then holds the tokens and their mask.
  """
  dtype = token_dtype(vocab_size)
  meta = new_meta(vocab_size, tokenizer, dtype, masks is not None)
  for split, docs in splits.items():
    records = (docs[i] if masks is None else np.concatenate([docs[i], masks[split][i]]) for i in range(len(docs)))
    meta['splits'][split] = write_split(root, split, np.array([len(d) for d in docs], np.int64), records,
                                        num_shards, dtype)
  write_meta(root, meta)
  return meta


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def new_meta(vocab_size: int, tokenizer: str, dtype: np.dtype, loss_mask: bool = False) -> dict:
  meta = {'format': FORMAT, 'dtype': dtype.name, 'vocab_size': vocab_size, 'tokenizer': tokenizer, 'splits': {}}
  if loss_mask:
    meta['loss_mask'] = True
  return meta


def write_meta(root: pathlib.Path, meta: dict) -> None:
  confined.write_text(root / 'meta.json', json.dumps(meta, indent=1) + '\n')


def write_split(root: pathlib.Path, split: str, lengths: np.ndarray, records, num_shards: int,
                dtype: np.dtype) -> dict:
  """Streams one split's records (in order; `lengths` tokens each) into contiguous shards; returns its meta entry."""
  from array_record.python.array_record_module import ArrayRecordWriter  # Only the writer needs it directly.
  count = max(1, min(num_shards, len(lengths)))
  # Contiguous runs of documents per shard, so document order = shard order = the lengths index.
  bounds = np.linspace(0, len(lengths), count + 1).astype(int)
  names = [shard_name(split, i, count) for i in range(count)]
  records = iter(records)
  for name, lo, hi in zip(names, bounds[:-1], bounds[1:]):
    confined.check_target(root / name)  # The writer opens the file itself, following a link.
    writer = ArrayRecordWriter(str(root / name), 'group_size:1')
    for _ in range(lo, hi):
      writer.write(np.asarray(next(records), dtype).tobytes())
    writer.close()
  lengths_npy = io.BytesIO()
  np.save(lengths_npy, np.asarray(lengths, np.int64))
  confined.write_bytes(root / f'{split}.lengths.npy', lengths_npy.getvalue())
  return {'shards': names, 'records_per_shard': np.diff(bounds).tolist(), 'lengths': f'{split}.lengths.npy',
          'documents': int(len(lengths)), 'tokens': int(np.sum(lengths))}
