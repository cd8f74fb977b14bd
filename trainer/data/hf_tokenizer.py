"""A Hugging Face fast tokenizer as users have it: a model folder, or its tokenizer.json alone.

Llama 3 and Qwen ship only tokenizer.json (no SentencePiece model); the
`tokenizers` package reads it. Whether a document starts with BOS and ends with
EOS is what tokenizer_config.json (beside tokenizer.json) says: `add_bos_token` /
`add_eos_token` with `bos_token` / `eos_token`. Without those keys, the
tokenizer's own post-processor decides (Llama 3's adds <|begin_of_text|>), as
transformers does. A fine-tuning completion always ends with `eos_token`, so the
model learns to stop. Nothing is downloaded.
"""

import dataclasses
import hashlib
import json
import pathlib

from trainer.base import confined
from trainer.base.errors import UserError
from trainer.data.chat_template import render as render_template

FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'chat_template.jinja')


@dataclasses.dataclass(frozen=True)
class HfTokenizer:
  tokenizer: object  # tokenizers.Tokenizer
  prefix: tuple[int, ...]  # Special tokens before each document (BOS), as the config or post-processor says.
  suffix: tuple[int, ...]  # And after it (EOS).
  eos_id: int | None  # tokenizer_config.json's eos_token: ends every fine-tuning completion.
  files: tuple[pathlib.Path, ...]  # The tokenizer's files, to keep with prepared data and exported models.
  config: dict  # tokenizer_config.json ({} when there is none).

  @property
  def vocab_size(self) -> int:
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, document: bool = True) -> list[int]:
    """Token ids of `text`; a whole `document` between the prefix and suffix (a piece of one without them)."""
    ids = self.tokenizer.encode(text, add_special_tokens=False).ids
    return [*self.prefix, *ids, *self.suffix] if document else ids

  def decode(self, ids: list[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=False)

  @property
  def chat_template(self) -> str | None:
    """tokenizer_config.json's chat_template (its 'default' one when it names several), else chat_template.jinja."""
    template = self.config.get('chat_template')
    if isinstance(template, list):
      template = next((t['template'] for t in template if t.get('name') == 'default'), None)
    jinja = next((f for f in self.files if f.name == 'chat_template.jinja'), None)
    return template or (jinja.read_text() if jinja else None)

  def render_chat(self, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
    """`messages` rendered by the chat template, as transformers' apply_chat_template(tokenize=False) does
    (trainer/data/chat_template.py); `kwargs` are extra template variables."""
    return render_template(self.chat_template, messages, add_generation_prompt, self.config, **kwargs)


def run_folder(config) -> pathlib.Path | None:
  """The folder of the Hugging Face tokenizer a run's tokens came from: the one scripts/prepare_data.py kept with
  the data (DATA/tokenizer/), else model.init_from's; None when neither has a tokenizer.json."""
  from trainer.data import prepared  # pylint: disable=import-outside-toplevel  (trainer.data imports this module)
  folders = []
  if prepared.folder(config.data) is not None:
    folders.append(prepared.folder(config.data) / 'tokenizer')
  init_from = config.model.get('init_from')
  if init_from and init_from.startswith('hf:'):
    folders.append(pathlib.Path(init_from[len('hf:'):]).expanduser())
  return next((f for f in folders if (f / 'tokenizer.json').is_file()), None)


def files_sha256(files) -> str:
  """One hash of a tokenizer's files, by name and content (the order given does not matter): what meta.json's
  tokenizer_sha256 records of the files scripts/prepare_data.py kept, and what an imported model's are compared by."""
  digest = hashlib.sha256()
  for file in sorted(files, key=lambda f: f.name):
    digest.update(file.name.encode() + b'\0' + file.read_bytes())
  return digest.hexdigest()


def folder_files(folder: pathlib.Path, where: str) -> tuple[pathlib.Path, ...]:
  """The tokenizer files (FILES) a folder holds: what prepare_data.py keeps of a tokenizer read from it. A file that
  is a link out of the folder is refused (UserError naming `where`), never read."""
  return tuple(folder / name for name in FILES if confined.inside(folder, name, where).is_file())


def is_hf_tokenizer(path: str) -> bool:
  p = pathlib.Path(path)
  return p.is_dir() or p.name.endswith('tokenizer.json')


def _special_id(tok, config: dict, key: str, where: str) -> int | None:
  """The id of tokenizer_config.json's `{key}_token`; None when it names none."""
  token = config.get(f'{key}_token')
  token = token.get('content') if isinstance(token, dict) else token
  if not token:
    return None
  if tok.token_to_id(token) is None:
    raise UserError(f'{where}: tokenizer_config.json names {key}_token {token!r}, which tokenizer.json lacks.')
  return tok.token_to_id(token)


def _around(tok, config: dict, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(prefix, suffix) of a document: add_bos_token/add_eos_token when the config names them, else what the
  tokenizer's post-processor adds around a text."""
  if 'add_bos_token' in config or 'add_eos_token' in config:
    ids = {key: _special_id(tok, config, key, where) for key in ('bos', 'eos')}
    for key, token_id in ids.items():
      if config.get(f'add_{key}_token') and token_id is None:
        raise UserError(f'{where}: tokenizer_config.json sets add_{key}_token but names no {key}_token.')
    return (((ids['bos'],) if config.get('add_bos_token') else ()),
            ((ids['eos'],) if config.get('add_eos_token') else ()))
  plain, full = tok.encode('a', add_special_tokens=False).ids, tok.encode('a', add_special_tokens=True).ids
  at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
  return tuple(full[:at]), tuple(full[at + len(plain):])


def load(path: str, flag: str = '--tokenizer') -> HfTokenizer:
  """The tokenizer of a folder holding tokenizer.json, or of a tokenizer.json file; one UserError otherwise."""
  try:
    import tokenizers
  except ImportError:
    raise UserError(f'{flag}={path!r} is a Hugging Face tokenizer but the tokenizers package is not installed; '
                    f'pip install -r requirements.txt.') from None
  given = pathlib.Path(path)
  where = f'{flag}={path!r}'
  # A folder's files are its own: one that is a link out of it (to a private file) is refused, never read or kept.
  file = confined.inside(given, 'tokenizer.json', where) if given.is_dir() else given
  if not file.is_file():
    raise UserError(f'{flag}={path!r}: no tokenizer.json there; give a model folder holding tokenizer.json, or the '
                    f'file itself.')
  try:
    tok = tokenizers.Tokenizer.from_file(str(file))
  except Exception as e:  # The Rust side raises its own exception type.
    raise UserError(f'{flag}={path!r}: {file} is not a readable tokenizer.json ({str(e)[:160]}).') from e
  config_file = confined.inside(file.parent, 'tokenizer_config.json', where)
  config = json.loads(config_file.read_text()) if config_file.is_file() else {}
  files = folder_files(file.parent, where)
  prefix, suffix = _around(tok, config, where)
  return HfTokenizer(tok, prefix, suffix, _special_id(tok, config, 'eos', where), files, config)
