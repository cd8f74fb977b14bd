"""A Hugging Face fast tokenizer as users have it: a model folder, or its tokenizer.json alone.

Llama 3 and Qwen ship only tokenizer.json (no SentencePiece model); the
`tokenizers` package reads it. Whether a document starts with BOS and ends with
EOS is what tokenizer_config.json (beside tokenizer.json) says: `add_bos_token` /
`add_eos_token` with `bos_token` / `eos_token`. Without those keys, the
tokenizer's own post-processor decides (Llama 3's adds <|begin_of_text|>), as
transformers does. Nothing is downloaded.
"""

import dataclasses
import json
import pathlib

from trainer.errors import UserError

FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'chat_template.jinja')


@dataclasses.dataclass(frozen=True)
class HfTokenizer:
  tokenizer: object  # tokenizers.Tokenizer
  bos_id: int | None  # Prepended to each document when tokenizer_config.json says add_bos_token.
  eos_id: int | None  # Appended to each document when it says add_eos_token.
  files: tuple[pathlib.Path, ...]  # The tokenizer's files, to keep with prepared data and exported models.
  config: dict  # tokenizer_config.json ({} when there is none).

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, document: bool = True) -> list[int]:
    """Token ids of `text`; a whole `document` gets BOS/EOS as the config says (a piece of one gets neither)."""
    if not document:
      return self.tokenizer.encode(text, add_special_tokens=False).ids
    # A config that names add_bos_token/add_eos_token decides alone; else the tokenizer's post-processor does.
    own = 'add_bos_token' in self.config or 'add_eos_token' in self.config
    ids = self.tokenizer.encode(text, add_special_tokens=not own).ids
    if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
      ids = [self.bos_id] + ids
    if self.eos_id is not None and (not ids or ids[-1] != self.eos_id):
      ids = ids + [self.eos_id]
    return ids

  def decode(self, ids: list[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=False)


def is_hf_tokenizer(path: str) -> bool:
  p = pathlib.Path(path)
  return p.is_dir() or p.name.endswith('tokenizer.json')


def _special_id(tok, config: dict, key: str, path) -> int | None:
  if not config.get(f'add_{key}_token'):
    return None
  token = config.get(f'{key}_token')
  token = token.get('content') if isinstance(token, dict) else token
  token_id = tok.token_to_id(token) if token else None
  if token_id is None:
    raise UserError(f'{path}: tokenizer_config.json sets add_{key}_token but its {key}_token {token!r} is not in '
                    f'tokenizer.json.')
  return token_id


def load(path: str, flag: str = '--tokenizer') -> HfTokenizer:
  """The tokenizer of a folder holding tokenizer.json, or of a tokenizer.json file; one UserError otherwise."""
  try:
    import tokenizers
  except ImportError:
    raise UserError(f'{flag}={path!r} is a Hugging Face tokenizer but the tokenizers package is not installed; '
                    f'pip install -r requirements.txt.') from None
  given = pathlib.Path(path)
  file = given / 'tokenizer.json' if given.is_dir() else given
  if not file.is_file():
    raise UserError(f'{flag}={path!r}: no tokenizer.json there; give a model folder holding tokenizer.json, or the '
                    f'file itself.')
  try:
    tok = tokenizers.Tokenizer.from_file(str(file))
  except Exception as e:  # The Rust side raises its own exception type.
    raise UserError(f'{flag}={path!r}: {file} is not a readable tokenizer.json ({str(e)[:160]}).') from e
  config_file = file.parent / 'tokenizer_config.json'
  config = json.loads(config_file.read_text()) if config_file.is_file() else {}
  files = tuple(file.parent / name for name in FILES if (file.parent / name).is_file())
  return HfTokenizer(tok, _special_id(tok, config, 'bos', f'{flag}={path!r}'),
                     _special_id(tok, config, 'eos', f'{flag}={path!r}'), files, config)
