"""Score a run's checkpoint on task files, the way a run with eval.tasks scores itself (docs/evals.md).

  .venv/bin/python scripts/eval.py --workdir=DIR --tasks=a.jsonl,b.jsonl [--step=latest]
      [--params=raw|ema] [--max_questions=0] [--rows_per_call=0] [--max_new_tokens=64] [--output=FILE]

Multiple-choice files are scored by trainer/evals/ (per-choice log-likelihoods, acc, acc_norm) on a mesh of every
local device (data-parallel, rows split like a training batch). Sample-based files (lines with "answer" and "stop")
are generated greedily through scripts/sample.py's decoder (the KV cache for the launcher's Llama) until a stop
string, the tokenizer's end token or --max_new_tokens, and scored by exact match of the stripped text. Prints one
line per task and writes every question's result to --output (default WORKDIR/evals/eval_step_<N>.json).

--workdir, --step and --params are sample.py's own flags (imported with its decoder), with the same meaning.
"""

import json
import os
import pathlib
import sys
import time
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from trainer.safety import startup_signals  # noqa: E402  (first: a signal in any phase is one line, 128 + it)
if __name__ == '__main__':  # Not in a test that imports it.
  startup_signals.install_for_tool('eval.py')
from trainer.base import interpreter  # noqa: E402
interpreter.require_packages('eval.py')
from absl import app, flags, logging  # noqa: E402
# sample.py defaults JAX_PLATFORMS to cpu for its one-device decoding; scoring here uses the accelerators.
_PLATFORMS = os.environ.get('JAX_PLATFORMS')
from scripts import sample  # noqa: E402  (the decoder, and the --workdir/--step/--params flags)
if _PLATFORMS is None:
  os.environ.pop('JAX_PLATFORMS', None)
for _name in ('workdir', 'step', 'params'):
  flags.declare_key_flag(_name)  # sample.py's flags, listed by --help with this script's own.

_TASKS = flags.DEFINE_list('tasks', [], 'Task files (JSONL, docs/evals.md), comma-separated.')
_MAX_QUESTIONS = flags.DEFINE_integer('max_questions', 0, 'Score only the first N questions of each file; 0 = all.')
_ROWS_PER_CALL = flags.DEFINE_integer('rows_per_call', 0, "Rows (question x choice) per scoring call, split over "
                                      "the devices; 0 = the run's train.batch_size / train.grad_accum_steps.")
_MAX_NEW_TOKENS = flags.DEFINE_integer('max_new_tokens', 64, 'Sample-based tasks: most tokens generated per '
                                       'question.')
_OUTPUT = flags.DEFINE_string('output', None, 'JSON file of every result; default WORKDIR/evals/eval_step_<N>.json.')
_LM_EVAL_TASKS = flags.DEFINE_list('lm_eval_tasks', [], 'lm-eval-harness task names, run through '
                                   'trainer/evals/lm_eval_adapter.py (needs `pip install lm-eval`).')
_LM_EVAL_INCLUDE = flags.DEFINE_string('lm_eval_include', None, 'A folder of lm-eval task YAML files to register.')
_LM_EVAL_LIMIT = flags.DEFINE_integer('lm_eval_limit', 0, 'lm-eval: score only the first N documents of each '
                                      'task; 0 = all.')


def _job(config, rows_per_call: int):
  """The run's Job on every local device, data-parallel, one microbatch of rows per call."""
  import jax

  from trainer.run import job as job_lib
  for key in config.mesh:
    config.mesh[key] = 1
  config.mesh.data = -1
  config.parallel.strategy = 'jit'
  config.train.batch_size = rows_per_call or config.train.batch_size // config.train.grad_accum_steps
  config.train.grad_accum_steps = 1
  return job_lib.build_job(config, jax.local_devices())


