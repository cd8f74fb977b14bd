"""Train-step figures for BENCHMARKS.md, on this machine's CPU (8 fake devices).

  python benchmarks/bench_step.py [--config=configs/default.py] [--rounds=10] [--steps_per_round=5]
      [--parts=speed,host,remat,depth,cache,chunks] [--devices=1,8] [--override=model.scan_layers=True]
      [--loss_chunks=8]

1. The launcher's compiled step driven by its own loop (trainer/run/loop.py's _train,
   with checkpoints, evals and logging switched off and batches already on the
   host) against a minimal hand-written `jax.jit` train step on the same model
   with its blocks unrolled, same mesh, batch and donation, in one process,
   alternating rounds; per-step medians and their ratio, on 1 device and on 8 fake devices.
2. Host time per step outside the compiled call: the same loop driving a step
   that returns at once, so all that is left is the loop's own work.
3. Temporary memory per remat policy for an 8-layer model (memory_analysis), and
   the compile time of scanned vs unrolled layers at 2 and 16 layers.
4. Cold vs warm compile of the train step with the persistent compilation cache
   (two fresh processes sharing one cache folder).
5. (--parts=chunks) The compiled step at train.loss_chunks=1 against --loss_chunks, alternating rounds on one
   device: median step time and temporary memory.
"""

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import argparse  # noqa: E402
import ast  # noqa: E402
import copy  # noqa: E402
import importlib.util  # noqa: E402
import pathlib  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from parallel import sharding  # noqa: E402
from trainer import data  # noqa: E402
from trainer.models import llama  # noqa: E402
from trainer.observe import goodput, profiling
from trainer.observe.metrics import MetricsWriter  # noqa: E402
from trainer.run import job as job_lib  # noqa: E402
from trainer.run import loop
from trainer.safety import guardrails, preemption
from benchmarks import minimal_step  # noqa: E402


class _NoCheckpoints:
  def save(self, *args, **kwargs):
    pass


def _run_context(config, job, step_fn, train_iter, workdir: str) -> loop.RunContext:
  """The loop's real per-step machinery (guardrails, preemption watch, profiler, a disabled metrics writer with
  its goodput) around `step_fn`, with no checkpoints or eval: what the launcher does on the host each step."""
  names = [sharding.path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(job.abstract.params)[0]]
  return loop.RunContext(
      config=config, objective=job.task.objective, compiled_step=step_fn, eval_step=None, eval_set=[],
      train_iter=data.DeviceFeed(train_iter, job.batch_shardings, 1), ckpt=_NoCheckpoints(),
      manifest={}, writer=MetricsWriter(workdir, enabled=False, total_steps=config.train.steps,
                                        goodput=goodput.Goodput(workdir, resumed_step=None)),
      guard=guardrails.Guard('stop', names), preempt=preemption.PreemptionWatch(), throughput=None,
      profiler=profiling.Profiler(config.profile, workdir, first_step=1, total_steps=config.train.steps))


def _load_config(path: str):
  spec = importlib.util.spec_from_file_location('bench_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _quiet(config, num_devices: int):
  """The config as the loop will run it here: one data-parallel mesh, no evals, checkpoints or log lines."""
  config = copy.deepcopy(config)  # Not copy_and_resolve_references: it would fix model.scan_layers to str.
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = -1, 1, 1
  config.train.steps = 10**9
  config.train.eval_every_steps = 0
  config.ckpt.every_steps = 10**9
  config.log.every_steps = 10**9
  # A preset's 'auto', chosen by building the Job as a launch does.
  return job_lib.build_job(config, jax.devices()[:num_devices], log_fn=print).config


def _host_batches(config, count=4):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.model.vocab_size, (count, config.train.batch_size, config.data.seq_len + 1))
  return [{'inputs': t[:, :-1].astype(np.int32), 'targets': t[:, 1:].astype(np.int32)} for t in tokens]


