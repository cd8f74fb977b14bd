"""The byte-level text source: every file under `data.text_dir` is one document of raw bytes.

The default is the running Python's standard library. A hash of each file's
path decides whether it is held out for eval, so the split is the same on every
host and every run.
"""

import dataclasses
import os
import pathlib
import zlib

import numpy as np
from absl import logging

from trainer.base.errors import UserError
from trainer.data.documents import InMemoryDocuments, StreamWindows


@dataclasses.dataclass(frozen=True)
class TextCorpus:
  train_tokens: np.ndarray  # uint8 bytes of the train files, concatenated.
  eval_tokens: np.ndarray  # uint8 bytes of the held-out files, concatenated.
  num_train_files: int
  num_eval_files: int
  root: pathlib.Path
  train_starts: np.ndarray  # Offset of each train file (document) in train_tokens.
  eval_starts: np.ndarray

  def documents(self, split: str) -> InMemoryDocuments:
    tokens, starts = (self.train_tokens, self.train_starts) if split == 'train' else (self.eval_tokens, self.eval_starts)
    return InMemoryDocuments(tokens, starts, f'the {split} text under {str(self.root)!r}')


def default_text_dir() -> pathlib.Path:
  """The running interpreter's standard library: real text on every machine that has Python."""
  return pathlib.Path(os.__file__).parent


_INSTALLED = frozenset({'site-packages', 'dist-packages'})  # Installed packages are not the stdlib's text.


def _matching_files(root: pathlib.Path, file_glob: str) -> list[pathlib.Path]:
  """The files under root that match file_glob, outside installed packages, sorted.

  A leading '**/' is expanded one top-level folder at a time so the glob never
  walks a top-level site-packages it would then drop: on the CI machine's
  stdlib (59,425 entries, 1790 files kept) one glob took 0.39 s and this 0.04 s
  (benchmarks/bench_text_listing.py), at every launch. The files are one glob's.
  """
  if file_glob.startswith('**/'):
    found = set(root.glob(file_glob[3:]))
    for child in root.iterdir():
      # pathlib's '**' does not descend into a linked folder either.
      if child.name not in _INSTALLED and child.is_dir() and not child.is_symlink():
        found.update(child.glob(file_glob))
  else:
    found = set(root.glob(file_glob))
  return sorted(p for p in found if p.is_file() and not _INSTALLED & set(p.relative_to(root).parts))


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
  paths = _matching_files(root, data_config.file_glob)
  if not paths:
    raise UserError(f'{setting} has no files matching data.file_glob={data_config.file_glob!r}; '
                    f'expected text files there (or change data.file_glob, e.g. "**/*.txt").')
  train_parts, eval_parts, binary = [], [], []
  for path in paths:
    try:
      content = path.read_bytes()
    except OSError as e:
      raise UserError(f'cannot read {str(path)!r} under {setting}: {e.strerror}; fix its permissions or remove it.')
    if _is_binary(content):
      binary.append(path.relative_to(root))
    is_eval = _is_eval_file(str(path.relative_to(root)), data_config.eval_percent)
    (eval_parts if is_eval else train_parts).append(content)
  _check_text(binary, len(paths), setting, data_config.file_glob)
  num_train, num_eval = len(train_parts), len(eval_parts)
  train = np.frombuffer(b''.join(train_parts), np.uint8)
  eval_ = np.frombuffer(b''.join(eval_parts), np.uint8)
  train_starts, eval_starts = _starts(train_parts), _starts(eval_parts)
  if data_config.eval_percent and not (train_parts and eval_parts):
    # Too few files for a file-level split: hold out the tail of the text instead.
    everything = np.frombuffer(b''.join(train_parts + eval_parts), np.uint8)
    cut = len(everything) * (100 - data_config.eval_percent) // 100
    train, eval_ = everything[:cut], everything[cut:]
    train_starts, eval_starts = np.zeros(1, np.int64), np.zeros(1, np.int64)
    num_train, num_eval = len(paths), 0
    logging.info('%s: %d file(s) are too few for a file-level eval split; holding out the last %d%% of the bytes.',
                 setting, len(paths), data_config.eval_percent)
  if not train.size:
    raise UserError(f'{setting}: the files matching {data_config.file_glob!r} are empty; expected text in them.')
  return TextCorpus(train, eval_, num_train, num_eval, root, train_starts, eval_starts)


_CONTROL = np.zeros(256, bool)
_CONTROL[[*range(0, 8), *range(14, 27), *range(28, 32), 127]] = True  # Not \b \t \n \v \f \r or ESC.
_BINARY_CONTROL_SHARE = 0.05


def _is_binary(content: bytes) -> bool:
  """A NUL byte, or over 5% control bytes in the first 8 KiB, much as `file` and Perl's -B judge it.

  Text in a legacy encoding (latin-1, koi8-r) has high bytes but almost no
  control bytes, so it stays text; random or compressed bytes have about 12%.
  """
  head = np.frombuffer(content[:1 << 13], np.uint8)
  return bool(head.size) and (not head.all() or _CONTROL[head].mean() > _BINARY_CONTROL_SHARE)


def _check_text(binary: list[pathlib.Path], num_files: int, setting: str, file_glob: str) -> None:
  """Refuses a corpus that is mostly binary files; warns, naming them, when a few are."""
  if not binary:
    return
  examples = ', '.join(repr(str(p)) for p in binary[:3]) + (' ...' if len(binary) > 3 else '')
  if 2 * len(binary) > num_files:
    raise UserError(f'{setting}: {len(binary)} of the {num_files} files matching data.file_glob={file_glob!r} are not '
                    f'text (NUL or control bytes: {examples}); the byte-level model would learn their bytes. Point '
                    f'data.text_dir at text, narrow data.file_glob, or use data.source=\'array_record\' for tokens.')
  logging.warning('%s: %d of the %d files are not text (NUL or control bytes: %s); they are trained on as bytes. '
                  'Narrow data.file_glob to leave them out.', setting, len(binary), num_files, examples)


def _starts(parts: list[bytes]) -> np.ndarray:
  return np.concatenate([[0], np.cumsum([len(p) for p in parts[:-1]])]).astype(np.int64) if parts else np.zeros(0, np.int64)


class TextWindows(StreamWindows):
  """Byte windows over one array of text (the default job's examples): StreamWindows over a single document."""

  def __init__(self, tokens: np.ndarray, seq_len: int):
    super().__init__(InMemoryDocuments(tokens, np.zeros(1, np.int64), 'text'), seq_len)


