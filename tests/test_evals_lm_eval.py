"""lm-eval-harness through trainer/evals/lm_eval_adapter.py agrees with the native scorer on the same local task.

lm-eval is an optional extra, never a CI dependency: this file is skipped where it is not installed. Run it in a
venv that has it (docs/evals.md: `pip install lm-eval` needs no torch for this adapter).
"""

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip('lm_eval')

from conftest import REPO, launcher_env, run_launcher  # noqa: E402
from test_evals import QUESTIONS, _write  # noqa: E402
from test_strategies import TEXT_DIR  # noqa: E402

# Contexts that end in whitespace too: lm-eval moves all of it into the continuation (tests/test_evals_pairing.py).
QUIZ = [*QUESTIONS, {'context': 'Is the sky blue?\n', 'choices': ['yes', 'no'], 'gold': 0},
        {'context': 'x =\t', 'choices': ['1', 'one'], 'gold': 0}]

YAML = """task: quiz_lm_eval
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def test_lm_eval_and_the_native_scorer_agree_on_a_local_task(tmp_path):
  run = run_launcher('--config=configs/tiny.py', f'--workdir={tmp_path / "run"}', f'--config.data.text_dir={TEXT_DIR}',
                     '--config.train.steps=4', '--config.train.eval_batches=0')
  assert run.returncode == 0, run.stderr[-3000:]
  quiz = _write(tmp_path / 'quiz.jsonl', QUIZ)
  (tmp_path / 'tasks').mkdir()
  (tmp_path / 'tasks' / 'quiz_lm_eval.yaml').write_text(YAML.format(path=quiz))
  out = tmp_path / 'out.json'
  result = subprocess.run([sys.executable, str(REPO / 'scripts/eval.py'), f'--workdir={tmp_path / "run"}',
                           f'--tasks={quiz}', '--lm_eval_tasks=quiz_lm_eval', f'--lm_eval_include={tmp_path / "tasks"}',
                           f'--output={out}'], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=launcher_env(HF_DATASETS_OFFLINE='1'))
  assert result.returncode == 0, result.stderr[-3000:]
  record = json.loads(out.read_text())
  native = record['tasks']['quiz']
  theirs = record['lm_eval']
  samples = sorted(theirs['samples']['quiz_lm_eval'], key=lambda s: s['doc_id'])
  assert [len(s['resps']) for s in samples] == [len(q['choices']) for q in QUIZ]
  np.testing.assert_allclose([r[0][0] for s in samples for r in s['resps']],
                             [ll for q in native['per_question'] for ll in q['log_likelihoods']], rtol=1e-6)
  assert theirs['results']['quiz_lm_eval']['acc,none'] == pytest.approx(native['acc'])
  assert theirs['results']['quiz_lm_eval']['acc_norm,none'] == pytest.approx(native['acc_norm'])
