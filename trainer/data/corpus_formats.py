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

Input that cannot be read as what it claims to be (a truncated arrow or Parquet file, a JSONL line that is not
UTF-8 or holds a lone surrogate escape, a text file that cannot be read) is one UserError naming the file and the
line or row. Invalid UTF-8 in a text file is replaced with U+FFFD as before, but counted (`Replaced`) so that
prepare_data can say how much of the corpus it changed.
"""

import dataclasses
import json
import pathlib
import re
from collections.abc import Iterator

import numpy as np

from trainer.base.errors import UserError

_ESCAPED_BYTE = re.compile('[\udc80-\udcff]')  # What errors='surrogateescape' turns each undecodable byte into.


@dataclasses.dataclass(frozen=True)
class Document:
  key: bytes  # Hashed to pick the split.
  payload: str | np.ndarray  # Text to tokenize, or token ids already.


@dataclasses.dataclass
class Replaced:
  """Bytes of invalid UTF-8 replaced with U+FFFD in text files: per file, (bytes replaced, bytes in the file)."""
  files: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

  def warning(self) -> str:
    """One line naming the files (the five most changed), or '' when nothing was replaced."""
    if not self.files:
      return ''
    total, size = (sum(v[i] for v in self.files.values()) for i in (0, 1))
    worst = sorted(self.files.items(), key=lambda item: -item[1][0] / max(item[1][1], 1))[:5]
    named = ', '.join(f'{name!r} ({n:,} of {of:,} bytes, {n / max(of, 1):.1%})' for name, (n, of) in worst)
    more = f' and {len(self.files) - len(worst)} more' if len(self.files) > len(worst) else ''
    return (f'{total:,} byte(s) of invalid UTF-8 in {len(self.files)} text file(s) were replaced with U+FFFD '
            f'({total / max(size, 1):.2%} of their bytes): {named}{more}. Convert them to UTF-8 (e.g. iconv) or '
            f'leave them out with --glob.')


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


def input_files(root: pathlib.Path, kind: str, glob: str, split: str) -> list[pathlib.Path]:
  """Every file `read` reads, in its order: what a resume compares (trainer/data/staged_output.py)."""
  if kind == 'files':
    paths = sorted(p for p in root.glob(glob) if p.is_file())
    if not paths:
      raise UserError(f'--input={str(root)!r} has no files matching --glob={glob!r}; change --glob (e.g. '
                      f'"**/*.npy").')
    return paths
  if kind == 'parquet':
    return [root] if root.is_file() else sorted(p for p in root.glob(glob) if p.is_file())
  if kind == 'save_to_disk':
    folder = root / split if (root / 'dataset_dict.json').is_file() else root
    return [*(p for p in (root / 'dataset_dict.json', folder / 'state.json') if p.is_file()),
            *arrow_files(root, split)]
  return [root]


def read(root: pathlib.Path, kind: str, glob: str, text_column: str, split: str, batch_rows: int = 1024,
         replaced: Replaced | None = None) -> Iterator[Document]:
  """Every document of the corpus, in order (files sorted by path, rows in file order)."""
  if kind == 'files':
    yield from _files(root, input_files(root, kind, glob, split), replaced or Replaced())
  elif kind == 'parquet':
    for path in input_files(root, kind, glob, split):
      yield from _parquet(path, text_column, batch_rows)
  elif kind == 'save_to_disk':
    for path in arrow_files(root, split):
      yield from _arrow_stream(path, text_column)
  else:
    yield from _jsonl(root, text_column)


def _files(root: pathlib.Path, paths: list[pathlib.Path], replaced: Replaced) -> Iterator[Document]:
  for path in paths:
    key = str(path.relative_to(root)).encode()
    if path.suffix != '.npy':
      try:
        content = path.read_bytes()
      except OSError as e:
        raise UserError(f'cannot read {str(path)!r} ({e.strerror}); fix its permissions or leave it out with '
                        f'--glob.') from None
      yield Document(key, _text(content, str(path.relative_to(root)), replaced))
      continue
    try:
      tokens = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
      raise UserError(f'{str(path)!r} is not a readable .npy file ({e}); remove it or fix --glob.') from e
    if tokens.ndim != 1 or tokens.dtype.kind not in 'iu':
      raise UserError(f'{str(path)!r} holds a {tokens.dtype} array of shape {tokens.shape}; each .npy must be '
                      f'one document: a 1-D integer array of token ids.')
    yield Document(key, tokens)


def _text(content: bytes, name: str, replaced: Replaced) -> str:
  """The file's text; invalid UTF-8 replaced with U+FFFD (as it always was) and its bytes counted."""
  try:
    return content.decode()
  except UnicodeDecodeError:
    replaced.files[name] = (len(_ESCAPED_BYTE.findall(content.decode(errors='surrogateescape'))), len(content))
    return content.decode(errors='replace')


