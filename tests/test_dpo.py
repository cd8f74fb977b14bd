"""DPO (train.objective='dpo', docs/dpo.md): preference JSONL to pair rows; the loss against an independent numpy
computation; bad pairs refused in one line; a tiny model learns the rule the chosen answers follow, and a kill -9
resume of it is exact."""

import json
import pathlib
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, launcher_env, read_metrics, run_python
from test_finetune import FIXTURES, MESSAGES, TRANSFORMERS_IDS
from configs import base
from parallel import sharding
from trainer import data
from trainer.data import token_shards
from trainer.run import job as job_lib

sys.path.insert(0, str(REPO / 'scripts'))
import prepare_data  # noqa: E402

SEQ_LEN = 16


def _pairs(count: int, seed: int = 0) -> list[dict]:
  """The rule: the chosen answer is the prompt's word in upper case; the rejected one repeats it as it is."""
  rng = np.random.default_rng(seed)
  words = [''.join(rng.choice(list('abcdefghij'), 3)) for _ in range(count)]
  return [{'prompt': f'{w}:', 'chosen': w.upper(), 'rejected': w} for w in words]


def _prepare(tmp_path: pathlib.Path, records: list[dict], eval_percent: int = 10) -> pathlib.Path:
  source, out = tmp_path / 'pairs.jsonl', tmp_path / 'data'
  source.write_text(''.join(json.dumps(r) + '\n' for r in records))
  prepare_data.main([f'--input={source}', f'--output={out}', f'--eval_percent={eval_percent}', '--num_shards=1'])
  return out


@pytest.fixture(scope='module')
def pairs_dir(tmp_path_factory) -> pathlib.Path:
  return _prepare(tmp_path_factory.mktemp('dpo'), _pairs(300))


def _config(path: pathlib.Path):
  config = base.get_config()
  config.train.objective, config.train.dpo_beta, config.train.dpo_label_smoothing = 'dpo', 0.5, 0.1
  config.data.source, config.data.path, config.data.seq_len = 'array_record', str(path), SEQ_LEN
  config.train.batch_size, config.train.compute_dtype = 4, 'float32'
  config.model.num_layers, config.model.d_model, config.model.num_heads, config.model.mlp_dim = 1, 32, 2, 64
  return config