def _generate(prompt: str, stops, next_logits, codec, max_new_tokens: int) -> str:
  """Greedy continuation of `prompt`, cut at the first stop string or end token."""
  tokens = [*codec.prefix, *codec.encode(prompt)]
  new = []
  for _ in range(max_new_tokens):
    token = sample.generate(next_logits, tokens + new, 1, temperature=0.0, seed=0)[0]
    if token in codec.eos:
      break
    new.append(token)
    text = codec.decode(new)
    if any(stop in text for stop in stops):
      break
  text = codec.decode(new)
  for stop in stops:
    text = text.split(stop)[0]
  return text


def _next_logits(config, params):
  """sample.py's logits source: the KV cache for the launcher's Llama, else the whole window per token."""
  import functools

  import jax
  from trainer.training import task as task_lib
  decoder = sample.cached_decoder(config)
  if decoder is None:
    model_task = task_lib.build_task(config).for_eval()
    bind = lambda p: functools.partial(  # noqa: E731
        lambda p, t: model_task.outputs(p, {'inputs': t, 'targets': jax.numpy.roll(t, -1, axis=1)}), p)
    return sample.WindowLogits(bind, params, config.data.seq_len)
  return sample.CachedLogits(decoder, params, config.data.seq_len)


def _score_generation(task, config, params, codec, max_new_tokens: int) -> dict:
  next_logits = _next_logits(config, params)
  per_question = []
  for question in task.questions:
    text = _generate(question.prompt, question.stop, next_logits, codec, max_new_tokens)
    per_question.append({'line': question.line, 'answer': question.answer, 'generated': text,
                         'exact_match': text.strip() == question.answer.strip()})
  return {'exact_match': sum(q['exact_match'] for q in per_question) / len(per_question),
          'per_question': per_question}


def _lm_eval(names, include, limit: int, job, params, codec, config) -> dict:
  """lm-eval-harness's results for `names` through trainer/evals/lm_eval_adapter.py."""
  import jax

  from trainer import evals
  from trainer.base.errors import UserError
  try:
    import lm_eval
    from lm_eval.tasks import TaskManager
    from trainer.evals import lm_eval_adapter
  except ImportError as e:
    raise UserError(f'--lm_eval_tasks needs lm-eval-harness ({e}); pip install lm-eval (an optional extra, in a '
                    f'venv of its own if you like: docs/evals.md).') from None
  next_logits = None

  def generate(prompt, stops, max_tokens):
    nonlocal next_logits
    next_logits = next_logits or _next_logits(config, params)
    with jax.default_device(jax.local_devices()[0]):
      return _generate(prompt, stops, next_logits, codec, max_tokens)
  model = lm_eval_adapter.LaunchLM(evals.make_scorer(job), params, codec, config.data.seq_len, generate)
  results = lm_eval.simple_evaluate(model=model, tasks=list(names), task_manager=TaskManager(include_path=include),
                                    limit=limit or None, log_samples=True)
  return {'results': results['results'],
          'samples': {name: [{'doc_id': s['doc_id'], 'resps': s['resps'], 'target': s['target']} for s in samples]
                      for name, samples in results.get('samples', {}).items()}}


