"""What an exported folder needs to serve as the model it came from: special token ids, context length, architecture,
dtype, generation_config.json and the tokenizer's files.

The weights decide the shape (trainer/hf/architectures.py `hf_config`); `of_run(config)` says the rest:
- a run imported from a Hugging Face folder (model.init_from='hf:DIR') keeps that folder's `bos_token_id`,
  `eos_token_id`, `pad_token_id`, `max_position_embeddings` (or data.seq_len where the run trained on longer rows),
  its architecture where the weights fit it (Mistral stays `MistralForCausalLM`, with its `sliding_window`) and its
  dtype; its generation_config.json travels, and so do its tokenizer files when it has them, else those
  scripts/prepare_data.py kept with the data;
- a run trained from scratch on data tokenized by a Hugging Face tokenizer takes the token ids from the tokenizer's
  tokenizer_config.json and states data.seq_len, the length it trained on, as its context.

Without these transformers falls back to ids 1 and 2 for BOS/EOS (a fine-tuned chat model never stops), and vLLM
caps the context at whatever `max_position_embeddings` says.
"""

import dataclasses
import json
import pathlib

from absl import logging

from trainer.base import confined
from trainer.data import hf_tokenizer

# The files a Hugging Face tokenizer is saved as (fast and slow); those present in the chosen folder travel.
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'tokenizer.model',
                   'vocab.json', 'merges.txt', 'added_tokens.json', 'chat_template.jinja')
GENERATION_CONFIG = 'generation_config.json'
TOKEN_IDS = ('bos_token_id', 'eos_token_id', 'pad_token_id')
DTYPES = ('float32', 'bfloat16', 'float16')
_INIT_FROM = 'model.init_from'


@dataclasses.dataclass(frozen=True)
class Serving:
  fields: dict  # config.json fields beyond the weights' shape (token ids, context length, sliding window).
  architecture: str | None  # The source's architecture, when the weights are that architecture; None: by the weights.
  dtype: str  # The dtype the weights are written in unless --dtype says otherwise.
  files: tuple[pathlib.Path, ...]  # Copied beside the weights.


def source_folder(config) -> pathlib.Path | None:
  """The imported Hugging Face folder (model.init_from='hf:DIR') when it is still there, else None."""
  init_from = config.model.get('init_from')
  if not init_from or not init_from.startswith('hf:'):
    return None
  folder = pathlib.Path(init_from[len('hf:'):]).expanduser()
  if not (folder / 'config.json').is_file():
    logging.warning('model.init_from: %s has no config.json now, so its token ids, end tokens and context length '
                    'are not read (the data\'s tokenizer and data.seq_len stand in); copy the folder back to keep them.',
                    folder)
    return None
  return folder


def _tokenizer_files(folder: pathlib.Path | None) -> tuple[pathlib.Path, ...]:
  if folder is None or not (folder / 'tokenizer.json').is_file() and not (folder / 'tokenizer.model').is_file():
    return ()
  # Each stays inside its folder: a link out of it (to a private file) is refused, never copied into the export.
  return tuple(folder / name for name in TOKENIZER_FILES
               if confined.inside(folder, name, f'the tokenizer files of {folder}').is_file())


def _data_tokenizer(config) -> pathlib.Path | None:
  from trainer.data import prepared  # pylint: disable=import-outside-toplevel  (jax and grain: tools only)
  data_folder = prepared.folder(config.data)
  if data_folder is not None:
    folder = data_folder / 'tokenizer'
    return folder if (folder / 'tokenizer.json').is_file() else None
  return None


def _source_dtype(hf: dict) -> str:
  dtype = hf.get('dtype', hf.get('torch_dtype'))
  return dtype if dtype in DTYPES else 'float32'


def _from_source(config, folder: pathlib.Path) -> Serving:
  hf = json.loads(confined.inside(folder, 'config.json', _INIT_FROM).read_text())
  fields = {k: hf[k] for k in TOKEN_IDS if k in hf}
  length = hf.get('max_position_embeddings')
  if length is not None and config.data.seq_len > length:  # Trained on longer rows than the source was made for.
    logging.info('export: max_position_embeddings=%d (data.seq_len, the trained length; %s says %d).',
                 config.data.seq_len, folder / 'config.json', length)
    length = config.data.seq_len
  if length is not None:
    fields['max_position_embeddings'] = length
  architecture = None
  plain = not config.model.get('qkv_bias', False) and not config.model.get('qk_norm', False)
  if 'MistralForCausalLM' in (hf.get('architectures') or []) and plain:
    architecture = 'MistralForCausalLM'
    fields['sliding_window'] = hf.get('sliding_window')
  files = _tokenizer_files(folder) or _tokenizer_files(_data_tokenizer(config))
  if confined.inside(folder, GENERATION_CONFIG, _INIT_FROM).is_file():
    files += (folder / GENERATION_CONFIG,)
  return Serving(fields, architecture, _source_dtype(hf), files)


def _from_tokenizer(config, folder: pathlib.Path) -> Serving:
  """A model trained from scratch: token ids from tokenizer_config.json, its context the trained length."""
  fields = {'max_position_embeddings': config.data.seq_len}
  tok = hf_tokenizer.load(str(folder), flag='the run\'s tokenizer (DATA/tokenizer)')
  for key in ('bos', 'eos', 'pad'):
    token = tok.config.get(f'{key}_token')
    token = token.get('content') if isinstance(token, dict) else token
    if token and tok.tokenizer.token_to_id(token) is not None:
      fields[f'{key}_token_id'] = tok.tokenizer.token_to_id(token)
  return Serving(fields, None, 'float32', _tokenizer_files(folder))


def of_run(config) -> Serving:
  """The serving fields, default dtype and files of the run `config` describes (its config.json's config)."""
  folder = source_folder(config)
  if folder is not None:
    return _from_source(config, folder)
  data = _data_tokenizer(config)
  if data is not None:
    return _from_tokenizer(config, data)
  return Serving({'max_position_embeddings': config.data.seq_len}, None, 'float32', ())


def _ids(value) -> tuple[int, ...]:
  return tuple(value) if isinstance(value, list) else () if value is None else (int(value),)


def end_token_ids(config) -> tuple[int, ...]:
  """The ids a generation stops at, as transformers' generate() has them: the imported folder's
  generation_config.json `eos_token_id` (one id or a list: Llama 3's chat models end turns with <|eot_id|> and
  documents with <|end_of_text|>), else its config.json's; and the run's tokenizer's `eos_token`."""
  ids = []
  folder = source_folder(config)
  if folder is not None:
    generation = confined.inside(folder, GENERATION_CONFIG, _INIT_FROM)
    found = json.loads(generation.read_text()).get('eos_token_id') if generation.is_file() else None
    config_json = confined.inside(folder, 'config.json', _INIT_FROM)
    ids += _ids(found if found is not None else json.loads(config_json.read_text()).get('eos_token_id'))
  tokenizer = hf_tokenizer.run_folder(config)
  if tokenizer is not None:
    eos = hf_tokenizer.load(str(tokenizer), flag='the run\'s tokenizer').eos_id
    ids += _ids(eos)
  return tuple(dict.fromkeys(ids))
