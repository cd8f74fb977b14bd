"""The GPU rows of BENCHMARKS.md in one invocation, measured through the launcher's own Job, data and loop.

  python benchmarks/bench_gpu.py [--rows=ROW,ROW] [--steps=20] [--warmup=3] [--attention=cudnn] [--logs=DIR]
  python benchmarks/bench_gpu.py --smoke --rows=gpt2_b32,vit_b256   # CPU: tiny shrunk rows, seconds

Rows: gpt2_b32, gpt2_b64 (configs/gpt2_124m.py at batch 32 / 64 x 1024, synthetic tokens);
gpt2_b32_text and gpt2_b32_packed (the same on the stdlib's text, windows vs documents packed with
data.packing=True); llama_b16_<policy> (configs/llama_1b.py at batch 16 x 2048, synthetic, one row per
train.remat_policy, llama_b16_auto included); vit_b256 (configs/vit_base.py at batch 256, synthetic images);
gpt2_b64_chunked and llama_b16_full_chunked (the same with train.loss_chunks=8); moe_b4, moe_b8 and
moe_b8_capacity (configs/moe_1b.py, synthetic, dropless or capacity 1.25; no reference). References:
<row>_minimal for each synthetic-token row (gpt2_b64_minimal, llama_b16_full_minimal, ...): the same model,
optimizer and shapes in a hand-written jit step on one resident batch (benchmarks/minimal_step.py), timed in the
same run, so the launcher's cost over a minimal loop is a ratio of two rows measured side by side.

Each row builds the real Job (trainer/run/job.py) and inputs (trainer/data: the device feed, the pooled synthetic
source) and drives trainer/run/loop.py's `_train` with checkpoints and evals off, so it measures what the launcher
runs. Per row: tokens/s or images/s, TFLOP/s per device and MFU from the FLOPs counted in the traced step
(trainer/observe/flops.py), and for Llama rows MFU under the analytic 6N convention too (MFU only where the device's
peak is known, so none on CPU), peak device memory (`memory_stats`) beside the compiled step's own figure (what
`launch.py --plan --topology=h100` reports without the GPU) and the share of step
time spent waiting for data, all from the loop's own metrics over the timed steps. On a GPU each row runs in
its own process, so peak memory is that row's and an out-of-memory row is reported without ending the others;
--smoke runs in-process on shrunk models (CPU has no memory stats).
"""

import argparse
import importlib
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

from trainer.models import llama  # noqa: E402  (no device work at import)

# Row -> (preset, config overrides).
ROWS = {
    'gpt2_b32': ('gpt2_124m', {'train.batch_size': 32, 'data.source': 'synthetic'}),
    'gpt2_b64': ('gpt2_124m', {'train.batch_size': 64, 'data.source': 'synthetic'}),
    'gpt2_b32_text': ('gpt2_124m', {'train.batch_size': 32, 'data.source': 'text', 'data.packing': False}),
    'gpt2_b32_packed': ('gpt2_124m', {'train.batch_size': 32, 'data.source': 'text', 'data.packing': True}),
    **{f'llama_b16_{policy}': ('llama_1b', {'train.batch_size': 16, 'data.source': 'synthetic',
                                            'train.remat_policy': policy}) for policy in llama.REMAT_POLICIES},
    'vit_b256': ('vit_base', {'train.batch_size': 256, 'data.source': 'synthetic'}),
    # The logits a slice of positions at a time: what the recomputed head costs beside what it saves.
    'gpt2_b64_chunked': ('gpt2_124m', {'train.batch_size': 64, 'data.source': 'synthetic', 'train.loss_chunks': 8}),
    'llama_b16_full_chunked': ('llama_1b', {'train.batch_size': 16, 'data.source': 'synthetic',
                                            'train.remat_policy': 'full', 'train.loss_chunks': 8}),
    'llama_b16_auto': ('llama_1b', {'train.batch_size': 16, 'data.source': 'synthetic', 'train.remat_policy': 'auto'}),
    # Mixture of experts (configs/moe_1b.py, remat 'auto'): dropless, and capacity mode at 1.25.
    'moe_b4': ('moe_1b', {'train.batch_size': 4, 'data.source': 'synthetic'}),
    'moe_b8': ('moe_1b', {'train.batch_size': 8, 'data.source': 'synthetic'}),
    'moe_b8_capacity': ('moe_1b', {'train.batch_size': 8, 'data.source': 'synthetic',
                                   'model.expert_capacity_factor': 1.25}),
}
# '<row>_minimal': the same model, optimizer and shapes in a hand-written step (measure_minimal), for the
# synthetic-token rows, where one resident batch is what the launcher's row feeds too.
REFERENCES = {f'{name}_minimal': name for name, (preset, overrides) in ROWS.items()
              if preset not in ('vit_base', 'moe_1b') and overrides['data.source'] == 'synthetic'
              and 'train.loss_chunks' not in overrides}  # The hand-written step has no chunked loss.