def _column(path: pathlib.Path, names: list[str], column: str) -> None:
  if column not in names:
    raise UserError(f'{str(path)!r} has no column {column!r} (its columns: {names}); set --text_column to the one '
                    f'holding the text.')


def _rows(path: pathlib.Path, column: str, batches) -> Iterator[Document]:
  """The documents of a column read batch by batch; a batch pyarrow cannot read names the file and the row."""
  import pyarrow as pa  # Only prepare_data.py reads Parquet and arrow; training never imports pyarrow.
  row, batches = 0, iter(batches)
  while True:
    try:
      batch = next(batches, None)
      values = None if batch is None else batch.column(column).to_pylist()
    except (OSError, ValueError, pa.ArrowException) as e:  # Truncated (OSError), corrupt (ArrowInvalid), not UTF-8.
      where = f' after its first {row} row(s)' if row else ''
      raise UserError(f'{str(path)!r} is truncated or corrupt{where} ({type(e).__name__}: '
                      f'{" ".join(str(e).split())}); write it again, or leave it out.') from None
    if values is None:
      return
    for number, value in enumerate(values, start=row):
      if not isinstance(value, str):
        held = 'null' if value is None else f'a {type(value).__name__}'
        raise UserError(f'{str(path)!r} row {number}: column {column!r} is {held}, not text; set --text_column to a '
                        f'string column, or drop the rows without text.')
      yield Document(value.encode(), value)
    row += len(values)


def _parquet(path: pathlib.Path, column: str, batch_rows: int) -> Iterator[Document]:
  import pyarrow.parquet as pq
  try:
    file = pq.ParquetFile(path)
  except Exception as e:  # noqa: BLE001 - pyarrow raises ArrowInvalid / OSError for a file it cannot parse.
    raise UserError(f'{str(path)!r} is not a readable Parquet file ({type(e).__name__}: {e}).') from None
  _column(path, file.schema_arrow.names, column)
  yield from _rows(path, column, file.iter_batches(batch_size=batch_rows, columns=[column]))


def arrow_files(root: pathlib.Path, split: str) -> list[pathlib.Path]:
  """The arrow files of a save_to_disk folder (a Dataset, or `split` of a DatasetDict), in order."""
  if (root / 'dataset_dict.json').is_file():
    try:
      splits = json.loads((root / 'dataset_dict.json').read_text()).get('splits', [])
    except (OSError, ValueError, AttributeError) as e:
      raise UserError(f'{str(root / "dataset_dict.json")!r} is not a DatasetDict index ({type(e).__name__}); give '
                      f'the folder DatasetDict.save_to_disk wrote.') from None
    if split not in splits:
      raise UserError(f'--input={str(root)!r} is a DatasetDict with splits {splits}; choose one with --split.')
    root = root / split
  try:
    files = json.loads((root / 'state.json').read_text())['_data_files']
    return [root / f['filename'] for f in files]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise UserError(f'{str(root / "state.json")!r} is missing or not a save_to_disk state ({type(e).__name__}); '
                    f'give the folder Dataset.save_to_disk wrote.') from None


