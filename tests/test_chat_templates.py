"""Chat data as a served model sees it: the launcher's training ids, loss masks and sample.py --chat prompts against
transformers' own apply_chat_template, on the published templates of Llama 3.2, Mistral v0.3, Qwen2.5 and Qwen3
(tests/fixtures/chat_templates/, cited there).

The tokenizers are built here, small but with the behaviour that matters: a byte-level BPE with the templates'
special tokens (Llama 3, Qwen), and SentencePiece-style ones that put "▁" before each text they are given
(Mistral, Llama 2): by a Prepend normalizer, as Mistral v0.3's tokenizer.json does, or by a Metaspace
pre-tokenizer, as newer conversions do. transformers is a test-only requirement; the launcher never imports it.
"""

import datetime
import json
import pathlib
import sys

import pytest
import tokenizers
import transformers  # requirements-test.txt; only the tests import it, never the launcher.
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from configs import base
from trainer.base.errors import UserError
from trainer.data import chat_template, hf_tokenizer, token_shards
from trainer.hf import load as hf_load

REPO = pathlib.Path(__file__).resolve().parent.parent
TEMPLATES = REPO / 'tests' / 'fixtures' / 'chat_templates'
sys.path.insert(0, str(REPO / 'scripts'))
import prepare_data  # noqa: E402

CORPUS = ['what colour is the sky ? the sky is blue .', 'and the grass ? the grass is green .',
          'you are a helpful assistant who answers in one word .', 'name a colour for the fox ? red .',
          'hello there , how are you today ? fine , thanks .', 'think : the sky is blue in the day .',
          '[INST] [/INST]'] * 20
LLAMA3 = ['<|begin_of_text|>', '<|end_of_text|>', '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>']
MISTRAL = ['<unk>', '<s>', '</s>', '[INST]', '[/INST]']
QWEN = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
MISTRAL_CONFIG = {'bos_token': '<s>', 'eos_token': '</s>', 'unk_token': '<unk>', 'add_bos_token': True,
                  'add_eos_token': False}
QWEN_CONFIG = {'bos_token': None, 'eos_token': '<|im_end|>', 'pad_token': '<|endoftext|>'}
# name: (template file, tokenizer kind, special tokens, other added tokens, tokenizer_config.json keys)
KINDS = {
    'llama32': ('llama32.jinja', 'byte_level', LLAMA3, [], {'bos_token': LLAMA3[0], 'eos_token': '<|eot_id|>'}),
    'mistral': ('mistral_v03.jinja', 'prepend', MISTRAL, [], MISTRAL_CONFIG),
    'mistral_metaspace': ('mistral_v03.jinja', 'metaspace', MISTRAL, [], MISTRAL_CONFIG),
    # [INST] as text, as Mistral v0.1/v0.2's and Llama 2's tokenizers have it: an answer starts inside a text piece.
    'mistral_text_inst': ('mistral_v03.jinja', 'prepend', MISTRAL[:3], [], MISTRAL_CONFIG),
    'qwen25': ('qwen25.jinja', 'byte_level', QWEN, [], QWEN_CONFIG),
    'qwen3': ('qwen3.jinja', 'byte_level', QWEN, ['<think>', '</think>'], QWEN_CONFIG),
}
SYSTEM = {'role': 'system', 'content': 'you are a helpful assistant who answers in one word .'}
Q1, A1 = {'role': 'user', 'content': 'what colour is the sky ?'}, {'role': 'assistant', 'content': 'blue .'}
Q2, A2 = {'role': 'user', 'content': 'and the grass ?'}, {'role': 'assistant', 'content': 'green .'}
Q3, A3 = {'role': 'user', 'content': 'name a colour for the fox ?'}, {'role': 'assistant', 'content': 'red .'}
THOUGHT = {'role': 'assistant', 'content': '<think>\nthink : the sky is blue in the day .\n</think>\n\nblue .'}
CHATS = {'single': [Q1, A1], 'system_multi': [SYSTEM, Q1, A1, Q2, A2], 'multi': [Q1, A1, Q2, A2, Q3, A3],
         'reasoning_multi': [Q1, THOUGHT, Q2, A2]}
