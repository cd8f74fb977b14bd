"""Fine-tuning data: prompt/completion JSONL to shards with a loss mask that survives packing; the loss counts
completion tokens only; a short fine-tune of the tiny imported model lowers it (configs/finetune_llama.py)."""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, read_metrics
from configs import base, finetune_llama
from trainer import data
from trainer.base.errors import UserError
from trainer.hf import load as hf_load
from trainer.run import job as job_lib
from trainer.run import loop

sys.path.insert(0, str(REPO / 'scripts'))
import prepare_data  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'hf'
COLOURS = {'fox': 'red', 'dog': 'green', 'two': 'blue', 'three': 'yellow', 'four': 'red', 'five': 'green'}


def _jsonl(path, examples):
  path.write_text(''.join(json.dumps(e) + '\n' for e in examples))
  return path


def _prepare(tmp_path, examples, *flags):
  out = tmp_path / 'data'
  prepare_data.main([f'--input={_jsonl(tmp_path / "train.jsonl", examples)}', f'--output={out}', '--eval_percent=0',
                     '--num_shards=2', *flags])
  return out


def test_prompt_targets_change_neither_the_loss_nor_the_gradients():
  config = base.get_config()
  config.model.init_from = f'hf:{FIXTURES / "llama"}'
  config.data.source, config.data.loss_mask, config.data.seq_len = 'synthetic', True, 16
  config.train.batch_size, config.train.compute_dtype = 2, 'float32'
  config = hf_load.configure(config)
  job = job_lib.build_job(config, jax.devices()[:1])
  params = hf_load.load_params(config, job.abstract.params, job.shardings.params)
  rng = np.random.default_rng(0)
  inputs, targets = rng.integers(0, 256, (2, 16), np.int32), rng.integers(0, 256, (2, 16), np.int32)
  mask = (np.arange(16) >= 10).astype(np.int32)[None].repeat(2, 0)  # Prompt: positions 0-9; completion: 10-15.
  loss_and_grads = jax.jit(jax.value_and_grad(lambda p, b: job.task.loss(p, b), has_aux=True))
  (loss, metrics), grads = loss_and_grads(params, {'inputs': inputs, 'targets': targets, 'loss_mask': mask})
  other_prompt = np.where(mask == 0, (targets + 7) % 256, targets)
  (loss2, _), grads2 = loss_and_grads(params, {'inputs': inputs, 'targets': other_prompt, 'loss_mask': mask})
  assert float(loss) == float(loss2)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert float(metrics['trained_tokens']) == 12.0
  other_completion = np.where(mask == 1, (targets + 7) % 256, targets)
  (loss3, _), _ = loss_and_grads(params, {'inputs': inputs, 'targets': other_completion, 'loss_mask': mask})
  assert float(loss3) != float(loss)  # The completion's targets are what the loss reads.
  # The reference: the mean cross entropy of the completion positions alone, from the logits.
  logits = jax.jit(job.task.outputs)(params, {'inputs': inputs})  # One compile, not one per operation.
  logp = jax.nn.log_softmax(logits[:, 10:], axis=-1)
  want = -jnp.mean(jnp.take_along_axis(logp, targets[:, 10:, None], axis=-1))
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)


@pytest.mark.parametrize('packing', [True, False])
def test_the_mask_marks_the_completion_targets_after_packing_and_windows(tmp_path, packing):
  """Bytes: prompts in lower case, completions in upper case; a target counts exactly when it is upper case."""
  examples = [{'prompt': f'what is {w}? ', 'completion': c.upper() * (1 + i % 3)}
              for i, (w, c) in enumerate(list(COLOURS.items()) * 6)]
  out = _prepare(tmp_path, examples)
  config = base.get_config()
  config.data.source, config.data.path, config.data.loss_mask = 'array_record', str(out), True
  config.data.packing, config.data.seq_len, config.data.eval_percent = packing, 32, 0
  rows = data.load_sources(config).train
  assert len(rows) > 3
  for i in range(len(rows)):
    row = rows[i]
    upper = np.array([chr(t).isupper() for t in row['targets']])
    np.testing.assert_array_equal(row['loss_mask'].astype(bool), upper)