def _arrow_stream(path: pathlib.Path, column: str) -> Iterator[Document]:
  import pyarrow as pa
  try:
    reader = pa.ipc.open_stream(pa.memory_map(str(path)))
  except Exception as e:  # noqa: BLE001 - a missing or foreign file: OSError / ArrowInvalid.
    raise UserError(f'{str(path)!r} is not a readable arrow file of a save_to_disk folder ({type(e).__name__}: '
                    f'{e}).') from None
  _column(path, reader.schema.names, column)
  yield from _rows(path, column, reader)


def json_lines(path: pathlib.Path) -> Iterator[tuple[str, object]]:
  """('FILE:LINE', value) of each non-blank line; one UserError naming the line for bytes that are not UTF-8 or
  text that is not JSON. Lines are split on '\\n' only: JSON strings may hold U+2028 and other line breaks."""
  with path.open('rb') as lines:
    for number, raw in enumerate(lines, start=1):
      where = f'{path}:{number}'
      try:
        line = raw.decode('utf-8-sig' if number == 1 else 'utf-8')
      except UnicodeDecodeError as e:
        raise UserError(f'{where} is not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); JSON Lines '
                        f'are UTF-8: convert the file (e.g. iconv) or remove the line.') from None
      if not line.strip():
        continue
      try:
        yield where, json.loads(line)
      except ValueError as e:
        raise UserError(f'{where} is not a JSON object ({e.msg}).') from None


def checked_text(value, where: str, what: str):
  """`value` (a string, or lists and objects of them); a lone surrogate escape ("\\ud800"), which JSON allows but no
  UTF-8 text holds, is one UserError naming the line and the field."""
  strings = [value]
  while strings:
    item = strings.pop()
    if isinstance(item, str):
      try:
        item.encode()
      except UnicodeEncodeError as e:
        raise UserError(f'{where}: {what} holds a lone surrogate escape (\\u{ord(item[e.start]):04x} at character '
                        f'{e.start}), which is not text; fix or remove the line.') from None
    elif isinstance(item, (list, dict)):
      strings.extend(item.values() if isinstance(item, dict) else item)
  return value


def _jsonl(path: pathlib.Path, field: str) -> Iterator[Document]:
  for where, record in json_lines(path):
    if not isinstance(record, dict):
      raise UserError(f'{where} is a JSON {type(record).__name__}, not an object with the text field {field!r}.')
    if field not in record:
      raise UserError(f'{where} has {sorted(record)}, no text field {field!r}; set --text_column to the field '
                      f'holding the text.')
    value = record[field]
    if not isinstance(value, str):
      held = 'null' if value is None else f'a JSON {type(value).__name__}'
      raise UserError(f'{where}: the text field {field!r} is {held}, not a string; fix or remove the line, or set '
                      f'--text_column to the field holding the text.')
    yield Document(checked_text(value, where, f'the text field {field!r}').encode(), value)


def is_finetune_jsonl(path: pathlib.Path, text_column: str | None = None) -> bool:
  """Whether a .jsonl file holds fine-tuning pairs, chats or preference pairs: its first object has "prompt",
  "messages" or "chosen", and --text_column was not given (`text_column` None); one UserError for a file with no JSON line at all."""
  for _, record in json_lines(path):
    if text_column is not None:
      return False  # The user named the field holding the text: pretraining, whatever else a line carries.
    return isinstance(record, dict) and any(k in record for k in ('prompt', 'messages', 'chosen'))
  raise UserError(f'--input={str(path)!r} holds no JSON line (it is empty or blank); give one object a line: '
                  f'{{"text": ...}} documents, or {{"prompt": ..., "completion": ...}} / {{"messages": [...]}} '
                  f'fine-tuning examples.')
