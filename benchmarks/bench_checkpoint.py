"""How much a checkpoint costs the step loop: blocked time, total save time, restore time, step time after.

  python benchmarks/bench_checkpoint.py [--sizes 10,100,1000] [--steps 5] [--sync] [--workdir_root=gs://BUCKET/PREFIX]

For each target state size (MB of params + Adam moments, float32) it builds
the default LM scaled to that size (batch 8 x 16 tokens, so steps stay short),
compiles the real train step, and in one process:
1. times `--steps` steps, each waited for (the baseline step time);
2. saves once to warm Orbax up, waits, then starts the measured save and
   records how long `save()` held the loop (blocked) and, while the steps go
   on, when the background write finished (total, polled every 2 ms);
3. times the steps run while and right after the save (step-time cost);
4. restores that checkpoint into the state's shardings (restore time).
Runs on whatever devices jax sees (one CPU device unless XLA_FLAGS fakes more).
Checkpoints go to a temporary local folder, or under --workdir_root (a gs://
URL: the saves go to the bucket, as with launch.py --workdir=gs://...).
Prints one JSON line per size and a Markdown table.
"""

import argparse
import json
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

# d_model, num_layers, mlp_dim giving about the requested state size (3 x params x 4 bytes).
SHAPES = {10: (256, 1, 1024), 100: (512, 2, 2048), 1000: (1024, 5, 4096)}


def _config(size_mb: int, async_save: bool):
  from configs import default
  config = default.get_config()
  d_model, layers, mlp = SHAPES[size_mb]
  config.model.update(d_model=d_model, num_layers=layers, mlp_dim=mlp, num_heads=max(1, d_model // 64))
  config.train.update(batch_size=8, steps=10_000, warmup_steps=1)
  config.data.seq_len = 16
  config.ckpt.update(every_steps=1_000_000, max_to_keep=2, async_save=async_save)
  return config


def _timed_step(compiled, state, batch):
  start = time.perf_counter()
  state, metrics = compiled(state, batch)
  metrics['loss'].block_until_ready()
  return state, time.perf_counter() - start


def _watch(ckpt, finished: list) -> None:
  while ckpt.save_in_progress():
    time.sleep(0.002)
  finished.append(time.perf_counter())


def bench(size_mb: int, steps: int, async_save: bool, root: pathlib.Path, workdir_root: str | None = None) -> dict:
  import jax
  import numpy as np

  from parallel import sharding
  from trainer.training import checkpoint
  from trainer.training import manifest as manifests
  from trainer import data
  from trainer.base import storage
  from trainer.run import job as job_lib
  config = _config(size_mb, async_save)
  text = root / 'text'
  text.mkdir(exist_ok=True)
  (text / 'a.py').write_bytes(bytes(np.random.default_rng(0).integers(32, 127, 200_000, dtype=np.uint8)))
  config.data.text_dir = str(text)
  job = job_lib.build_job(config)
  state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(job.abstract))
  compiled = job.compile_train_step()
  state = job.init_state(0)
  iterator = data.train_iterator_for(config)
  batch = data.to_global(next(iterator), job.batch_shardings, 1)
  manifest = manifests.run_manifest(config, job.abstract, job.mesh)
  workdir = f'{workdir_root or root}/run_{size_mb}_{"async" if async_save else "sync"}'
  ckpt = checkpoint.Checkpointer(str(workdir), config.ckpt)

  for _ in range(2):  # Compile-time effects out of the baseline.
    state, _ = _timed_step(compiled, state, batch)
  baseline = []
  for _ in range(steps):
    state, seconds = _timed_step(compiled, state, batch)
    baseline.append(seconds)
  ckpt.save(1, state, iterator, manifest, force=True)  # Warm-up save: Orbax's one-time set-up.
  ckpt.wait_until_finished()

  finished = []
  start = time.perf_counter()
  ckpt.save(2, state, iterator, manifest, force=True)
  blocked = time.perf_counter() - start
  watcher = threading.Thread(target=_watch, args=(ckpt, finished))  # Polls every 2 ms for the write's end.
  watcher.start()
  after = []
  for _ in range(steps):
    state, seconds = _timed_step(compiled, state, batch)
    after.append(seconds)
  watcher.join()
  total = finished[0] - start
  ckpt.close()

  reader = checkpoint.Checkpointer(str(workdir), config.ckpt)
  target = sharding.with_shardings(job.abstract, job.shardings)
  start = time.perf_counter()
  restored = reader.restore_state(2, target)
  jax.block_until_ready(restored)
  restore = time.perf_counter() - start
  reader.close()
  if storage.is_cloud(workdir):
    storage.filesystem().rm(workdir, recursive=True)
  else:
    shutil.rmtree(workdir, ignore_errors=True)
  base = float(np.median(baseline))
  return {
      'state_mb': round(state_bytes / 1e6, 1), 'async': async_save, 'devices': jax.device_count(),
      'blocked_s': round(blocked, 3), 'total_save_s': round(total, 3),
      'blocked_pct_of_total': round(100 * blocked / total, 1), 'restore_s': round(restore, 3),
      'step_s_baseline_median': round(base, 4),
      'step_s_first_after_save': round(after[0], 4),
      'step_s_after_save_mean': round(float(np.mean(after[:steps])), 4),
      'step_cost_after_save_pct': round(100 * (float(np.mean(after[:steps])) / base - 1), 1),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--sizes', default='10,100,1000', help=f'comma-separated MB, from {sorted(SHAPES)}')
  parser.add_argument('--steps', type=int, default=5, help='steps timed before and after the save')
  parser.add_argument('--sync', action='store_true', help='also measure ckpt.async_save=False')
  parser.add_argument('--workdir_root', default=None, help='save under this gs:// URL instead of a local temp folder')
  args = parser.parse_args()
  import jax
  rows = []
  root = pathlib.Path(tempfile.mkdtemp(prefix='bench_checkpoint_'))
  try:
    for size in map(int, args.sizes.split(',')):
      for async_save in (True, False) if args.sync else (True,):
        row = bench(size, args.steps, async_save, root, args.workdir_root)
        print(json.dumps(row), flush=True)
        rows.append(row)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  print(f'\nmachine: {platform.machine()}, {os.cpu_count()} cpus, {jax.devices()[0].device_kind} x '
        f'{jax.device_count()}; jax {jax.__version__}, orbax-checkpoint '
        f'{__import__("orbax.checkpoint").checkpoint.__version__}\n')
  print('| state MB | async | blocked s | total save s | blocked % of total | restore s | step s (median before) '
        '| step s (first after) | step s (mean of after) | step cost after save |')
  print('|---|---|---|---|---|---|---|---|---|---|')
  for r in rows:
    print(f"| {r['state_mb']} | {r['async']} | {r['blocked_s']} | {r['total_save_s']} | {r['blocked_pct_of_total']}% "
          f"| {r['restore_s']} | {r['step_s_baseline_median']} | {r['step_s_first_after_save']} "
          f"| {r['step_s_after_save_mean']} | {r['step_cost_after_save_pct']:+}% |")


if __name__ == '__main__':
  main()
