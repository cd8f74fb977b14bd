"""eval.tasks and log.trackers in a real 2-process run (2 x 4 CPU devices over gloo) against 1 process x 8 devices."""

import json

import numpy as np

from conftest import read_metrics, run_launcher
from test_evals import QUESTIONS, _write
from test_multiprocess import RUN_TIMEOUT_S, TINY, _two_processes
from test_strategies import TEXT_DIR


def test_two_processes_score_like_one_and_only_process_0_tracks(tmp_path, monkeypatch):
  from mlflow.tracking import MlflowClient
  monkeypatch.setenv('MLFLOW_ALLOW_FILE_STORE', 'true')  # To read the folder here (the tracker sets it where it writes).
  quiz = _write(tmp_path / 'quiz.jsonl', QUESTIONS)
  args = (f'--config.data.text_dir={TEXT_DIR}', f'--config.eval.tasks=("{quiz}",)', '--config.train.steps=4')
  two, one = tmp_path / 'two', tmp_path / 'one'
  _two_processes(f'--workdir={two}', *args, "--config.log.trackers=('mlflow',)",
                 f'--config.log.mlflow_tracking_uri={tmp_path / "mlruns"}')
  reference = run_launcher(*TINY, f'--workdir={one}', *args, timeout=RUN_TIMEOUT_S)
  assert reference.returncode == 0, reference.stderr[-4000:]
  for step in (4,):  # configs/tiny.py saves at step 4 (ckpt.every_steps) and it is the last.
    scores = [json.loads((w / 'evals' / f'step_{step}.json').read_text())['params']['quiz'] for w in (two, one)]
    np.testing.assert_allclose([ll for q in scores[0]['per_question'] for ll in q['log_likelihoods']],
                               [ll for q in scores[1]['per_question'] for ll in q['log_likelihoods']], rtol=1e-5)
  assert [r['eval_quiz_acc'] for r in read_metrics(two) if 'eval_quiz_acc' in r] == \
      [r['eval_quiz_acc'] for r in read_metrics(one) if 'eval_quiz_acc' in r]
  client = MlflowClient(tracking_uri=str(tmp_path / 'mlruns'))
  runs = client.search_runs([client.get_experiment_by_name('jax-launch').experiment_id])
  assert len(runs) == 1  # Process 0's; process 1 writes none.
  history = {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, 'eval/quiz_acc')}
  assert history == {4: next(r['eval_quiz_acc'] for r in read_metrics(two) if r['step'] == 4)}
