"""The run's evals at a step (held-out loss, per mixture source, on the EMA, downstream tasks), and a failed one.

An eval runs after its step is saved, so a failure costs no training: it is said in one line, recorded as
`eval_failed: 1` in that step's metrics.jsonl record, and training goes on. A failed final eval ends the run with
that line (exit 2, which the supervisor does not retry: the relaunch would find the run finished). An attempt that
died inside the final eval (a native abort, a hang killed) leaves no record at all: the relaunch that finds the run
finished says so in one line and records it (`missing_final_eval`), instead of finishing quietly without it.
"""

import json

import numpy as np
from absl import logging

from trainer.base import storage
from trainer.base.errors import UserError
from trainer.evals import dispatch
from trainer.training import state as state_lib


def held_out(eval_step, params, eval_set, objective, frozen=None) -> dict[str, float]:
  """The task's eval summary (loss and perplexity, or loss and accuracy) over the fixed held-out batches;
  `frozen`: the state's reference parameters (train.objective='dpo')."""
  frozen = () if frozen is None else (frozen,)
  per_batch = dispatch.fetched(lambda batch: eval_step(params, batch, *frozen), eval_set)  # Bounded: evals/dispatch.py.
  return objective.eval_summary({k: float(np.mean([m[k] for m in per_batch])) for k in per_batch[0]})


def at_step(run, state, step: int, total: int, preempted, evals: dict[int, dict[str, float]]) -> str | None:
  """Runs the evals due at `step` into evals[step]; the one line of a failure, or None."""
  eval_every = run.config.train.eval_every_steps
  try:
    if run.eval_set and (step == total or (eval_every and step % eval_every == 0)):
      run.hang.phase('eval')
      run.train_iter.hold()  # No transfer while the eval step runs (its first run is a capture too).
      evals[step] = held_out(run.eval_step, state.params, run.eval_set, run.objective, state.reference_params)
      if run.sources:  # A mixture: each source's held-out rows on their own too.
        evals[step].update(run.sources.evaluate(lambda b: held_out(run.eval_step, state.params, b, run.objective)))
      if state.ema_params is not None:  # The same eval step, on the average.
        ema = state_lib.params_of(state, 'ema')
        evals[step]['eval_ema_loss'] = held_out(run.eval_step, ema, run.eval_set, run.objective,
                                                state.reference_params)['eval_loss']
      run.train_iter.release()
    # Not on the way out of a preemption: the grace period is for the save.
    if run.downstream and not preempted and run.downstream.due(step, total,
                                                               step % run.config.ckpt.every_steps == 0):
      run.hang.phase('eval')
      run.train_iter.hold()  # The scoring function's first run is a capture too (data/device_feed.py).
      evals.setdefault(step, {}).update(run.downstream.score(step, state))
  except Exception as error:  # noqa: BLE001 - any failure of an eval: the step is saved; say so and go on.
    detail = ' '.join(str(error).split())[:300] or 'no message'
    line = (f'The {"final " if step == total else ""}eval at step {step} failed ({type(error).__name__}: {detail}); '
            f'step {step} is saved in {run.ckpt.directory} and metrics.jsonl records eval_failed at step {step}. '
            f'Check train.eval_batches and eval.tasks.')
    logging.error('%s', line)
    evals.setdefault(step, {})['eval_failed'] = 1.0
    return line
  finally:
    run.train_iter.release()
  return None


def final_failed(line: str) -> UserError:
  """The error a run whose final eval failed ends with, once training, saving and logging are done."""
  return UserError(f'{line} Training finished; a relaunch does not evaluate again.')


def check_finished_run(workdir: str, step: int, expects_eval: bool, write: bool) -> None:
  """For a run found finished at `step`: one line (exit 2) when an eval was due there and metrics.jsonl has none,
  which an attempt that died during its final eval leaves; recorded, so a later relaunch finishes quietly."""
  path = storage.path(workdir) / 'metrics.jsonl'
  if not (expects_eval and write and path.is_file()):  # Process 0's check: it writes metrics.jsonl.
    return
  records = []
  for line in path.read_text().splitlines():
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:  # A last line cut short by a killed writer.
      continue
  final = {key for record in records if record.get('step') == step for key in record}
  if 'missing_final_eval' in final or any(key.startswith('eval_') for key in final):  # eval_loss, eval_failed, ...
    return
  log = storage.AppendLog(path)
  log.write(json.dumps({'step': step, 'missing_final_eval': 1.0}) + '\n')
  log.close()
  raise UserError(f'The final eval of step {step} is not in {path}: the attempt that trained step {step} ended '
                  f'during it (its log says how), or ran without it. The checkpoint is saved and a finished run '
                  f'does not evaluate again; metrics.jsonl now records missing_final_eval at step {step}.')