# --smoke: every row's structure (tying, kv-head ratio, patch size, remat, packing) at toy sizes.
SMOKE = {'model.num_layers': 1, 'model.d_model': 64, 'model.mlp_dim': 128, 'train.batch_size': 8,
         'data.seq_len': 32}


def row_config(name: str, attention: str | None, smoke: bool):
  preset, overrides = ROWS[name]
  config = importlib.import_module(f'configs.{preset}').get_config()
  overrides = {**overrides, 'train.eval_every_steps': 0, 'train.eval_batches': 0, 'ckpt.every_steps': 10**9,
               'log.progress_bar': 'off'}
  if smoke:
    overrides.update(SMOKE)
    m = config.model
    heads = 8
    overrides['model.num_heads'] = heads
    if m.num_kv_heads:  # Keep the preset's query heads per kv head.
      overrides['model.num_kv_heads'] = heads // (m.num_heads // m.num_kv_heads)
    if m.get('num_experts', 0):
      overrides['model.expert_mlp_dim'] = 128
    if m.task == 'lm':
      overrides['model.vocab_size'] = 512  # At least the 256 byte values of text rows.
    else:
      overrides['data.image_shape'] = (2 * m.patch_size, 2 * m.patch_size, 3)
  if attention is not None:
    overrides['model.attention'] = attention
  for path, value in overrides.items():
    section, key = path.split('.')
    config[section][key] = value
  return config