DAY = datetime.datetime(2025, 3, 9, 12, 0)  # Llama 3.2 writes "Today Date": both sides render this day.


def _tokenizer(kind: str, specials: list[str], added: list[str]) -> tokenizers.Tokenizer:
  if kind == 'byte_level':
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  else:
    tok = tokenizers.Tokenizer(models.BPE(unk_token='<unk>'))
    # Trained on words, as SentencePiece learns its pieces (none runs across a space), then read as the models'
    # tokenizer.json reads a text: one Metaspace piece, or no pre-tokenizer at all.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='always', split=True)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    if kind == 'metaspace':
      tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='first', split=False)
      tok.decoder = decoders.Metaspace(replacement='▁', prepend_scheme='first', split=False)
    else:  # Mistral v0.3's tokenizer.json: "▁" prepended to every text between special tokens.
      tok.pre_tokenizer = None
      tok.normalizer = normalizers.Sequence([normalizers.Prepend('▁'), normalizers.Replace(' ', '▁')])
      tok.decoder = decoders.Sequence([decoders.Replace('▁', ' '), decoders.Fuse(), decoders.Strip(' ', 1, 0)])
  tok.add_tokens(added)
  if kind != 'byte_level' or specials is LLAMA3:  # BOS before a text, as both models' post-processors add it.
    bos = specials[1] if kind != 'byte_level' else specials[0]
    tok.post_processor = processors.TemplateProcessing(single=f'{bos} $A', special_tokens=[(bos, tok.token_to_id(bos))])
  return tok


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
  """A tokenizer folder per KINDS entry: tokenizer.json and tokenizer_config.json with the published template."""
  made = {}
  for name, (template, kind, specials, added, config) in KINDS.items():
    folder = tmp_path_factory.mktemp(name)
    _tokenizer(kind, specials, added).save(str(folder / 'tokenizer.json'))
    config = {'tokenizer_class': 'PreTrainedTokenizerFast', **config, 'chat_template': (TEMPLATES / template).read_text()}
    (folder / 'tokenizer_config.json').write_text(json.dumps(config))
    made[name] = folder
  return made


@pytest.fixture
def same_day(monkeypatch):
  """strftime_now answers DAY on both sides (transformers' and the launcher's call datetime.now())."""
  class Frozen(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
      return DAY
  import transformers.utils.chat_template_utils as tf_templates
  monkeypatch.setattr(tf_templates, 'datetime', Frozen)
  monkeypatch.setattr(chat_template.datetime, 'datetime', Frozen)


def _transformers(folder):
  return transformers.AutoTokenizer.from_pretrained(str(folder))


def _ids(tf, messages, generation=False) -> list[int]:
  return list(tf.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation, return_dict=False))


def _expected(tf, messages) -> list[tuple[list[int], list[int]]]:
  """transformers' documents of a conversation: the whole chat's ids when each turn's rendering is a prefix of
  it, else the chat up to each assistant turn; 1 in the mask from an answer's generation prompt to its end."""
  answers = [i for i, m in enumerate(messages) if m['role'] == 'assistant']
  whole = _ids(tf, messages)
  by_turn = all(whole[:len(_ids(tf, messages[:i + 1]))] == _ids(tf, messages[:i + 1]) for i in answers)
  docs = [(whole, answers)] if by_turn else [(_ids(tf, messages[:i + 1]), [i]) for i in answers]
  out = []
  for ids, trained in docs:
    mask = [0] * len(ids)
    for i in trained:
      prompt, through = _ids(tf, messages[:i], True), len(_ids(tf, messages[:i + 1]))
      assert ids[:len(prompt)] == prompt  # The served prompt is where the answer starts.
      mask[len(prompt):through] = [1] * (through - len(prompt))
    out.append((ids, mask))
  return out