def test_a_row_holds_the_prompt_with_each_answer_as_two_segments_masked_on_the_answers(pairs_dir):
  rows = data.load_sources(_config(pairs_dir)).train
  row = rows[0]
  text = lambda segment, key: bytes(row[key][row['segment_ids'] == segment].astype(np.uint8)).decode()
  answer = lambda segment: bytes(row['targets'][(row['segment_ids'] == segment) & (row['loss_mask'] == 1)]
                                 .astype(np.uint8)).decode()
  word = text(1, 'inputs')[:3]
  assert text(1, 'inputs') + text(1, 'targets')[-1] == f'{word}:{word.upper()}'
  assert (answer(1), answer(2)) == (word.upper(), word)  # The loss reads the answers, not the prompt.
  assert list(row['positions'][row['segment_ids'] == 2]) == list(range(6))  # Each answer from position 0.
  assert row['loss_mask'][row['segment_ids'] == 0].sum() == 0
  config = _config(pairs_dir)
  config.data.packing, config.data.seq_len = True, 40  # Pairs of 12 tokens: 3 a row.
  packed = data.load_sources(config).train
  assert len(packed) == -(-len(rows) // 3) and list(np.unique(packed[0]['segment_ids'])) == list(range(7))
  assert [packed[0][k][12:24].tolist() for k in ('inputs', 'loss_mask')] == [rows[1][k][:12].tolist()
                                                                             for k in ('inputs', 'loss_mask')]


def test_chat_pairs_are_the_ids_the_template_renders_and_only_the_answer_is_trained(tmp_path):
  """The chosen conversation is test_finetune's MESSAGES, whose ids transformers gave; its earlier answer is prompt."""
  green = [{'role': 'assistant', 'content': 'green'}]
  explicit = {'prompt': MESSAGES[:3], 'chosen': MESSAGES[3]['content'], 'rejected': green}
  implicit = {'chosen': MESSAGES, 'rejected': MESSAGES[:3] + green}  # The prompt: the messages both share.
  source, out = tmp_path / 'pairs.jsonl', tmp_path / 'data'
  source.write_text(''.join(json.dumps(r) + '\n' for r in [explicit, implicit]))
  prepare_data.main([f'--input={source}', f'--output={out}', '--eval_percent=0', f'--tokenizer={FIXTURES / "tokenizer"}'])
  import tokenizers
  tok = tokenizers.Tokenizer.from_file(str(FIXTURES / 'tokenizer' / 'tokenizer.json'))
  docs = token_shards.load_documents(out, 'train')
  for pair in range(2):
    (chosen, chosen_mask), (rejected, rejected_mask) = [
        (docs.span(d, 0, int(docs.lengths[d])).tolist(), docs.mask_span(d, 0, int(docs.lengths[d])))
        for d in (2 * pair, 2 * pair + 1)]
    prompt = list(chosen_mask).index(1)  # The mask is 0 on the whole prompt, then 1 on the answer.
    assert chosen == TRANSFORMERS_IDS and rejected[:prompt] == chosen[:prompt] and rejected_mask[:prompt].sum() == 0
    trained = lambda ids, mask: ''.join(tok.id_to_token(t) for t, m in zip(ids, mask) if m)
    assert (trained(chosen, chosen_mask), trained(rejected, rejected_mask)) == ('▁blue</s>', '▁green</s>')


def test_the_loss_equals_a_numpy_computation_from_the_log_probabilities(pairs_dir):
  config = _config(pairs_dir)
  config.data.packing, config.data.seq_len = True, 2 * SEQ_LEN  # 2 pairs a row, and rows that hold one.
  job = job_lib.build_job(config, jax.devices()[:1])
  rows = data.load_sources(config).train
  batch = {k: np.stack([rows[i][k] for i in range(4)]) for k in rows[0]}
  batch['segment_ids'][3, batch['segment_ids'][3] > 2] = 0  # The last row: its second pair dropped.
  state = job.init_state(0)
  policy = state.params
  for start, frozen in zip(jax.tree.leaves(policy), jax.tree.leaves(state.reference_params)):  # The starting weights.
    np.testing.assert_array_equal(np.asarray(start), np.asarray(frozen))
  _, totals = sharding.sharding_table(job.abstract, job.shardings)  # What sharding.txt and --plan count.
  assert totals['reference_params_bytes_per_device'] == totals['params_bytes_per_device'] > 0
  reference = jax.tree.map(lambda p: p * 0.9 + 0.01, policy)  # Another model, so that both terms count.
  loss, metrics = jax.jit(lambda p, r, b: job.task.loss(p, b, frozen=r))(policy, reference, batch)
  outputs = jax.jit(job.task.outputs)

  def logps(params):  # numpy, float64: each row's sum of log softmax at the target over each answer's tokens.
    logits = np.asarray(outputs(params, batch), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    token = (np.take_along_axis(shifted, batch['targets'][..., None], -1)[..., 0]
             - np.log(np.exp(shifted).sum(-1)))
    return [[sum(token[r, t] for t in range(2 * SEQ_LEN)
                 if batch['segment_ids'][r, t] == s and batch['loss_mask'][r, t]) for s in (2 * k + 1, 2 * k + 2)]
            for r in range(4) for k in range(2) if 2 * k + 1 in batch['segment_ids'][r]]

  beta, smoothing = 0.5, 0.1
  h = np.array([beta * ((pc - rc) - (pr - rr)) for (pc, pr), (rc, rr) in zip(logps(policy), logps(reference))])
  want = np.mean((1 - smoothing) * np.log1p(np.exp(-h)) + smoothing * np.log1p(np.exp(h)))
  assert abs(float(loss) - want) < 1e-5
  assert abs(float(metrics['rewards/margins']) - h.mean()) < 1e-5
  assert abs(float(metrics['rewards/accuracies']) - np.mean(h > 0)) < 1e-6 and len(h) == 7
  assert float(job.task.weight(batch)) == 7  # Pairs: what gradient accumulation weighs microbatches by.


def test_under_lora_the_reference_is_the_frozen_base_with_no_second_copy(pairs_dir):
  """DPO with LoRA adapters (docs/lora.md): no reference copy is held; the reference is the base with the adapters at
  zero, so at the start (b = 0) policy and reference agree and the loss is log 2; a trained adapter moves only the
  policy."""
  import optax
  config = _config(pairs_dir)
  config.model.lora_rank, config.model.lora_targets = 4, ('query', 'value', 'up')
  job = job_lib.build_job(config, jax.devices()[:1])
  state = job.init_state(0)
  assert state.reference_params is None
  _, totals = sharding.sharding_table(job.abstract, job.shardings)
  assert 'reference_params_bytes_per_device' not in totals
  rows = data.load_sources(config).train
  batch = {k: np.stack([rows[i][k] for i in range(4)]) for k in rows[0]}
  loss_fn = jax.jit(lambda p, b: job.task.loss(p, b))
  loss, metrics = loss_fn(state.params, batch)
  assert abs(float(loss) - np.log(2)) < 1e-6 and float(metrics['rewards/margins']) == 0.0
  grads = jax.grad(lambda p: loss_fn(p, batch)[0])(state.params)
  moved = jax.tree_util.tree_map_with_path(
      lambda path, p, g: p - 0.5 * g if 'lora' in jax.tree_util.keystr(path) else p, state.params, grads)
  assert float(loss_fn(moved, batch)[0]) < float(loss)  # The adapters move the policy away from the reference.
  assert optax.tree.norm(jax.tree_util.tree_map_with_path(
      lambda path, g: 0 * g if 'lora' in jax.tree_util.keystr(path) else g, grads)) == 0  # The base is frozen.


@pytest.mark.parametrize('record, says', [
    ({'prompt': 'q:', 'chosen': 'yes', 'rejected': 'yes'}, '"chosen" and "rejected" are the same answer'),
    ({'prompt': 'q:', 'chosen': '', 'rejected': 'no'}, 'the "chosen" answer is empty'),
    ({'prompt': 'q:', 'chosen': 'yes', 'rejected': [{'role': 'assistant', 'content': ' '}]},
     'the "rejected" answer is empty'),
    ({'chosen': 'yes', 'rejected': 'no'}, 'has no "prompt"'),
])
def test_a_bad_pair_is_one_line_naming_its_line_and_exit_2(tmp_path, capsys, record, says):
  with pytest.raises(SystemExit) as stopped:
    _prepare(tmp_path, _pairs(3) + [record])
  assert stopped.value.code == 2
  [line] = capsys.readouterr().err.strip().splitlines()
  assert line.startswith('prepare_data.py: error: ') and 'pairs.jsonl:4' in line and says in line


def test_a_pair_longer_than_seq_len_is_refused_with_the_length_that_fits(tmp_path):
  path = _prepare(tmp_path, _pairs(20) + [{'prompt': 'q:', 'chosen': 'A' * 20, 'rejected': 'b'}], eval_percent=0)
  result = run_python([sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py',
                       f'--workdir={tmp_path / "run"}', '--config.train.objective=dpo',
                       '--config.data.source=array_record', f'--config.data.path={path}',
                       f'--config.data.seq_len={SEQ_LEN}'])
  assert result.returncode == 2
  [line] = result.stderr.strip().splitlines()[-1:]
  assert line.startswith('launch.py: error: pair 20 of the train split') and '--config.data.seq_len=23' in line
  assert not (tmp_path / 'run' / 'checkpoints').exists()


def _launch(pairs_dir, workdir, *extra, **env) -> None:
  result = run_python([sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py', f'--workdir={workdir}',
                       '--config.train.objective=dpo', '--config.data.source=array_record',
                       f'--config.data.path={pairs_dir}', f'--config.data.seq_len={2 * SEQ_LEN}',
                       '--config.data.packing=True', '--config.train.steps=40', '--config.train.learning_rate=0.003',
                       '--config.log.every_steps=1',
                       '--config.ckpt.every_steps=20', '--config.ckpt.async_save=False', '--restart_backoff_s=1', *extra],
                      env=launcher_env(**env))
  assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope='module')
def runs(pairs_dir, tmp_path_factory):
  """Two pairs a row, the same 40 steps twice: straight through (scoring a multiple-choice task of held-out words at each save),
  and killed (SIGKILL) at step 30 then resumed from step 20."""
  straight, killed = tmp_path_factory.mktemp('straight'), tmp_path_factory.mktemp('killed')
  task = straight / 'upper.jsonl'
  task.write_text(''.join(json.dumps(line) + '\n' for line in [{'template': '{context}:', 'target_delimiter': ''}] + [
      {'context': p['rejected'], 'choices': [p['rejected'], p['chosen']], 'gold': 1} for p in _pairs(16, seed=1)]))
  _launch(pairs_dir, straight, f'--config.eval.tasks=("{task}",)')
  _launch(pairs_dir, killed, LAUNCH_TEST_FAULT='kill@30,attempt=1', LAUNCH_MAX_RESTARTS='1')
  return read_metrics(straight), read_metrics(killed), killed, straight, task


def test_margin_and_accuracy_rise_and_a_held_out_pair_prefers_the_rule(runs):
  metrics = [m for m in runs[0] if 'rewards/margins' in m]
  first, last = metrics[:5], metrics[-5:]
  mean = lambda rows, key: np.mean([m[key] for m in rows])
  assert abs(metrics[0]['loss'] - np.log(2)) < 1e-3  # The policy starts as the reference: no preference yet.
  assert mean(last, 'rewards/margins') > mean(first, 'rewards/margins') + 0.5
  assert mean(last, 'rewards/accuracies') >= 0.9 > mean(first, 'rewards/accuracies')
  assert mean(last, 'loss') < mean(first, 'loss') - 0.2
  # Held-out pairs: the chosen answer's log-probability rose against the rejected one's, from equal at the start.
  final = [m for m in runs[0] if 'eval_loss' in m][-1]
  assert final['eval_rewards/margins'] > 0.5 and final['eval_rewards/accuracies'] >= 0.9


def test_a_kill_9_resume_is_exact(runs):
  straight, killed, workdir = runs[:3]
  attempts = [json.loads(l) for l in (workdir / 'attempts.jsonl').read_text().splitlines()]
  assert [a.get('cause') for a in attempts][0] == 'killed by SIGKILL' and attempts[1]['resumed_step'] == 20
  by_step = lambda rows: {m['step']: m for m in rows if 'rewards/margins' in m}
  want, got = by_step(straight), by_step(killed)
  for step in range(21, 41):
    for key in ('loss', 'rewards/chosen', 'rewards/rejected', 'rewards/accuracies', 'grad_norm'):
      assert got[step][key] == want[step][key], (step, key)
  assert got[40]['eval_loss'] == [m for m in straight if 'eval_loss' in m][-1]['eval_loss']


def test_multiple_choice_evals_score_a_dpo_run_in_the_run_and_with_eval_py(runs):
  """The task asks which of a word and its upper case follows 'word:'; DPO taught the upper case."""
  straight, workdir, task = runs[0], runs[3], runs[4]
  [scored] = [m for m in straight if m['step'] == 40 and 'eval_upper_acc' in m]
  assert scored['eval_upper_acc'] >= 0.9
  out = workdir / 'scored.json'
  result = run_python([sys.executable, str(REPO / 'scripts' / 'eval.py'), f'--workdir={workdir}', f'--tasks={task}',
                       f'--output={out}'])
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads(out.read_text())['tasks']['upper']['acc'] == scored['eval_upper_acc']


def test_a_dpo_workdir_resumed_with_another_objective_is_one_line(runs, pairs_dir):
  workdir = runs[3]
  saved = sorted(p.name for p in (workdir / 'checkpoints').iterdir())
  result = run_python([sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py', f'--workdir={workdir}',
                       '--config.data.source=array_record', f'--config.data.path={pairs_dir}',
                       '--config.train.steps=50'])
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (
      f"launch.py: error: --workdir {workdir} was trained with train.objective='dpo'; resume with "
      f"--config.train.objective=dpo, or start train.objective='task' in a fresh --workdir (from an exported "
      f"checkpoint: scripts/export_hf.py, then model.init_from=hf:FOLDER).")
  assert sorted(p.name for p in (workdir / 'checkpoints').iterdir()) == saved


@pytest.mark.parametrize('key, value, says', [
    ('data.source', 'text', 'set --config.data.source=array_record'),
    ('parallel.strategy', 'shard_map', 'set --config.parallel.strategy=jit'),
    ('train.loss_chunks', 2, 'set --config.train.loss_chunks=1'),
])
def test_what_dpo_does_not_run_with_is_refused_before_any_compile(pairs_dir, key, value, says):
  from trainer.base.errors import UserError
  from trainer.training import validation
  config = _config(pairs_dir)
  section, name = key.split('.')
  config[section][name] = value
  with pytest.raises(UserError, match=f"train.objective='dpo' .*{says}.*, or set --config.train.objective=task"):
    validation.validate_config(config)