def measure(name: str, steps: int, warmup: int, attention: str | None, smoke: bool) -> dict:
  """One row through the launcher's Job, data and loop; the loop's own metrics over the timed steps."""
  import jax
  from trainer import data
  from trainer.observe import flops, goodput, profiling
  from trainer.safety import guardrails, preemption
  from trainer.run import loop
  from trainer.run import job as job_lib
  from trainer.observe.metrics import MetricsWriter

  config = row_config(name, attention, smoke)
  devices = jax.devices()[:1] if smoke else None  # Smoke: compiles in seconds.
  job = job_lib.build_job(config, devices, log_fn=print)  # The presets' remat 'auto', chosen as a launch does.
  config = job.config
  inputs = data.build(config.data, data.Needs.of(config.model, config.train), job.batch_shardings, jax.process_index(),
                      jax.process_count())
  feed = data.DeviceFeed(inputs.train, job.batch_shardings, jax.process_count())
  workdir = tempfile.mkdtemp(prefix=f'bench_gpu_{name}_')
  compiled, newest = job.compile_train_step(), {}

  def keep(state, batch):  # The loop donates the state; the timed call starts from the warm-up's last one.
    newest['state'], metrics = compiled(state, batch)
    return newest['state'], metrics

  config.log.every_steps = 10**9  # Logged: each _train call's first step, then one window over the rest.
  writer = MetricsWriter(workdir, enabled=True, total_steps=warmup + steps,
                         goodput=goodput.Goodput(workdir, resumed_step=None))
  context = loop.RunContext(
      config=config, objective=job.task.objective, compiled_step=keep, eval_step=None,
      eval_set=[], train_iter=feed, ckpt=_NoCheckpoints(), manifest={}, writer=writer,
      guard=guardrails.Guard('stop', []), preempt=preemption.PreemptionWatch(),
      throughput=flops.Throughput.for_job(job),
      profiler=profiling.Profiler(config.profile, workdir, first_step=1, total_steps=warmup + steps))
  state = job.init_state(config.train.seed)
  try:
    try:
      config.train.steps = warmup
      loop._train(context, state, start_step=0)  # Compile-free warm-up: the feed's thread and the pool start here.
      config.train.steps = warmup + steps
      loop._train(context, newest['state'], start_step=warmup)
    finally:
      feed.close()
      writer.close()
    record = [json.loads(line) for line in (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()][-1]
  finally:
    shutil.rmtree(workdir, ignore_errors=True)  # Only metrics.jsonl was wanted: a row leaves nothing behind.
  unit = job.task.objective.unit
  return _row(name, job, compiled, per_s=record[f'{unit}_per_s'], step_s=record['step_time_s'],
              rates=record, data_wait_pct=100 * record['data_wait_s'] / record['step_time_s'])


def measure_minimal(name: str, steps: int, warmup: int, attention: str | None, smoke: bool) -> dict:
  """A row's model, optimizer and shapes in benchmarks/minimal_step.py's hand-written step, as a reference.

  One batch of random tokens stays on the devices; no loop, metrics, guard or input pipeline. The launcher's row
  over this one is what the launcher costs on that hardware, measured in the same run.
  """
  import jax
  import numpy as np
  from benchmarks import minimal_step
  from trainer.observe import flops
  from trainer.run import job as job_lib

  config = row_config(REFERENCES[name], attention, smoke)
  devices = jax.devices()[:1] if smoke else None
  job = job_lib.build_job(config, devices, log_fn=print)  # The same policy the launcher's row runs.
  config = job.config
  tokens = np.random.default_rng(0).integers(0, config.model.vocab_size,
                                             (config.train.batch_size, config.data.seq_len + 1), dtype=np.int32)
  batch = jax.device_put({'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}, job.batch_shardings)
  state = job.init_state(config.train.seed)
  params, opt_state = state.params, state.opt_state
  compiled = minimal_step.build(job).lower(params, opt_state, batch).compile()
  for _ in range(warmup):
    params, opt_state, loss = compiled(params, opt_state, batch)
  jax.block_until_ready(loss)
  start = time.perf_counter()
  for _ in range(steps):
    params, opt_state, loss = compiled(params, opt_state, batch)
  jax.block_until_ready((params, opt_state, loss))
  step_s = (time.perf_counter() - start) / steps
  throughput = flops.Throughput.for_job(job)  # The launcher's row counts the same traced FLOPs.
  return _row(name, job, compiled, per_s=tokens[:, 1:].size / step_s, step_s=step_s,
              rates=throughput.metrics(step_s) if throughput else {}, data_wait_pct=None)


def _measure(name: str, *args, **kwargs) -> dict:
  return (measure_minimal if name in REFERENCES else measure)(name, *args, **kwargs)


def _row(name: str, job, compiled, *, per_s: float, step_s: float, rates: dict, data_wait_pct: float | None):
  import jax
  from trainer import attention as attention_lib
  from trainer.memory import footprint

  stats = jax.devices()[0].memory_stats() or {}
  config = job.config
  choice = attention_lib.check_config(config.model, config.data, config.train.compute_dtype, job.mesh)
  return {'row': name, 'devices': job.mesh.size, 'device': jax.devices()[0].device_kind,
          'attention': choice.kernel if choice else None,
          'per_s': per_s, 'unit': job.task.objective.unit, 'step_ms': 1e3 * step_s,
          'tflops': rates.get('tflops_per_device'), 'mfu': rates.get('mfu'), 'mfu_6n': rates.get('mfu_6n'),
          'peak_gib': stats['peak_bytes_in_use'] / 2**30 if 'peak_bytes_in_use' in stats else None,
          # What plan mode reports for the same step (`--plan --topology=h100` on a host without the GPU).
          'compiled_gib': footprint.compiled_bytes(compiled) / 2**30, 'data_wait_pct': data_wait_pct}


class _NoCheckpoints:
  def save(self, *args, **kwargs):
    pass


def _in_subprocess(name: str, args) -> dict:
  """One row in a fresh process: its own peak memory, and an out-of-memory error ends only that row."""
  command = [sys.executable, __file__, '--one_row', name, f'--steps={args.steps}', f'--warmup={args.warmup}']
  command += [f'--attention={args.attention}'] if args.attention else []
  done = subprocess.run(command, capture_output=True, text=True)
  if args.logs:  # The row's whole output: the kernel and remat lines, warnings, a traceback.
    pathlib.Path(args.logs).mkdir(parents=True, exist_ok=True)
    (pathlib.Path(args.logs) / f'{name}.log').write_text(done.stdout + done.stderr)
  lines = done.stdout.strip().splitlines()
  if done.returncode or not lines:
    last = (done.stderr.strip().splitlines() or ['no output'])[-1]
    return {'row': name, 'error': last[:200]}
  return json.loads(lines[-1])


def _fmt(value, pattern: str) -> str:
  return '-' if value is None else pattern.format(value)


def table(results: list[dict]) -> str:
  lines = ['| row | device | attention | per s | step (ms) | TFLOP/s per device | MFU | MFU 6N | peak GiB '
           '| compiled GiB | data wait |',
           '|---|---|---|---|---|---|---|---|---|---|---|']
  for r in results:
    if 'error' in r:
      lines.append(f"| {r['row']} | failed: {r['error']} | | | | | | | | | |")
      continue
    lines.append(f"| {r['row']} | {r['devices']} x {r['device']} | {_fmt(r['attention'], '{}')} | "
                 f"{r['per_s']:,.0f} {r['unit']}/s | "
                 f"{r['step_ms']:.1f} | {_fmt(r.get('tflops'), '{:.3g}')} | {_fmt(r['mfu'], '{:.1%}')} | "
                 f"{_fmt(r['mfu_6n'], '{:.1%}')} | "
                 f"{_fmt(r['peak_gib'], '{:.2f}')} | {r['compiled_gib']:.2f} | {_fmt(r['data_wait_pct'], '{:.2f}%')} |")
  return '\n'.join(lines)


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--rows', default=','.join(ROWS),
                      help=f'Comma-separated, from: {", ".join(ROWS)}; references: {", ".join(REFERENCES)}.')
  parser.add_argument('--steps', type=int, default=20, help='Timed steps per row, after the warm-up.')
  parser.add_argument('--warmup', type=int, default=3)
  parser.add_argument('--attention', default=None, help="Sets model.attention ('auto', 'xla', 'cudnn', ...).")
  parser.add_argument('--smoke', action='store_true', help='Shrunk rows, in this process (CPU tests).')
  parser.add_argument('--logs', default=None, help="Writes each row's whole output to DIR/ROW.log.")
  parser.add_argument('--one_row', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.one_row:
    print(json.dumps(_measure(args.one_row, args.steps, args.warmup, args.attention, smoke=False)))
    return []
  names = args.rows.split(',')
  unknown = [n for n in names if n not in ROWS and n not in REFERENCES]
  if unknown:
    raise SystemExit(f'bench_gpu.py: unknown --rows {unknown}; choose from {list(ROWS) + list(REFERENCES)}.')
  results = []
  for name in names:
    results.append(_measure(name, args.steps, args.warmup, args.attention, smoke=True) if args.smoke
                   else _in_subprocess(name, args))
    print(table(results[-1:]).splitlines()[-1], flush=True)
  print(table(results))
  return results


if __name__ == '__main__':
  main()