def test_a_short_finetune_of_the_imported_model_lowers_the_completion_loss(tmp_path):
  examples = [{'prompt': f'Question : name a colour for the {w} ? Answer :', 'completion': f' {c}'}
              for w, c in list(COLOURS.items()) * 8]
  out = _prepare(tmp_path, examples, f'--tokenizer={FIXTURES / "tokenizer"}')
  config = finetune_llama.get_config()
  config.model.init_from = f'hf:{FIXTURES / "llama"}'
  config.data.path, config.data.seq_len, config.data.eval_percent = str(out), 64, 0
  config.train.batch_size, config.train.steps, config.train.learning_rate, config.train.warmup_steps = 4, 16, 3e-3, 2
  config.train.remat_policy, config.train.compute_dtype, config.train.eval_batches = 'none', 'float32', 0
  config.log.every_steps, config.ckpt.every_steps = 1, 16
  loop.run(config, str(tmp_path / 'run'), devices=jax.devices()[:1])
  records = read_metrics(tmp_path / 'run')
  first, last = records[0], records[-1]
  assert last['step'] == 16 and last['loss'] < 0.5 * first['loss'], (first['loss'], last['loss'])
  # Each prompt is ~30 tokens and its completion 2-3 (a colour, EOS): a small share of the 256 tokens a step.
  assert all(0 < r['trained_tokens'] < 64 for r in records)
  # sample.py reads the tokenizer kept with the data: text in, text out.
  from scripts import sample  # Imported once per process: its absl flags can be defined only once.
  prompt = 'Question : name a colour for the fox ? Answer :'
  text = sample.sample(str(tmp_path / 'run'), prompt, 2, 0.0, 0, 'latest').decode()
  assert text.startswith(prompt + ' ') and len(text) > len(prompt) + 1, text


def test_bad_lines_and_unmasked_shards_fail_in_one_line(tmp_path):
  path = _jsonl(tmp_path / 'bad.jsonl', [{'prompt': 'a', 'completion': 'b'}, {'question': 'a', 'answer': 'b'}])
  with pytest.raises(SystemExit, match=r"bad.jsonl:2 has \['answer', 'question'\], not the fields \['prompt', "
                                       r"'completion'\]"):
    prepare_data.main([f'--input={path}', f'--output={tmp_path / "out"}'])
  docs = tmp_path / 'docs'
  docs.mkdir()
  (docs / 'a.txt').write_text('plain text, no mask ' * 20)
  prepare_data.main([f'--input={docs}', f'--output={tmp_path / "plain"}', '--eval_percent=0'])
  config = base.get_config()
  config.data.source, config.data.path, config.data.loss_mask = 'array_record', str(tmp_path / 'plain'), True
  with pytest.raises(UserError, match='data.loss_mask=True needs documents with a loss mask'):
    data.load_sources(config)


# transformers 5.24's apply_chat_template(MESSAGES, tokenize=True) on tests/fixtures/hf/tokenizer (run once in the
# fixtures' venv): the ids a chat must become, and its rendering '<s> Question : what colour ? Answer : red</s>
# Question : and now ? Answer : blue</s>'.
MESSAGES = [{'role': 'user', 'content': 'what colour ?'}, {'role': 'assistant', 'content': 'red'},
            {'role': 'user', 'content': 'and now ?'}, {'role': 'assistant', 'content': 'blue'}]
TRANSFORMERS_IDS = [1, 117, 116, 119, 85, 101, 76, 52, 64, 61, 92, 76, 23, 76, 24, 63, 68, 72, 54, 67, 85, 113, 2, 117,
                    116, 119, 85, 86, 63, 53, 78, 83, 76, 23, 76, 24, 63, 68, 72, 54, 67, 85, 84, 61, 87, 2]


def test_a_chat_is_rendered_by_its_template_and_only_assistant_turns_are_trained(tmp_path):
  out = _prepare(tmp_path, [{'messages': MESSAGES}] * 2, f'--tokenizer={FIXTURES / "tokenizer"}')
  config = base.get_config()
  config.data.source, config.data.path, config.data.loss_mask = 'array_record', str(out), True
  docs = data.load_sources(config)  # Checks the shards.
  from trainer.data import token_shards
  shard_docs = token_shards.load_documents(out, 'train')
  n = int(shard_docs.lengths[0])
  tokens, mask = shard_docs.span(0, 0, n).tolist(), shard_docs.mask_span(0, 0, n)
  assert tokens == TRANSFORMERS_IDS and docs.train is not None
  import tokenizers
  tok = tokenizers.Tokenizer.from_file(str(FIXTURES / 'tokenizer' / 'tokenizer.json'))
  trained = ''.join(tok.id_to_token(t) for t, m in zip(tokens, mask) if m)
  assert trained == '▁red</s>▁blue</s>'  # The answers and their end of turn, nothing else.


def test_a_chat_without_a_template_or_an_assistant_fails_in_one_line(tmp_path):
  with pytest.raises(SystemExit, match=r'train.jsonl:1 is a chat \("messages"\), which needs --tokenizer with a chat '
                                       r'template'):
    _prepare(tmp_path, [{'messages': MESSAGES}])
  with pytest.raises(SystemExit, match='train.jsonl:1: the conversation has no assistant message'):
    _prepare(tmp_path, [{'messages': MESSAGES[:1]}], f'--tokenizer={FIXTURES / "tokenizer"}')
