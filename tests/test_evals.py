"""eval.tasks: multiple-choice task files scored on the training mesh (trainer/evals/)."""

import json
import pathlib
import re

import jax
import numpy as np
import pytest

from conftest import read_metrics, run_launcher
from configs import tiny
from trainer import evals
from trainer.base.errors import UserError
from trainer.evals import tasks
from trainer.run import job as job_lib
from test_strategies import TEXT_DIR

# The third question's prompt is longer than a row (tiny: data.seq_len=32): it is cut from the left.
QUESTIONS = [
    {'context': 'The sky is', 'choices': ['blue', 'green', 'made of cheese'], 'gold': 0},
    {'context': 'def f(x):\n  return', 'choices': ['x', 'None'], 'gold': 1},
    {'context': 'A long prompt that runs well past the thirty-two bytes of a tiny row, then:', 'choices': ['ok', 'no'],
     'gold': 0},
]


def _write(path: pathlib.Path, lines) -> str:
  path.write_text(''.join(json.dumps(line) + '\n' for line in lines))
  return str(path)


def _config(**changes):
  c = tiny.get_config()
  c.train.compute_dtype = 'float32'
  c.data.text_dir = str(TEXT_DIR)
  for key, value in changes.items():
    section, name = key.split('__')
    c[section][name] = value
  return c


def _reference(forward, params, prompt: str, continuation: str, seq_len: int) -> float:
  """log p(continuation | prompt), the model run on exactly the tokens (no padding, no batch), summed in float64."""
  tokens = list((prompt + continuation).encode())[-(seq_len + 1):]
  logits = np.asarray(forward(params, np.asarray([tokens[:-1]], np.int32))[0], np.float64)
  logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) - \
      logits.max(-1, keepdims=True)
  n = len(continuation.encode())
  return float(sum(logp[t, tokens[t + 1]] for t in range(len(tokens) - 1 - n, len(tokens) - 1)))


@pytest.mark.parametrize('devices, changes', [
    (1, {}), (8, {'mesh__fsdp': 2}),
    (4, {'mesh__context': 2, 'train__loss_chunks': 4}),  # Logits made a slice at a time, rows in the balanced order.
])
def test_log_likelihoods_equal_logits_summed_by_hand(tmp_path, devices, changes):
  config = _config(**changes)
  config.eval.tasks = (_write(tmp_path / 'quiz.jsonl', QUESTIONS),)
  job = job_lib.build_job(config, jax.devices()[:devices])
  downstream = evals.build(config.eval, job, workdir=None)
  params = job.init_state(0).params
  lls = downstream.scorer.log_likelihoods(params, downstream.rows[0])
  # The reference model on one device with no mesh constraints: rows of any length, no sharding.
  reference = job_lib.build_job(_config(), jax.devices()[:1]).task.model
  # Jitted: one program per row length; run op by op, it compiled 281 programs (18 s of the suite's CPU).
  forward = jax.jit(lambda p, tokens: reference.bind(p)(tokens))
  expected = [_reference(forward, jax.device_get(params), q['context'], ' ' + c, config.data.seq_len)
              for q in QUESTIONS for c in q['choices']]
  assert len(lls) == 7
  np.testing.assert_allclose(lls, expected, rtol=1e-5, atol=1e-5)
  metrics, details = downstream.score_params(params)
  assert set(metrics) == {'eval_quiz_acc', 'eval_quiz_acc_norm'}
  # acc and acc_norm by hand: argmax of the log-likelihoods, and of them divided by each choice's characters.
  acc = np.mean([np.argmax(expected[0:3]) == 0, np.argmax(expected[3:5]) == 1, np.argmax(expected[5:7]) == 0])
  norm = [np.array(expected[0:3]) / [4, 5, 14], np.array(expected[3:5]) / [1, 4], np.array(expected[5:7]) / [2, 2]]
  acc_norm = np.mean([np.argmax(norm[0]) == 0, np.argmax(norm[1]) == 1, np.argmax(norm[2]) == 0])
  assert metrics['eval_quiz_acc'] == pytest.approx(acc) and metrics['eval_quiz_acc_norm'] == pytest.approx(acc_norm)
  assert details['quiz']['per_question'][1]['line'] == 2


def test_template_and_fewshot_make_the_prompt(tmp_path):
  header = {'template': 'Q: {context}\nA:', 'fewshot': [{'context': 'one', 'choices': ['1', '2'], 'gold': 0}],
            'fewshot_delimiter': '\n\n'}
  task = tasks.load(_write(tmp_path / 't.jsonl', [header, {'context': 'two', 'choices': ['1', '2'], 'gold': 1}]))
  assert task.questions[0].prompt == 'Q: one\nA: 1\n\nQ: two\nA:'
  assert task.questions[0].continuations == (' 1', ' 2') and task.questions[0].line == 2


@pytest.mark.parametrize('line, message', [
    ('{"context": "x", "choices": ["a", "b"], "gold": 2}', 'line 2: "gold" must be an integer index into the 2'),
    ('{"context": "x", "choices": ["a"]', 'line 2: not valid JSON'),
    ('{"context": "x"}', 'line 2: give "choices" and "gold"'),
    ('{"template": "{context}"}', 'line 2: a header line (template, fewshot) may only be the first line'),
])
def test_a_bad_line_names_file_and_line(tmp_path, line, message):
  path = tmp_path / 'bad.jsonl'
  path.write_text(json.dumps(QUESTIONS[0]) + '\n' + line + '\n')
  with pytest.raises(UserError, match=re.escape(f'{path}, {message}')):
    tasks.load(str(path))


