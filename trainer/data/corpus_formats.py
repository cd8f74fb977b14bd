"""The corpora scripts/prepare_data.py reads, as one stream of documents in a fixed order.

  a folder of files      each file one document: text, or a `.npy` 1-D array of token ids;
  `*.parquet` files      a file, or a folder of them: one document per row of the text column (pyarrow);
  a `save_to_disk` folder  Hugging Face `datasets` saved with `save_to_disk`: `state.json` names the arrow files
                         (IPC stream format, read with pyarrow); a DatasetDict folder (`dataset_dict.json`) reads
                         the split `--split` names;
  a `.jsonl` file        one document per line, the text field's string (a prompt/completion file is fine-tuning
                         data, read by trainer/data/finetune_jsonl.py instead).

Each document is `Document(key, payload)`: `payload` is the text (str) or token ids (np.ndarray), `key` the bytes
whose hash picks the split: the file's path for a folder of files, the text itself for a row, so that the same
text is held out the same way whatever file or row it came in.
"""

import dataclasses
import json
import pathlib
from collections.abc import Iterator

import numpy as np

from trainer.base.errors import UserError


@dataclasses.dataclass(frozen=True)
class Document:
  key: bytes  # Hashed to pick the split.
  payload: str | np.ndarray  # Text to tokenize, or token ids already.


def detect(root: pathlib.Path, glob: str) -> str:
  """'files', 'parquet', 'save_to_disk' or 'jsonl' for --input; one UserError when it is none of them."""
  if root.is_file():
    if root.suffix == '.parquet':
      return 'parquet'
    if root.suffix == '.jsonl':
      return 'jsonl'
    raise UserError(f'--input={str(root)!r} is a file but neither .parquet nor .jsonl; give a folder of text files, '
                    f'a Parquet file or folder, a save_to_disk folder or a .jsonl file.')
  if not root.is_dir():
    raise UserError(f'--input={str(root)!r} is not a folder; give a folder of text files or .npy token arrays, '
                    f'Parquet files, a save_to_disk folder or a .jsonl file.')
  if (root / 'state.json').is_file() or (root / 'dataset_dict.json').is_file():
    return 'save_to_disk'
  files = [p for p in root.glob(glob) if p.is_file()]
  if files and all(p.suffix == '.parquet' for p in files):
    return 'parquet'
  return 'files'


def read(root: pathlib.Path, kind: str, glob: str, text_column: str, split: str,
         batch_rows: int = 1024) -> Iterator[Document]:
  """Every document of the corpus, in order (files sorted by path, rows in file order)."""
  if kind == 'files':
    yield from _files(root, glob)
  elif kind == 'parquet':
    for path in ([root] if root.is_file() else sorted(p for p in root.glob(glob) if p.is_file())):
      yield from _parquet(path, text_column, batch_rows)
  elif kind == 'save_to_disk':
    for path in arrow_files(root, split):
      yield from _arrow_stream(path, text_column)
  else:
    yield from _jsonl(root, text_column)


def _files(root: pathlib.Path, glob: str) -> Iterator[Document]:
  paths = sorted(p for p in root.glob(glob) if p.is_file())
  if not paths:
    raise UserError(f'--input={str(root)!r} has no files matching --glob={glob!r}; change --glob (e.g. "**/*.npy").')
  for path in paths:
    key = str(path.relative_to(root)).encode()
    if path.suffix != '.npy':
      yield Document(key, path.read_text(errors='replace'))
      continue
    try:
      tokens = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
      raise UserError(f'{str(path)!r} is not a readable .npy file ({e}); remove it or fix --glob.') from e
    if tokens.ndim != 1 or tokens.dtype.kind not in 'iu':
      raise UserError(f'{str(path)!r} holds a {tokens.dtype} array of shape {tokens.shape}; each .npy must be '
                      f'one document: a 1-D integer array of token ids.')
    yield Document(key, tokens)


def _column(path: pathlib.Path, names: list[str], column: str) -> None:
  if column not in names:
    raise UserError(f'{str(path)!r} has no column {column!r} (its columns: {names}); set --text_column to the one '
                    f'holding the text.')


def _rows(path: pathlib.Path, column: str, values) -> Iterator[Document]:
  for value in values:
    if not isinstance(value, str):
      raise UserError(f'{str(path)!r} column {column!r} holds {type(value).__name__} values, not text; set '
                      f'--text_column to a string column.')
    yield Document(value.encode(), value)


def _parquet(path: pathlib.Path, column: str, batch_rows: int) -> Iterator[Document]:
  import pyarrow.parquet as pq  # Only prepare_data.py reads Parquet; training never imports pyarrow.
  try:
    file = pq.ParquetFile(path)
  except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid / OSError for a file it cannot parse.
    raise UserError(f'{str(path)!r} is not a readable Parquet file ({type(e).__name__}: {e}).') from None
  _column(path, file.schema_arrow.names, column)
  for batch in file.iter_batches(batch_size=batch_rows, columns=[column]):
    yield from _rows(path, column, batch.column(0).to_pylist())


def arrow_files(root: pathlib.Path, split: str) -> list[pathlib.Path]:
  """The arrow files of a save_to_disk folder (a Dataset, or `split` of a DatasetDict), in order."""
  if (root / 'dataset_dict.json').is_file():
    splits = json.loads((root / 'dataset_dict.json').read_text()).get('splits', [])
    if split not in splits:
      raise UserError(f'--input={str(root)!r} is a DatasetDict with splits {splits}; choose one with --split.')
    root = root / split
  try:
    files = json.loads((root / 'state.json').read_text())['_data_files']
  except (OSError, ValueError, KeyError) as e:
    raise UserError(f'{str(root / "state.json")!r} is missing or not a save_to_disk state ({type(e).__name__}); '
                    f'give the folder Dataset.save_to_disk wrote.') from None
  return [root / f['filename'] for f in files]


def _arrow_stream(path: pathlib.Path, column: str) -> Iterator[Document]:
  import pyarrow as pa
  try:
    reader = pa.ipc.open_stream(pa.memory_map(str(path)))
  except Exception as e:  # noqa: BLE001 - a missing or foreign file: OSError / ArrowInvalid.
    raise UserError(f'{str(path)!r} is not a readable arrow file of a save_to_disk folder ({type(e).__name__}: '
                    f'{e}).') from None
  _column(path, reader.schema.names, column)
  for batch in reader:
    yield from _rows(path, column, batch.column(column).to_pylist())


def _jsonl(path: pathlib.Path, field: str) -> Iterator[Document]:
  with path.open() as lines:
    for number, line in enumerate(lines, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except ValueError as e:
        raise UserError(f'{path}:{number} is not a JSON object ({e.msg}).') from None
      value = record.get(field) if isinstance(record, dict) else None
      if not isinstance(value, str):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise UserError(f'{path}:{number} has {keys}, no text field {field!r}; set --text_column to the field '
                        f'holding the text.')
      yield Document(value.encode(), value)


def is_finetune_jsonl(path: pathlib.Path) -> bool:
  """Whether a .jsonl file holds fine-tuning pairs or chats (its first object has "prompt" or "messages")."""
  with path.open() as lines:
    for line in lines:
      if line.strip():
        try:
          record = json.loads(line)
        except ValueError:
          return True  # Let the fine-tuning reader name the bad line as it always did.
        return isinstance(record, dict) and ('prompt' in record or 'messages' in record)
  return True