def step_vs_minimal(base_config, num_devices: int, rounds: int, steps_per_round: int) -> dict:
  config = _quiet(base_config, num_devices)
  job = job_lib.build_job(config, jax.devices()[:num_devices])
  compiled = job.compile_train_step()
  # The minimal loop is what one would write by hand: blocks in a plain Python loop (unrolled), whatever the
  # launcher's model.scan_layers, so the ratio shows what the launcher's choice costs.
  unrolled = copy.deepcopy(config)
  unrolled.model.scan_layers = False
  hand_job = job_lib.build_job(unrolled, jax.devices()[:num_devices])
  minimal = minimal_step.build(hand_job)  # The launcher's optimizer, guard included, so its state fits.
  host = _host_batches(config)
  cycle = iter(lambda: host[0], None)  # An endless iterator of host batches, as Grain's would be.
  state = job.init_state(0)
  other = hand_job.init_state(0)
  params, opt_state = other.params, other.opt_state
  holder = {}
  workdir = tempfile.mkdtemp()
  context = _run_context(config, job, _Keep(compiled, holder), cycle, workdir)

  def launcher_round(state, start):
    loop._train(context, state, start_step=start)

  launcher, hand = [], []
  step = 0
  # Warm-up: two rounds each, not timed.
  for r in range(rounds + 2):
    config.train.steps = step + steps_per_round
    holder['state'] = state
    t0 = time.perf_counter()
    launcher_round(state, step)
    jax.block_until_ready(holder['state'])
    t_launch = (time.perf_counter() - t0) / steps_per_round
    state = holder['state']
    step += steps_per_round

    t0 = time.perf_counter()
    for i in range(steps_per_round):  # Its batch goes host -> device each step too, as a real loop's would.
      batch = jax.device_put(host[0], job.batch_shardings)
      params, opt_state, loss = minimal(params, opt_state, batch)
    jax.block_until_ready((params, opt_state, loss))
    t_hand = (time.perf_counter() - t0) / steps_per_round
    if r >= 2:
      launcher.append(t_launch)
      hand.append(t_hand)
  shutil.rmtree(workdir, ignore_errors=True)
  return {'devices': num_devices, 'launcher_ms': 1e3 * statistics.median(launcher),
          'minimal_ms': 1e3 * statistics.median(hand),
          'ratio': statistics.median(launcher) / statistics.median(hand), 'steps': rounds * steps_per_round}


class _Keep:
  """Calls the compiled step and keeps the newest state where the benchmark can reach it."""

  def __init__(self, compiled, holder):
    self._compiled, self._holder = compiled, holder

  def __call__(self, state, batch):
    state, metrics = self._compiled(state, batch)
    self._holder['state'] = state
    return state, metrics


def host_overhead(base_config, steps: int) -> float:
  """Seconds per step the loop spends on the host with a step that costs nothing."""
  config = _quiet(base_config, 1)
  job = job_lib.build_job(config, jax.devices()[:1])
  host = _host_batches(config)
  batch = jax.device_put(host[0], job.batch_shardings)
  state, metrics = job.compile_train_step()(job.init_state(0), batch)  # Real metrics; the free step returns them.
  jax.block_until_ready(metrics)
  cycle = iter(lambda: host[0], None)
  with tempfile.TemporaryDirectory() as workdir:
    context = _run_context(config, job, lambda s, b: (s, metrics), cycle, workdir)
    config.train.steps = steps
    loop._train(context, state, start_step=0)  # Warm-up.
    config.train.steps = 2 * steps
    t0 = time.perf_counter()
    loop._train(context, state, start_step=steps)
    return (time.perf_counter() - t0) / steps


def remat_memory(base_config, num_layers: int = 8) -> list[dict]:
  rows = []
  for policy in ('none',) + tuple(llama.REMAT_POLICIES):
    config = _quiet(base_config, 1)
    config.model.num_layers = num_layers
    config.train.remat_policy = policy
    job = job_lib.build_job(config, jax.devices()[:1])
    t0 = time.perf_counter()
    memory = job.compile_train_step().memory_analysis()
    rows.append({'policy': policy, 'temp_bytes': memory.temp_size_in_bytes, 'compile_s': time.perf_counter() - t0})
  return rows


def compile_vs_depth(base_config, depths=(2, 16)) -> list[tuple[int, bool, float]]:
  """Compile seconds of the train step, scanned and unrolled, at each depth (alternating, 1 device)."""
  rows = []
  for layers in depths:
    for scan in (True, False):
      config = _quiet(base_config, 1)
      config.model.num_layers, config.model.scan_layers = layers, scan
      job = job_lib.build_job(config, jax.devices()[:1])
      t0 = time.perf_counter()
      job.compile_train_step()
      rows.append((layers, scan, time.perf_counter() - t0))
  return rows


_COMPILE_SNIPPET = """
import sys, time, importlib.util
sys.path.insert(0, {repo!r})
spec = importlib.util.spec_from_file_location('c', {config!r}); m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m); config = m.get_config()
config.train.compilation_cache_dir = {cache!r}
from trainer.run import compilation_cache, job
compilation_cache.enable(config.train.compilation_cache_dir)
j = job.build_job(config)
t0 = time.perf_counter(); j.compile_train_step(); print(time.perf_counter() - t0)
"""