def test_launch_with_a_bad_task_line_is_one_error_line_before_compile(tmp_path):
  path = tmp_path / 'bad.jsonl'
  path.write_text(json.dumps(QUESTIONS[0]) + '\n\n{"context": "x", "choices": "ab", "gold": 0}\n')
  result = run_launcher('--config=configs/tiny.py', f'--workdir={tmp_path / "run"}', f'--config.data.text_dir={TEXT_DIR}',
                        f'--config.eval.tasks=("{path}",)')
  assert result.returncode == 2, result.stderr[-2000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last == (f'launch.py: error: eval task file {path}, line 3: "choices" must be a list of at least 2 '
                  f'non-empty strings.')
  assert 'Compiled the train step' not in result.stderr


def _trained_task_dir(tmp_path):
  """A task whose every distractor is another question's gold answer, and a corpus of its own gold text."""
  pairs = [('cat', 'meow'), ('dog', 'woof'), ('cow', 'moo'), ('owl', 'hoot'), ('bee', 'buzz'), ('pig', 'oink')]
  answers = [a for _, a in pairs]
  lines = [{'template': '{context} says'}]
  for i, (animal, sound) in enumerate(pairs):
    choices = [sound, answers[(i + 1) % len(pairs)], answers[(i + 3) % len(pairs)]]
    lines.append({'context': animal, 'choices': choices, 'gold': 0})
  text = tmp_path / 'text'
  text.mkdir()
  rng = np.random.default_rng(0)
  for f in range(4):
    order = rng.permutation(len(pairs).__index__() * 40) % len(pairs)
    (text / f'part{f}.py').write_text(''.join(f'{pairs[i][0]} says {pairs[i][1]}.\n' for i in order))
  return _write(tmp_path / 'animals.jsonl', lines), text


def test_run_scores_at_configured_steps_and_a_trained_model_prefers_gold(tmp_path):
  from trainer.run import loop
  task_path, text = _trained_task_dir(tmp_path)
  config = _config(train__steps=60, train__learning_rate=1e-2, train__warmup_steps=5, train__ema_decay=0.9,
                   data__text_dir=str(text), data__file_glob='*.py', data__eval_percent=25, ckpt__every_steps=30,
                   log__every_steps=10)
  config.eval.tasks = (task_path,)
  config.eval.every_steps = 0  # At every checkpoint save: steps 30 and 60.
  workdir = tmp_path / 'run'
  loop.run(config, str(workdir), devices=jax.devices()[:2])
  scored = {r['step']: r for r in read_metrics(workdir) if 'eval_animals_acc' in r}
  assert sorted(scored) == [30, 60]
  assert sorted(p.name for p in (workdir / 'evals').iterdir()) == ['step_30.json', 'step_60.json']
  assert scored[60]['eval_animals_acc'] == 1.0  # Chance is 1/3.
  assert 'eval_ema_animals_acc' in scored[60]
  from tensorboard.backend.event_processing import event_accumulator
  events = event_accumulator.EventAccumulator(str(workdir / 'tensorboard'))
  events.Reload()
  assert {e.step: e.value for e in events.Scalars('eval/animals_acc_norm')} == pytest.approx(
      {s: r['eval_animals_acc_norm'] for s, r in scored.items()})
  record = json.loads((workdir / 'evals' / 'step_60.json').read_text())
  assert record['params']['animals']['acc'] == scored[60]['eval_animals_acc']
  for question in record['params']['animals']['per_question']:
    lls = question['log_likelihoods']
    assert lls[0] > max(lls[1:]), question


def test_due_every_n_steps_and_the_last_or_at_checkpoint_saves():
  every = evals.Downstream(every_steps=3, task_files=[], rows=[], scorer=None, workdir=None)
  assert [s for s in range(1, 11) if every.due(s, total=10, saving=s % 5 == 0)] == [3, 6, 9, 10]
  at_saves = evals.Downstream(every_steps=0, task_files=[], rows=[], scorer=None, workdir=None)
  assert [s for s in range(1, 11) if at_saves.due(s, total=10, saving=s % 5 == 0)] == [5, 10]


@pytest.mark.parametrize('case, message', [
    ('synthetic', "this run's tokens came with no tokenizer (data.source='synthetic')"),
    ('generate', 'is sample-based (answer/stop lines): those run in scripts/eval.py'),
    ('same_name', 'two files share a name'),
])
def test_build_refuses_what_it_cannot_score_before_compile(tmp_path, case, message):
  config = _config()
  quiz = _write(tmp_path / 'quiz.jsonl', QUESTIONS)
  config.eval.tasks = (quiz,)
  if case == 'synthetic':
    config.data.source = 'synthetic'
  elif case == 'generate':
    config.eval.tasks = (_write(tmp_path / 'gen.jsonl', [{'context': '2+2=', 'answer': '4'}]),)
  else:
    (tmp_path / 'other').mkdir()
    config.eval.tasks = (quiz, _write(tmp_path / 'other' / 'quiz.jsonl', QUESTIONS))
  job = job_lib.build_job(config, jax.devices()[:1])
  with pytest.raises(UserError, match=re.escape(message)):
    evals.build(config.eval, job, workdir=None)
