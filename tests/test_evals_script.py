"""scripts/eval.py: a checkpoint scored the way a run with eval.tasks scores itself; sample-based tasks decoded; evals
of any size on 8 devices, in the run and in the script (trainer/evals/dispatch.py)."""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, launcher_env, read_metrics, run_launcher, run_python, xla_flags
from test_evals import _config, _trained_task_dir, _write


def _script(name: str, *args: str, env=None) -> subprocess.CompletedProcess:
  return run_python([sys.executable, str(REPO / 'scripts' / name), *args], timeout=300, env=env)


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """The animals task's run (tests/test_evals.py), 60 steps on 2 devices, scored and checkpointed at 30 and 60."""
  from trainer.run import loop
  root = tmp_path_factory.mktemp('evals_script')
  task_path, text = _trained_task_dir(root)
  config = _config(train__steps=60, train__learning_rate=1e-2, train__warmup_steps=5, data__text_dir=str(text),
                   data__file_glob='*.py', data__eval_percent=25, ckpt__every_steps=30, log__every_steps=30)
  config.eval.tasks = (task_path,)
  loop.run(config, str(root / 'run'), devices=jax.devices()[:2])
  generate = _write(root / 'sounds.jsonl', [{'template': '{context} says'},
                                            {'context': 'cat', 'answer': 'meow', 'stop': ['.']},
                                            {'context': 'owl', 'answer': 'hoot', 'stop': '.'},
                                            {'context': 'dog', 'answer': 'moo', 'stop': ['.']}])
  return root / 'run', task_path, generate


def test_eval_script_scores_a_checkpoint_as_the_run_did(run, tmp_path):
  workdir, task_path, generate = run
  out = tmp_path / 'out.json'
  result = _script('eval.py', f'--workdir={workdir}', f'--tasks={task_path},{generate}', '--step=60',
                   f'--output={out}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'step 60 animals: acc ' in result.stdout and 'step 60 sounds: exact_match ' in result.stdout
  record = json.loads(out.read_text())
  in_run = json.loads((workdir / 'evals' / 'step_60.json').read_text())['params']['animals']
  # 8 devices here, 2 in the run: the same log-likelihoods.
  np.testing.assert_allclose([q['log_likelihoods'] for q in record['tasks']['animals']['per_question']],
                             [q['log_likelihoods'] for q in in_run['per_question']], rtol=1e-5, atol=1e-5)
  assert record['tasks']['animals']['acc'] == in_run['acc']
  # Greedy text as sample.py writes it at temperature 0, cut at the stop string.
  sounds = record['tasks']['sounds']['per_question']
  matches = []
  for question, prompt in zip(sounds, ['cat says', 'owl says', 'dog says']):
    sampled = _script('sample.py', f'--workdir={workdir}', f'--prompt={prompt}', '--num_tokens=12',
                      '--temperature=0', '--step=60')
    assert sampled.returncode == 0, sampled.stderr[-2000:]
    expected = sampled.stdout[len(prompt):].split('.')[0]
    assert question['generated'] == expected
    matches.append(expected.strip() == question['answer'])
    assert question['exact_match'] == matches[-1]
  assert record['tasks']['sounds']['exact_match'] == pytest.approx(np.mean(matches))
  assert matches[0], sounds  # The trained text says 'cat says meow.'


def test_eval_script_refuses_a_bad_task_line_in_one_line(run, tmp_path):
  workdir, _, _ = run
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"context": "cat", "choices": ["meow"], "gold": 0}\n')
  result = _script('eval.py', f'--workdir={workdir}', f'--tasks={bad}')
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (f'eval.py: error: eval task file {bad}, line 1: "choices" must '
                                                    f'be a list of at least 2 non-empty strings.')


def test_an_eval_of_200_calls_on_8_devices_completes(tmp_path):
  """200 held-out batches, once all dispatched before one fetch: past XLA:CPU's 32 computations in flight per
  device the rendezvous of their all-reduce aborted the run (exit 134) and the final eval was lost
  (trainer/evals/dispatch.py: 33 in flight aborted 3 tries of 3). 200 dispatched at once still abort (checked with
  dispatch.IN_FLIGHT unbounded); 2000 took 9 s more of CPU for nothing."""
  result = run_launcher('--config=configs/tiny.py', f'--workdir={tmp_path}', '--config.train.steps=1',
                        '--config.train.eval_batches=200', timeout=240)
  assert result.returncode == 0, result.stderr[-3000:]
  final = [r for r in read_metrics(tmp_path) if 'eval_loss' in r]
  assert [r['step'] for r in final] == [1] and 4.0 < final[0]['eval_loss'] < 7.0  # Near ln(256): one step trained.


def test_2000_questions_score_on_8_devices_as_on_1(tmp_path):
  """2000 questions, 4000 rows in 500 calls: on 8 devices they once aborted (all dispatched before one fetch, rows of
  128 tokens outran the devices past 32 calls in flight); now equal to one device's, log-likelihood by
  log-likelihood."""
  from test_strategies import TEXT_DIR
  trained = run_launcher('--config=configs/tiny.py', f'--workdir={tmp_path / "run"}', f'--config.data.text_dir={TEXT_DIR}',
                         '--config.train.steps=1', '--config.train.eval_batches=0', '--config.data.seq_len=128')
  assert trained.returncode == 0, trained.stderr[-3000:]
  words = ['blue', 'green', 'red', 'sky', 'sea', 'tree']
  quiz = _write(tmp_path / 'many.jsonl', [
      {'context': f'Question {i}: the {words[i % 6]} is' + '\n' * (i % 2), 'choices': [words[(i + 1) % 6],
                                                                                     words[(i + 2) % 6] * 2],
       'gold': i % 2} for i in range(2000)])
  records = []
  for devices in (8, 1):
    out = tmp_path / f'out_{devices}.json'
    env = {**launcher_env(), 'XLA_FLAGS': xla_flags(devices)}
    result = _script('eval.py', f'--workdir={tmp_path / "run"}', f'--tasks={quiz}', f'--output={out}', env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    records.append(json.loads(out.read_text())['tasks']['many'])
  eight, one = records
  assert eight['questions'] == one['questions'] == 2000
  np.testing.assert_allclose([q['log_likelihoods'] for q in eight['per_question']],
                             [q['log_likelihoods'] for q in one['per_question']], rtol=1e-5, atol=1e-5)
  assert (eight['acc'], eight['acc_norm']) == (one['acc'], one['acc_norm'])
  assert 0.0 < eight['acc'] < 1.0
