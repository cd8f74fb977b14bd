"""Downstream evals during training: multiple-choice task files scored on the training mesh (docs/evals.md).

The one entry point is `build(config.eval, job, workdir)`, called before the compile so a bad task file fails in
seconds: it reads and checks every file, encodes every (question, choice) row with the run's tokenizer, and returns
a `Downstream` (None when eval.tasks is empty). The loop asks `due(step, saving)` and, when due, `score(step, state)`
returns the metrics to log (eval_<task>_acc, eval_<task>_acc_norm, and eval_ema_<task>_... when the run keeps an
EMA) and process 0 writes WORKDIR/evals/step_<N>.json with every question's per-choice log-likelihoods.
"""

import dataclasses
import json
import time

import jax
from absl import logging

from trainer.base import confined, storage
from trainer.base.errors import UserError
from trainer.evals import codec as codec_lib
from trainer.evals import scorer, tasks
from trainer.training import state as state_lib


@dataclasses.dataclass
class Downstream:
  every_steps: int  # 0: at every checkpoint save.
  task_files: list[tasks.TaskFile]
  rows: list[scorer.Rows]
  scorer: scorer.Scorer
  workdir: str | None  # None: write no file (scripts/eval.py writes its own).

  def due(self, step: int, total: int, saving: bool) -> bool:
    """Every eval.every_steps steps and at the last; with 0, at every checkpoint save (`saving`) and the last."""
    return step == total or (step % self.every_steps == 0 if self.every_steps else saving)

  def score_params(self, params, prefix: str = 'eval_') -> tuple[dict[str, float], dict]:
    """(metrics, details per task) of `params`."""
    metrics, details = {}, {}
    for task, rows in zip(self.task_files, self.rows):
      start = time.perf_counter()
      lls = self.scorer.log_likelihoods(params, rows)
      summary, per_question = scorer.multiple_choice_scores(task, rows, lls)
      seconds = time.perf_counter() - start
      for key, value in summary.items():
        metrics[f'{prefix}{task.name}_{key}'] = value
      details[task.name] = {**summary, 'path': task.path, 'questions': len(task.questions), 'seconds': seconds,
                            'per_question': per_question}
    return metrics, details

  def score(self, step: int, state) -> dict[str, float]:
    """Scores the current parameters (and their average, when the run keeps one); writes the step's file."""
    metrics, details = self.score_params(state.params)
    record = {'step': step, 'params': details}
    if state.ema_params is not None:
      ema_metrics, record['ema'] = self.score_params(state_lib.params_of(state, 'ema'), 'eval_ema_')
      metrics.update(ema_metrics)
    if self.workdir is not None and jax.process_index() == 0:
      folder = storage.path(self.workdir) / 'evals'
      folder.mkdir(parents=True, exist_ok=True)
      confined.write_text(folder / f'step_{step}.json', json.dumps(record, indent=1) + '\n')
    logging.info('Downstream evals at step %d: %s', step, ', '.join(f'{k} {v:.3f}' for k, v in metrics.items()))
    return metrics


def build(eval_config, job, workdir: str | None, task_paths=None, max_questions: int | None = None) -> Downstream | None:
  """The run's downstream evals (None when there are no tasks); every file read and checked now, before a compile.

  `eval_config` is config.eval; `job` gives the mesh, the task, the shardings and the run's tokenizer settings.
  """
  paths = tuple(eval_config.tasks if task_paths is None else task_paths)
  if not paths:
    return None
  if job.task.objective.kind != 'lm':
    raise UserError(f'eval.tasks scores language models; this run has model.task={job.config.model.task!r}. '
                    f'Set --config.eval.tasks=().')
  if eval_config.every_steps < 0:
    raise UserError(f'eval.every_steps={eval_config.every_steps} must be >= 0 (0 = at every checkpoint save).')
  limit = eval_config.max_questions if max_questions is None else max_questions
  task_files = [tasks.load(p, limit) for p in paths]
  for task in task_files:
    if task.kind != 'multiple_choice':
      raise UserError(f'eval task file {task.path} is sample-based (answer/stop lines): those run in '
                      f'scripts/eval.py, not during training; leave it out of eval.tasks.')
  names = [t.name for t in task_files]
  if len(set(names)) != len(names):
    raise UserError(f'eval.tasks={paths}: two files share a name ({names}); metrics are named by the file stem.')
  codec = codec_lib.for_run(job.config)
  seq_len = job.config.data.seq_len
  rows = [scorer.build_rows(t, codec, seq_len) for t in task_files]
  scoring = make_scorer(job)
  logging.info('Downstream evals: %s (%d rows of %d tokens, %d a call)',
               ', '.join(f'{t.name} ({len(t.questions)} questions)' for t in task_files),
               sum(len(r.inputs) for r in rows), seq_len, scoring.rows_per_call)
  return Downstream(eval_config.every_steps, task_files, rows, scoring, workdir)


def make_scorer(job) -> scorer.Scorer:
  """The scoring function of `job`'s model on its mesh, a training microbatch of rows a call."""
  train = job.config.train
  rows_per_call = train.batch_size // train.grad_accum_steps  # A microbatch: forward only, so it fits.
  chunks = 1 if job.task.custom_loss else train.get('loss_chunks', 1)  # A custom loss runs no chunking (task.py).
  return scorer.Scorer(job.task.for_eval(), job.mesh, job.shardings.params, job.batch_shardings['inputs'],
                       rows_per_call, chunks)
