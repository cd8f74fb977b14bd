"""scripts/prepare_data.py --tokenizer with a Hugging Face tokenizer.json (tests/fixtures/hf/tokenizer, a tiny BPE
trained by tests/fixtures/make_hf_fixtures.py): BOS/EOS per document as its tokenizer_config.json says, the files kept with
the data, and a vocabulary larger than the model's refused in one line."""

import json
import pathlib
import sys

import numpy as np
import pytest

from conftest import REPO
from configs import base
from trainer import data
from trainer.base.errors import UserError
from trainer.data import token_shards

sys.path.insert(0, str(REPO / 'scripts'))
import prepare_data  # noqa: E402

TOKENIZER = pathlib.Path(__file__).parent / 'fixtures' / 'hf' / 'tokenizer'
TEXT = 'what is two plus three ? it is five .'


def _prepare(tmp_path, tokenizer, name='out'):
  docs = tmp_path / 'docs'
  docs.mkdir(exist_ok=True)
  for i in range(6):
    (docs / f'doc_{i}.txt').write_text(TEXT + f' name a colour : {"red green blue".split()[i % 3]}')
  out = tmp_path / name
  prepare_data.main([f'--input={docs}', f'--output={out}', f'--tokenizer={tokenizer}', '--eval_percent=0'])
  return out


@pytest.mark.parametrize('given', ['folder', 'file'])
def test_documents_get_bos_and_eos_and_the_tokenizer_files_stay_with_the_data(tmp_path, given):
  out = _prepare(tmp_path, TOKENIZER if given == 'folder' else TOKENIZER / 'tokenizer.json')
  meta = json.loads((out / 'meta.json').read_text())
  assert meta['vocab_size'] == 120 and meta['tokenizer'].startswith('hf:')
  docs = token_shards.load_documents(out, 'train')
  vocab = json.loads((TOKENIZER / 'tokenizer.json').read_text())['model']['vocab']
  first = docs.span(0, 0, int(docs.lengths[0]))
  assert first[0] == vocab['<s>'] and first[-1] == vocab['</s>']  # tokenizer_config.json: add_bos/add_eos_token.
  assert int(np.sum(first == vocab['<s>'])) == 1
  import tokenizers
  text = tokenizers.Tokenizer.from_file(str(TOKENIZER / 'tokenizer.json')).decode(first[1:-1].tolist())
  assert text == TEXT + ' name a colour : red'  # The document between them, as the tokenizer reads it back.
  assert sorted(p.name for p in (out / 'tokenizer').iterdir()) == ['tokenizer.json', 'tokenizer_config.json']


def test_a_vocabulary_larger_than_the_model_is_refused_in_one_line(tmp_path):
  out = _prepare(tmp_path, TOKENIZER)
  config = base.get_config()
  config.data.source, config.data.path, config.model.vocab_size = 'array_record', str(out), 100
  with pytest.raises(UserError, match=r'use a vocabulary of 120 tokens but model.vocab_size=100; set '
                                      r'--config.model.vocab_size=120') as e:
    data.load_sources(config)
  assert '\n' not in str(e.value)


def test_a_folder_without_tokenizer_json_is_refused(tmp_path):
  with pytest.raises(SystemExit, match=r"no tokenizer.json there"):
    _prepare(tmp_path, tmp_path)