def loss_chunks(base_config, chunks: int, rounds: int, steps_per_round: int) -> list[dict]:
  """The compiled step (1 device) at train.loss_chunks=1 and =chunks, alternating rounds: median ms, temp bytes."""
  batch, steps = None, {}
  for n in (1, chunks):
    config = _quiet(base_config, 1)
    config.train.loss_chunks = n
    job = job_lib.build_job(config, jax.devices()[:1])
    compiled = job.compile_train_step()
    batch = batch or jax.device_put(_host_batches(config)[0], job.batch_shardings)
    steps[n] = {'compiled': compiled, 'state': job.init_state(0), 'times': [],
                'temp_bytes': compiled.memory_analysis().temp_size_in_bytes}
  for r in range(rounds + 1):  # The first round of each is a warm-up.
    for n, entry in steps.items():
      t0 = time.perf_counter()
      for _ in range(steps_per_round):
        entry['state'], metrics = entry['compiled'](entry['state'], batch)
      jax.block_until_ready(metrics)
      if r:
        entry['times'].append((time.perf_counter() - t0) / steps_per_round)
  return [{'loss_chunks': n, 'ms': 1e3 * statistics.median(e['times']), 'temp_bytes': e['temp_bytes']}
          for n, e in steps.items()]


def cold_warm_compile(config_path: str) -> tuple[float, float]:
  with tempfile.TemporaryDirectory() as cache:
    code = _COMPILE_SNIPPET.format(repo=str(REPO), config=str(pathlib.Path(config_path).absolute()), cache=cache)
    times = []
    for _ in range(2):
      out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=600, check=True)
      times.append(float(out.stdout.strip().splitlines()[-1]))
  return times[0], times[1]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--config', default=str(REPO / 'configs/default.py'))
  parser.add_argument('--rounds', type=int, default=10)
  parser.add_argument('--steps_per_round', type=int, default=5)
  parser.add_argument('--parts', default='speed,host,remat,depth,cache', help='Comma-separated parts to run.')
  parser.add_argument('--devices', default='1,8', help="Device counts of the 'speed' part.")
  parser.add_argument('--loss_chunks', type=int, default=8, help="The 'chunks' part: train.loss_chunks against 1.")
  parser.add_argument('--override', action='append', default=[], help='KEY=VALUE config override (Python literal).')
  args = parser.parse_args()
  parts = set(args.parts.split(','))
  config = _load_config(args.config)
  for override in args.override:
    path, _, value = override.partition('=')
    section, key = path.split('.')
    config[section][key] = _literal(value)
  print(f'overrides: {args.override or "none"}; model.scan_layers={config.model.scan_layers!r}')
  print(f'jax {jax.__version__}; {len(jax.devices())} x {jax.devices()[0].device_kind}; config {args.config}')
  if 'speed' in parts:
    _speed(config, args)
  if 'host' in parts:
    print(f'\nHost time per step outside the compiled call (loop with a free step, 1 device): '
          f'{host_overhead(config, 200) * 1e3:.3f} ms')
  if 'remat' in parts:
    _remat(config)
  if 'depth' in parts:
    print('\n| layers | scanned compile (s) | unrolled compile (s) |')
    print('|---|---|---|')
    rows = compile_vs_depth(config)
    for layers in sorted({r[0] for r in rows}):
      scanned, unrolled = (next(t for l, s, t in rows if l == layers and s == scan) for scan in (True, False))
      print(f'| {layers} | {scanned:.1f} | {unrolled:.1f} |')
  if 'chunks' in parts:
    rows = loss_chunks(config, args.loss_chunks, args.rounds, args.steps_per_round)
    print('\n| train.loss_chunks (1 device) | step (ms, median) | temp bytes |')
    print('|---|---|---|')
    for r in rows:
      print(f"| {r['loss_chunks']} | {r['ms']:.2f} | {r['temp_bytes']:,} |")
  if 'cache' in parts:
    cold, warm = cold_warm_compile(args.config)
    print(f'\nCompile of the train step, fresh process: cold cache {cold:.2f} s, warm cache {warm:.2f} s '
          f'({cold / warm:.1f}x)')


def _literal(text: str):
  """A Python literal ('True', '4', '(1, 2)'), or the text itself as a string ('auto')."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _speed(config, args):
  print('| devices | launcher step+loop (ms, median) | minimal jax.jit step (ms, median) | ratio | timed steps each |')
  print('|---|---|---|---|---|')
  for n in map(int, args.devices.split(',')):
    r = step_vs_minimal(config, n, args.rounds, args.steps_per_round)
    print(f"| {r['devices']} | {r['launcher_ms']:.2f} | {r['minimal_ms']:.2f} | {r['ratio']:.3f} | {r['steps']} |")


def _remat(config):
  rows = remat_memory(config)
  none = rows[0]['temp_bytes']
  print('\n| remat policy (8 layers) | temp bytes | vs none | compile (s) |')
  print('|---|---|---|---|')
  for r in rows:
    temp, ratio = f"{r['temp_bytes']:,}", f"{r['temp_bytes'] / none:.0%}"
    print(f"| {r['policy']} | {temp} | {ratio} | {r['compile_s']:.1f} |")


if __name__ == '__main__':
  main()
