"""Text to the run's tokens and back: bytes, the Hugging Face tokenizer it came with, or its SentencePiece/tiktoken file.

The same choice scripts/sample.py makes (its `byte_level` and `text_codec`), made here for the trainer, which does not
import scripts; a run whose tokens came with no tokenizer (arrays, synthetic) cannot read a task's text, and says so
before the compile.
"""

import dataclasses
import json
import pathlib
from collections.abc import Callable

from trainer.base.errors import UserError


@dataclasses.dataclass(frozen=True)
class Codec:
  encode: Callable[[str], list[int]]  # A piece of text, no special tokens.
  decode: Callable[[list[int]], str]
  prefix: tuple[int, ...] = ()  # Special tokens that start a document (BOS): put before every prompt.
  eos: tuple[int, ...] = ()  # Tokens that end a generation as a stop string does.


def _bytes_codec() -> Codec:
  return Codec(lambda text: list(text.encode('utf-8')), lambda ids: bytes(ids).decode('utf-8', errors='replace'))


def for_run(config) -> Codec:
  """The codec of the run `config` trained (config.data and config.model are read)."""
  from trainer.data import file_tokenizers
  from trainer.data import hf_tokenizer
  data = config.data
  from trainer.data import prepared
  prepared_folder = prepared.folder(data)
  meta = (prepared_folder or pathlib.Path('')) / 'meta.json'
  recorded = json.loads(meta.read_text()).get('tokenizer', '') if prepared_folder and meta.is_file() else ''
  if data.source == 'text' or recorded == 'bytes':
    return _bytes_codec()
  folder = hf_tokenizer.run_folder(config)
  if folder is not None:
    tok = hf_tokenizer.load(str(folder), flag="the run's tokenizer")
    return Codec(lambda text: tok.encode(text, document=False), tok.decode, tuple(tok.prefix),
                 tuple(tok.suffix) or ((tok.eos_id,) if tok.eos_id is not None else ()))
  if recorded:
    tok = file_tokenizers.of_run(str(prepared_folder), recorded)
    if tok is not None:
      return Codec(lambda text: list(tok.encode(text)), lambda ids: tok.decode(list(ids)))
  raise UserError(f'eval.tasks: this run\'s tokens came with no tokenizer (data.source={data.source!r}), so task '
                  f'files\' text cannot be encoded; train on text or tokenized shards, or set --config.eval.tasks=().')
