"""Tokenizers given as one file: a SentencePiece model (`*.model`) or a tiktoken BPE file (`*.tiktoken`).

scripts/prepare_data.py encodes documents with them and keeps the file with the
shards (DATA/tokenizer/), so scripts/sample.py can encode a prompt and decode
the continuation of a run trained on them. The packages are optional: a file
whose package is missing is refused in one line naming the `pip install`.
Hugging Face tokenizer.json files are trainer/data/hf_tokenizer.py's.
"""

import dataclasses
import pathlib
from collections.abc import Callable

from trainer.base import confined
from trainer.base.errors import UserError

# The split pattern of OpenAI's cl100k_base: a .tiktoken file holds only the merges, not the pattern.
CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
                  r"""\s*[\r\n]|\s+(?!\S)|\s+""")
SUFFIXES = ('.model', '.tiktoken')


@dataclasses.dataclass(frozen=True)
class FileTokenizer:
  encode: Callable[[str], list[int]]
  decode: Callable[[list[int]], str]
  vocab_size: int
  name: str  # What meta.json records: 'sentencepiece:FILE' or 'tiktoken:FILE'.
  file: pathlib.Path


def load(path: str, flag: str = '--tokenizer') -> FileTokenizer:
  """The tokenizer of a .model or .tiktoken file; `flag` names where the path came from in errors."""
  file = pathlib.Path(path)
  if not file.is_file():
    raise UserError(f'{flag}={path!r} is not a file; give a local tokenizer.json (or its folder), SentencePiece '
                    f'.model or tiktoken file.')
  if file.suffix == '.model':
    try:
      import sentencepiece
    except ImportError:
      raise UserError(f'{flag}={path!r} is a SentencePiece model but the sentencepiece package is not '
                      f'installed; pip install sentencepiece.') from None
    try:
      sp = sentencepiece.SentencePieceProcessor(model_file=str(file))
    except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError for a file it cannot parse.
      raise UserError(f'{flag}={path!r} is not a SentencePiece model ({type(e).__name__}: {e}).') from None
    return FileTokenizer(sp.encode, sp.decode, sp.vocab_size(), f'sentencepiece:{file.name}', file)
  if file.suffix == '.tiktoken':
    try:
      import tiktoken
      from tiktoken.load import load_tiktoken_bpe
    except ImportError:
      raise UserError(f'{flag}={path!r} is a tiktoken file but the tiktoken package is not installed; '
                      f'pip install tiktoken.') from None
    try:
      ranks = load_tiktoken_bpe(str(file))
    except Exception as e:  # noqa: BLE001 - a malformed line surfaces as ValueError or binascii.Error.
      raise UserError(f'{flag}={path!r} is not a tiktoken BPE file (a base64 token and its rank per line; '
                      f'{type(e).__name__}: {e}).') from None
    encoding = tiktoken.Encoding(file.stem, pat_str=CL100K_PATTERN, mergeable_ranks=ranks, special_tokens={})
    return FileTokenizer(encoding.encode_ordinary, encoding.decode, encoding.n_vocab, f'tiktoken:{file.name}', file)
  raise UserError(f'{flag}={path!r}: unknown kind; use a tokenizer.json (or its folder), a SentencePiece .model '
                  f'or a .tiktoken file.')


def of_run(data_path: str, recorded: str) -> FileTokenizer | None:
  """The file tokenizer a run's shards were made with (meta.json's `tokenizer`, e.g. 'tiktoken:cl100k.tiktoken'),
  from DATA/tokenizer/; None when the shards were not made with one."""
  kind, _, name = recorded.partition(':')
  if kind not in ('sentencepiece', 'tiktoken') or not name:
    return None
  file = confined.inside(pathlib.Path(data_path) / 'tokenizer', name, f'{data_path}/meta.json')  # Its own file only.
  if not file.is_file():
    raise UserError(f'{data_path} was tokenized with {recorded} but {file} is missing (prepare_data.py keeps it '
                    f'there since 2026-11-25); copy that file there, or give the prompt as token ids.')
  return load(str(file), flag='the run\'s tokenizer')