def _prepare(tmp_path, folder, lines):
  path = tmp_path / 'train.jsonl'
  path.write_text(''.join(json.dumps(line) + '\n' for line in lines))
  out = tmp_path / 'data'
  prepare_data.main([f'--input={path}', f'--output={out}', f'--tokenizer={folder}', '--eval_percent=0',
                     '--num_shards=1'])
  docs = token_shards.load_documents(out, 'train')
  return out, [(docs.span(d, 0, int(n)).tolist(), docs.mask_span(d, 0, int(n)).tolist())
               for d, n in enumerate(docs.lengths)]


@pytest.mark.parametrize('name', list(KINDS))
def test_chat_ids_and_masks_are_transformers_apply_chat_template(folders, same_day, tmp_path, name):
  """Every chat of CHATS, through scripts/prepare_data.py into shards, is transformers' ids with the answers
  trained; sample.py --chat encodes each conversation prefix as the training document begins."""
  chats = {k: v for k, v in CHATS.items() if k != 'reasoning_multi' or name.startswith('qwen')}
  if name.startswith('mistral'):  # Its template puts a system message in the last user turn only: see below.
    del chats['system_multi']
  tf = _transformers(folders[name])
  out, docs = _prepare(tmp_path, folders[name], [{'messages': m} for m in chats.values()])
  want = [doc for messages in chats.values() for doc in _expected(tf, messages)]
  assert [ids for ids, _ in docs] == [ids for ids, _ in want]
  assert [mask for _, mask in docs] == [mask for _, mask in want]
  if name == 'llama32':
    assert tf.decode(docs[0][0]).count(f'Today Date: {DAY:%d %b %Y}\n') == 1
  # Qwen3 drops earlier answers' <think> blocks: a document per answer of a multi-turn chat, as its authors train.
  assert len(docs) == (1 + 2 + 3 + 2 if name == 'qwen3' else len(chats))

  from scripts import sample  # Imported once per process: its absl flags can be defined only once.
  config = base.get_config()
  config.data.source, config.data.path = 'array_record', str(out)
  encode, _ = sample.chat_codec(config)
  for messages in chats.values():
    for i, message in enumerate(messages):
      if message['role'] == 'assistant':
        served = encode(json.dumps(messages[:i]))
        assert served == _ids(tf, messages[:i], True)
        # A training document starts with exactly these ids, its answer trained from the next token on.
        assert any(ids[:len(served)] == served and mask[len(served) - 1:len(served) + 1] == [0, 1]
                   for ids, mask in docs), (name, i)


@pytest.mark.parametrize('name', ['mistral', 'mistral_metaspace', 'llama32'])
def test_prompt_completion_pairs_are_encoded_as_one_text(folders, tmp_path, name):
  """The pair's ids are the tokenizer's on prompt + completion (plus EOS), the mask 1 from the prompt's end; the
  prompt's ids are what sample.py feeds the model. A completion encoded apart would start with its own "▁"."""
  tf = _transformers(folders[name])
  pairs = [('what colour is the sky ?', ' blue .'), ('hello there ,', ' how are you today ?')]
  _, docs = _prepare(tmp_path, folders[name], [{'prompt': p, 'completion': c} for p, c in pairs])
  tok = hf_tokenizer.load(str(folders[name]))
  for (prompt, completion), (ids, mask) in zip(pairs, docs):
    whole, head = tf(prompt + completion)['input_ids'], tf(prompt)['input_ids']
    assert ids == [*whole, tok.eos_id] and whole[:len(head)] == head
    assert mask == [0] * len(head) + [1] * (len(ids) - len(head))
    assert [*tok.prefix, *tok.encode(prompt, document=False)] == head  # sample.py's text prompt.
    if name == 'mistral':  # Its normalizer puts "▁" before any text: the completion encoded apart is other ids.
      assert tf(completion, add_special_tokens=False)['input_ids'] != whole[len(head):]


