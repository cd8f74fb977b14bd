"""Is the input pipeline fast enough? Pipeline batches/s alone vs the batches/s the train step consumes.

  python benchmarks/bench_data.py [--config=configs/default.py] [--batches=200] [--run_steps=100] [--set=data.source=...]

For each data.worker_count in --workers and data.prefetch in --prefetch:
  pipeline_batches_per_s  next() + assembling the global jax.Array, nothing else running
  headroom                pipeline_batches_per_s / the train step's batches/s on the same config
                          (the step timed alone, on one resident batch, each step blocked on)
  real_wait_share         sum(data_wait_s) / sum(step_time_s) from metrics.jsonl of a real
                          `launch.py` run of --run_steps steps (log.every_steps=1, step 1 left out)
Prints one JSON object per setting and a Markdown table for BENCHMARKS.md.
"""

import argparse
import importlib
import json
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def load_config(path: str, overrides: list[str]):
  config = importlib.import_module(path.removesuffix('.py').replace('/', '.')).get_config()
  for item in overrides:
    key, value = item.split('=', 1)
    node = config
    *parents, leaf = key.split('.')
    for p in parents:
      node = node[p]
    node[leaf] = type(node[leaf])(value) if node[leaf] is not None and not isinstance(node[leaf], bool) else (
        value == 'True' if isinstance(node[leaf], bool) else value)
  return config


def pipeline_rate(config, job, batches: int) -> float:
  import jax
  from trainer import data
  inputs = data.build(config.data, data.Needs.of(config.model, config.train), job.batch_shardings, jax.process_index(),
                      jax.process_count())
  for _ in range(5):  # Start threads and workers, fill the buffers.
    data.to_global(next(inputs.train), job.batch_shardings, 1)
  start = time.perf_counter()
  for _ in range(batches):
    batch = data.to_global(next(inputs.train), job.batch_shardings, 1)
  jax.block_until_ready(batch)
  rate = batches / (time.perf_counter() - start)
  inputs.train.close()
  return rate


def step_rate(config, job, steps: int) -> float:
  import jax
  from trainer import data
  inputs = data.build(config.data, data.Needs.of(config.model, config.train), job.batch_shardings, 0, 1)
  batch = data.to_global(next(inputs.train), job.batch_shardings, 1)
  compiled, state = job.compile_train_step(), job.init_state(config.train.seed)
  for _ in range(3):
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
  return steps / (time.perf_counter() - start)


def real_run_share(args, workers: int, prefetch: int) -> float:
  workdir = pathlib.Path(tempfile.mkdtemp(prefix='bench_data_'))
  try:
    cmd = [sys.executable, str(REPO / 'launch.py'), f'--config={args.config}', f'--workdir={workdir}',
           f'--config.train.steps={args.run_steps}', '--config.log.every_steps=1', '--config.train.eval_every_steps=0',
           f'--config.ckpt.every_steps={args.run_steps}', f'--config.data.worker_count={workers}',
           f'--config.data.prefetch={prefetch}', *[f'--config.{s}' for s in args.set]]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=1200)
    records = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()][1:]
    return sum(r['data_wait_s'] for r in records) / sum(r['step_time_s'] for r in records)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--config', default='configs/default.py')
  parser.add_argument('--batches', type=int, default=200, help='batches timed per pipeline setting')
  parser.add_argument('--steps', type=int, default=30, help='train steps timed for the step rate')
  parser.add_argument('--run_steps', type=int, default=100, help='steps of each real run; 0 skips the runs')
  parser.add_argument('--workers', default='0,1,2')
  parser.add_argument('--prefetch', default='0,2')
  parser.add_argument('--set', action='append', default=[], help='config override KEY=VALUE, e.g. data.packing=True')
  args = parser.parse_args()

  import grain
  import jax
  from absl import flags
  flags.FLAGS.mark_as_parsed()
  from trainer.run import job as job_lib
  job = job_lib.build_job(load_config(args.config, args.set), log_fn=print)  # A preset's 'auto', as a launch does.
  config = job.config
  steps_per_s = step_rate(config, job, args.steps)
  rows = []
  for workers in map(int, args.workers.split(',')):
    for prefetch in map(int, args.prefetch.split(',')):
      config.data.worker_count, config.data.prefetch = workers, prefetch
      rate = pipeline_rate(config, job, args.batches)
      share = real_run_share(args, workers, prefetch) if args.run_steps else None
      row = {'worker_count': workers, 'prefetch': prefetch, 'pipeline_batches_per_s': round(rate, 1),
             'step_batches_per_s': round(steps_per_s, 1), 'headroom': round(rate / steps_per_s, 1),
             'real_wait_share_pct': None if share is None else round(100 * share, 2)}
      print(json.dumps(row), flush=True)
      rows.append(row)
  print(f'\nconfig {args.config} {" ".join(args.set)}; batch {config.train.batch_size} x {config.data.seq_len}, '
        f'source {config.data.source}, packing {config.data.packing}, num_threads {config.data.num_threads}; '
        f'{jax.device_count()} {jax.default_backend()} device(s), {platform.machine()}, '
        f'jax {jax.__version__}, grain {grain.__version__}, Python {platform.python_version()}\n')
  print('| worker_count | prefetch | pipeline batches/s | train step batches/s | headroom | data wait, real run |')
  print('|---|---|---|---|---|---|')
  for r in rows:
    share = '-' if r['real_wait_share_pct'] is None else f"{r['real_wait_share_pct']}%"
    print(f"| {r['worker_count']} | {r['prefetch']} | {r['pipeline_batches_per_s']} | {r['step_batches_per_s']} | "
          f"{r['headroom']}x | {share} |")


if __name__ == '__main__':
  main()
