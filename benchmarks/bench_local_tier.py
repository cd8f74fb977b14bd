"""What the local checkpoint tier costs the step loop: step time with it and without, alternated in one run.

  python benchmarks/bench_local_tier.py [--num_processes 2] [--every 2] [--rounds 8] [--block 20] [--local_dir /dev/shm]

configs/tiny.py's real train step, compiled once, run in blocks of `--block` steps
that take turns: no local tier ('off'); the local tier saving every `--every` steps
(trainer/training/local_tier.py: a copy, the peer's shards moved here, a background
write); and, for the choice docs/checkpoints.md explains, Orbax's ordinary async
CheckpointManager (trainer/training/checkpoint.py) saving to the same folder at the
same cadence ('orbax'). Steps are dispatched as the loop does (each step's loss
fetched one step late), so a save's cost is whatever it holds the loop up.
`--num_processes 2` starts two processes of 4 CPU devices each, joined with
jax.distributed over gloo, the mesh fsdp=8 so each holds different shards and
the peer copy is real (Orbax's manager then writes the global checkpoint from
both). Prints each block's mean step time, then the median ratio per mode.
"""

import argparse
import json
import os
import pathlib
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def _block(compiled, state, batch, steps: int, first_step: int, save) -> tuple[object, float]:
  """Runs `steps` steps as the loop does (the loss fetched a step late), `save(step, state)` after each."""
  start, pending = time.perf_counter(), None
  for step in range(first_step, first_step + steps):
    state, metrics = compiled(state, batch)
    if pending is not None:
      float(pending['loss'])
    pending = metrics
    save(step, state)
  float(pending['loss'])
  return state, (time.perf_counter() - start) / steps


def bench(args, root: pathlib.Path) -> dict:
  import jax
  import numpy as np

  from configs import tiny
  from trainer import data
  from trainer.run import job as job_lib
  from trainer.training import checkpoint, local_tier
  from trainer.training import manifest as manifests
  config = tiny.get_config()
  text = root / 'text'
  text.mkdir(exist_ok=True)
  (text / 'a.py').write_bytes(bytes(np.random.default_rng(0).integers(32, 127, 200_000, dtype=np.uint8)))
  config.data.text_dir = str(text)
  config.train.steps = 100_000
  if jax.process_count() > 1:
    config.mesh.update(data=1, fsdp=jax.device_count())
  config.ckpt.update(every_steps=args.every, max_to_keep=2, async_save=True)
  job = job_lib.build_job(config)
  compiled = job.compile_train_step()
  state = job.init_state(0)
  iterator = data.train_iterator_for(config, jax.process_index(), jax.process_count())
  batch = data.to_global(next(iterator), job.batch_shardings, jax.process_count())
  manifest = manifests.run_manifest(config, job.abstract, job.mesh)
  local = pathlib.Path(args.local_dir) / f'bench_local_tier_{os.getppid() if jax.process_count() > 1 else os.getpid()}'
  tier = local_tier.LocalTier(str(local), args.every, str(root / 'run'), jax.process_index(), jax.process_count())
  orbax = checkpoint.Checkpointer(str(local / 'orbax'), config.ckpt)
  data_state = iterator.get_state()

  def with_tier(step, state):
    if tier.due(step):
      tier.save(step, state, data_state, manifest)

  def with_orbax(step, state):
    if step % args.every == 0:
      orbax.save(step, state, iterator, manifest)

  modes = {'off': lambda step, state: None, 'local tier': with_tier, 'orbax': with_orbax}
  times = {mode: [] for mode in modes}
  step = 1
  for round_ in range(args.rounds + 1):  # Round 0 warms every path up (first save, first transfer) and is dropped.
    for mode, save in modes.items():
      state, seconds = _block(compiled, state, batch, args.block, step, save)
      tier.wait_until_finished()
      orbax.wait_until_finished()
      step += args.block
      if round_:
        times[mode].append(seconds)
  orbax.close()
  state_mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(job.abstract)) / 1e6
  shutil.rmtree(local, ignore_errors=True)
  off = np.array(times['off'])
  return {'process': jax.process_index(), 'processes': jax.process_count(), 'devices': jax.device_count(),
          'state_mb': round(state_mb, 2), 'every_steps': args.every, 'block': args.block, 'rounds': args.rounds,
          'step_s_off_median': round(float(np.median(off)), 5),
          **{f'cost_pct_{mode.replace(" ", "_")}': round(100 * float(np.median(np.array(t) / off - 1)), 1)
             for mode, t in times.items() if mode != 'off'},
          'blocks': {mode: [round(t, 5) for t in ts] for mode, ts in times.items()}}


def _spawn(args) -> None:
  """Starts `--num_processes` copies of this script, each one process of a jax.distributed group on this host."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  flags = f'--xla_force_host_platform_device_count={args.devices_per_process}'
  children = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env={
      **os.environ, 'BENCH_PROCESS': f'{i},{args.num_processes},{port}', 'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': flags})
              for i in range(args.num_processes)]
  sys.exit(max(child.wait() for child in children))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--num_processes', type=int, default=1)
  parser.add_argument('--devices_per_process', type=int, default=4)
  parser.add_argument('--every', type=int, default=2, help='ckpt.local_every_steps (and the Orbax cadence)')
  parser.add_argument('--rounds', type=int, default=8, help='rounds of one block per mode, after a warm-up round')
  parser.add_argument('--block', type=int, default=20, help='steps per block')
  parser.add_argument('--local_dir', default='/dev/shm' if os.path.isdir('/dev/shm') else tempfile.gettempdir())
  args = parser.parse_args()
  spawned = os.environ.get('BENCH_PROCESS')
  if args.num_processes > 1 and not spawned:
    _spawn(args)
  import jax
  if spawned:
    index, count, port = map(int, spawned.split(','))
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(f'127.0.0.1:{port}', count, index)
  root = pathlib.Path(tempfile.mkdtemp(prefix='bench_local_tier_'))
  try:
    row = bench(args, root)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  if jax.process_index() == 0:
    print(json.dumps(row), flush=True)
    print(f'\nmachine: {platform.machine()}, {os.cpu_count()} cpus, {jax.devices()[0].device_kind} x '
          f'{jax.device_count()} in {jax.process_count()} process(es); jax {jax.__version__}, orbax-checkpoint '
          f'{__import__("orbax.checkpoint").checkpoint.__version__}; local folder {args.local_dir}\n')
    print('| processes x devices | state MB | every | step s (off, median) | local tier | Orbax manager |')
    print('|---|---|---|---|---|---|')
    print(f"| {row['processes']} x {row['devices'] // row['processes']} | {row['state_mb']} | {row['every_steps']} "
          f"| {row['step_s_off_median']} | {row['cost_pct_local_tier']:+}% | {row['cost_pct_orbax']:+}% |")


if __name__ == '__main__':
  main()