def test_templates_get_what_transformers_gives_them(folders):
  """strftime_now, raise_exception, tojson's options, namespace, loop controls, {% generation %}, extra variables
  and the special tokens: the same text as transformers renders."""
  template = ('{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}'
              '{% endif %}{% set ns.n = ns.n + 1 %}{% generation %}{{ m | tojson(indent=2, sort_keys=True) }}'
              '{% endgeneration %}{% endfor %}{{ ns.n }}{{ strftime_now("%Y") }}{{ "<b>" | tojson }}'
              '{% if flavour is defined %}{{ flavour }}{% endif %}{% if messages | length > 3 %}'
              '{{ raise_exception("too long") }}{% endif %}')
  tf = _transformers(folders['llama32'])
  tok = hf_tokenizer.load(str(folders['llama32']))
  messages = [{'role': 'user', 'content': 'é', 'name': None}, {'role': 'assistant', 'content': 'b', 'thinking': 'c'},
              {'role': 'user', 'content': 'd'}]
  ours = chat_template.render(template, messages, False, tok.config, flavour='x')
  assert ours == tf.apply_chat_template(messages, chat_template=template, tokenize=False, flavour='x')
  assert '"reasoning_content": "c"' in ours and '"name"' not in ours and '"é"' in ours
  assert ours.endswith(f'2{datetime.datetime.now():%Y}"<b>"x')
  with pytest.raises(UserError, match='the chat template refused the conversation: too long'):
    chat_template.render(template, messages * 2, False, tok.config)
  # Llama 3.2 says today's date, as a server does, not the template's fallback.
  rendered = tok.render_chat([Q1], True)
  assert f'Today Date: {datetime.datetime.now():%d %b %Y}\n' in rendered and '26 Jul 2024' not in rendered


def test_a_template_that_moves_the_system_message_is_refused_in_one_line(folders, tmp_path):
  """Mistral v0.3 renders a system message inside the last user turn, so a conversation ending in an answer loses
  it (transformers renders none) while the served prompt has it: no training text is both; refused, exit 2."""
  with pytest.raises(SystemExit) as exit_info:
    _prepare(tmp_path, folders['mistral'], [{'messages': CHATS['system_multi']}])
  assert exit_info.value.code == 2
  assert str(exit_info.value).endswith('train.jsonl:1: the chat template renders assistant turn 2 other than after '
                                       'its generation prompt (add_generation_prompt=True), so its answer cannot be '
                                       'told from the prompt.')


def test_data_and_an_imported_model_of_other_tokenizers_are_refused(folders, tmp_path, launcher):
  """meta.json's tokenizer_sha256 against the imported folder's tokenizer files: another is one line, exit 2."""
  import shutil
  model = tmp_path / 'model'
  shutil.copytree(REPO / 'tests' / 'fixtures' / 'hf' / 'llama', model)
  for file in folders['qwen25'].iterdir():
    shutil.copy2(file, model / file.name)
  out, _ = _prepare(tmp_path, folders['llama32'], [{'prompt': 'what colour is the sky ?', 'completion': ' blue .'}])
  config = base.get_config()
  config.model.init_from, config.data.source, config.data.path = f'hf:{model}', 'array_record', str(out)
  with pytest.raises(UserError, match=r"model.init_from='hf:.*': the data in '.*data' was prepared with another "
                                      r"tokenizer \(hf:.*llama32.*\) than the model's \(.*model\); prepare it again"):
    hf_load.configure(config)
  for file in folders['llama32'].iterdir():  # The model's own tokenizer, copied: the same files, accepted.
    shutil.copy2(file, model / file.name)
  assert hf_load.configure(config).model.d_model == 64
  (model / 'tokenizer_config.json').write_text('{}')
  result = launcher('--config=configs/base.py', f'--workdir={tmp_path / "run"}', f'--config.model.init_from=hf:{model}',
                    '--config.data.source=array_record', f'--config.data.path={out}', '--config.data.seq_len=16')
  assert result.returncode == 2, result.stderr[-2000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("launch.py: error: model.init_from='hf:") and 'prepared with another tokenizer' in last
