"""Downstream-eval scoring throughput against the train step's, on the same model and mesh, for BENCHMARKS.md.

  python benchmarks/bench_evals.py [--config=configs/default.py] [--devices=8] [--questions=256] [--choices=4]
      [--rounds=5] [--steps_per_round=5]

Builds the config's Job (no data, no workdir), then alternates rounds of (a) `--steps_per_round` compiled train steps
on random token batches and (b) scoring a synthetic task of `--questions` questions of `--choices` choices (a
prompt of ~3/4 of data.seq_len bytes, 8-16-byte choices: rows of the whole row length, as a long context makes
them) through trainer/evals/ with the current parameters. Prints the medians: train tokens/s, scoring questions/s,
rows/s and row-tokens/s (rows x data.seq_len: the tokens the forward runs over), and the ratio of the two
tokens/s (a forward alone, so above 1). Byte-level runs only (the task's text is encoded as bytes).
"""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _task_file(folder: pathlib.Path, questions: int, choices: int, seq_len: int) -> str:
  import numpy as np
  rng = np.random.default_rng(0)
  letters = np.array(list('abcdefghijklmnopqrstuvwxyz      '))
  def text(n):
    return ''.join(rng.choice(letters, n)).strip() or 'x'
  path = folder / 'bench.jsonl'
  path.write_text(''.join(json.dumps({'context': text(seq_len * 3 // 4), 'gold': 0,
                                      'choices': [text(int(rng.integers(8, 17))) for _ in range(choices)]}) + '\n'
                          for _ in range(questions)))
  return str(path)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', default='configs/default.py')
  parser.add_argument('--devices', type=int, default=0, help='devices of the mesh; 0 = all')
  parser.add_argument('--questions', type=int, default=256)
  parser.add_argument('--choices', type=int, default=4)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--steps_per_round', type=int, default=5)
  args = parser.parse_args()

  import importlib.util
  import types

  import jax
  import numpy as np

  from trainer import evals
  from trainer.run import job as job_lib
  spec = importlib.util.spec_from_file_location('bench_config', REPO / args.config)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  config.data.source = 'text'
  devices = jax.devices()[:args.devices] if args.devices else jax.devices()
  job = job_lib.build_job(config, devices)
  seq_len = config.data.seq_len
  with tempfile.TemporaryDirectory() as folder:
    settings = types.SimpleNamespace(tasks=(_task_file(pathlib.Path(folder), args.questions, args.choices, seq_len),),
                                     every_steps=0, max_questions=0)
    downstream = evals.build(settings, job, workdir=None)
  rows = len(downstream.rows[0].inputs)
  state = job.init_state(0)
  step = job.compile_train_step()
  batches = [{k: jax.device_put(np.random.default_rng(i).integers(0, config.model.vocab_size, s.shape).astype(s.dtype),
                                s.sharding) for k, s in job.abstract_batch.items()} for i in range(2)]
  state, metrics = step(state, batches[0])  # Warm: the step and the scorer each run once before any timing.
  jax.block_until_ready(metrics)
  downstream.scorer.log_likelihoods(state.params, downstream.rows[0])
  train_tps, score_qps = [], []
  for r in range(args.rounds):
    start = time.perf_counter()
    for i in range(args.steps_per_round):
      state, metrics = step(state, batches[i % 2])
    jax.block_until_ready(metrics)
    train_tps.append(args.steps_per_round * job.task.objective.units_per_step / (time.perf_counter() - start))
    start = time.perf_counter()
    downstream.scorer.log_likelihoods(state.params, downstream.rows[0])  # Fetched: the scores are on the host.
    score_qps.append(args.questions / (time.perf_counter() - start))
  train, qps = statistics.median(train_tps), statistics.median(score_qps)
  row_tokens = qps * rows / args.questions * seq_len
  print(f'{args.config} on {len(devices)} {jax.default_backend()} device(s), mesh {dict(job.mesh.shape)}, '
        f'{sum(x.size for x in jax.tree.leaves(job.abstract.params)):,} parameters, seq_len {seq_len}, '
        f'batch {config.train.batch_size}')
  print(f'train step: {train:,.0f} tokens/s (median of {args.rounds} rounds of {args.steps_per_round} steps)')
  print(f'scoring: {qps:,.1f} questions/s of {args.choices} choices = {qps * rows / args.questions:,.1f} rows/s = '
        f'{row_tokens:,.0f} row-tokens/s ({rows} rows, {downstream.scorer.rows_per_call} a call; median of '
        f'{args.rounds} rounds)')
  print(f'row-tokens/s over train tokens/s: {row_tokens / train:.2f}')


if __name__ == '__main__':
  main()