def evaluate(workdir: str, task_paths, step: str, which: str, max_questions: int, rows_per_call: int,
             max_new_tokens: int, output: str | None, lm_eval_tasks=(), lm_eval_include: str | None = None,
             lm_eval_limit: int = 0) -> dict:
  """Every task's scores for checkpoint `step` of `workdir`; writes them to `output` and returns them."""
  import jax

  from trainer.training import checkpoint
  from trainer import evals
  from trainer.base import confined, storage
  from trainer.training import state as state_lib
  from trainer.base.errors import UserError
  from trainer.evals import codec as codec_lib
  from trainer.evals import tasks
  from trainer.safety import tool_outputs
  if output:
    tool_outputs.refuse_link('--output', output)
  if step != 'latest' and not step.isdigit():
    raise UserError(f"--step={step}: give a checkpoint step or 'latest'.")
  run_dir = storage.path(workdir)
  config = sample.load_run_config(run_dir)
  if not task_paths and not lm_eval_tasks:
    raise UserError('give --tasks (task files) or --lm_eval_tasks (lm-eval-harness task names).')
  loaded = [tasks.load(p, max_questions) for p in task_paths]  # Every file checked before the restore.
  codec = codec_lib.for_run(config)
  job = _job(config, rows_per_call)
  if not (run_dir / 'checkpoints').is_dir():
    raise UserError(f'--workdir={workdir!r} holds no checkpoint (no checkpoints/ folder); train it with launch.py '
                    f'until a checkpoint is saved.')
  chosen = [t.path for t in loaded if t.kind == 'multiple_choice']
  settings = types.SimpleNamespace(tasks=tuple(chosen), every_steps=0, max_questions=max_questions)
  downstream = evals.build(settings, job, workdir=None)  # Rows encoded before the restore, too.
  restored, state = checkpoint.restore_for_tool(job, str(run_dir), None if step == 'latest' else int(step))
  params = state_lib.params_of(state, which)
  results = {}
  if downstream is not None:
    _, details = downstream.score_params(params)
    results.update(details)
  for task in loaded:
    if task.kind == 'generate':
      start = time.perf_counter()
      with jax.default_device(jax.local_devices()[0]):
        results[task.name] = {**_score_generation(task, config, params, codec, max_new_tokens), 'path': task.path,
                              'questions': len(task.questions)}
      results[task.name]['seconds'] = time.perf_counter() - start
  record = {'step': restored, 'params': which, 'tasks': results}
  if lm_eval_tasks:
    record['lm_eval'] = _lm_eval(lm_eval_tasks, lm_eval_include, lm_eval_limit, job, params, codec, config)
  target = storage.path(output) if output else run_dir / 'evals' / f'eval_step_{restored}.json'
  target.parent.mkdir(parents=True, exist_ok=True)
  with tool_outputs.written_whole(str(target), replace=True) as partial:  # Whole, or the file as it was.
    storage.path(partial).write_text(json.dumps(record, indent=1) + '\n')
  record['output'] = str(target)
  return record


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  from trainer.base.errors import UserError
  from parallel import platforms
  platforms.skip_absent_tpu()  # No libtpu start-up lines where no TPU chip is (parallel/platforms.py).
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  try:
    record = evaluate(flags.FLAGS.workdir, _TASKS.value or [], flags.FLAGS.step, flags.FLAGS.params,
                      _MAX_QUESTIONS.value, _ROWS_PER_CALL.value, _MAX_NEW_TOKENS.value, _OUTPUT.value,
                      _LM_EVAL_TASKS.value, _LM_EVAL_INCLUDE.value, _LM_EVAL_LIMIT.value)
  except UserError as e:
    print(f'eval.py: error: {" ".join(str(e).split())}', file=sys.stderr)
    sys.exit(2)
  for name, result in record['tasks'].items():
    scores = ' '.join(f'{k} {result[k]:.4f}' for k in ('acc', 'acc_norm', 'exact_match') if k in result)
    print(f'step {record["step"]} {name}: {scores} ({result["questions"]} questions, {result["seconds"]:.1f}s)')
  for name, metrics in record.get('lm_eval', {}).get('results', {}).items():
    scores = ' '.join(f'{k} {v:.4f}' for k, v in metrics.items() if isinstance(v, float) and 'stderr' not in k)
    print(f'step {record["step"]} lm-eval {name}: {scores}')
  print(f'Results: {record["output"]}')


if __name__ == '__main__':
  from trainer.run import collector
  collector.tune()  # Fewer collections while the model traces (trainer/run/collector.py).
  from trainer.observe import console
  app.run(main, flags_parser=console.one_line_flag_errors('eval.py'))  # Flag errors: one line, exit 2.
