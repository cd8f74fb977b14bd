"""One GPU acceptance command (issue 38): crashes over fresh launches of the default job, then the GPU rows.

  python benchmarks/bench_gpu_acceptance.py --out=$OUT [--launches=5] [--budget_s=480] [--rows=moe_b8,gpt2_b64]
  python benchmarks/bench_gpu_acceptance.py --out=/tmp/acc --smoke      # CPU: configs/tiny.py, shrunk rows, seconds
  python benchmarks/bench_gpu_acceptance.py --out=$OUT --launches=0 --quantization_steps=200   # issue 56's row

1. `launch.py --config=configs/default.py --max_restarts=0` `--launches` times, each a fresh process and workdir
   (under the system's temporary folder, removed after): exit codes, the last stderr line of each failure, and
   tokens/s from its metrics. A launch counts as a crash when it exits non-zero or by a signal (the measurement
   of 2026-11-26 saw 2 capture failures and 1 segmentation fault in 4).
2. benchmarks/bench_gpu.py's rows, each in its own process: gpt2_b64, llama_b16_auto and their hand-written minimal
   loops (gpt2_b64_minimal, llama_b16_auto_minimal), gpt2_b32_packed, moe_b4, moe_b8, moe_b8_capacity. A row that
   fails (out of memory) is recorded with its last line and the others go on; rows left when the time budget is
   spent are recorded as not run. --rows picks and orders them (--launches=0 skips part 1), so a short lease
   measures what matters first. moe_b8_profile (benchmarks/moe_profile.py) traces moe_b8 for a few steps and writes
   where its time goes, by kernel category, to OUT/moe_b8_profile.md and .json.

3. With --quantization_steps=N: llama_1b at batch 16 trained N steps on text through launch.py in bf16 and then
   with train.quantization='fp8' (issue 56): tokens/s, MFU, loss and eval loss of each, side by side.

Every child gets the XLA flags launch.py sets on NVIDIA GPUs (trainer/run/gpu_env.py): the rows build the Job in
benchmarks/bench_gpu.py, not through launch.py, and must measure the same flags.

Writes OUT/acceptance.json (everything above, with the versions of python, jax, jaxlib and flax and the device)
and OUT/acceptance.log (each child's whole output, in order). Runs on the device image's stack (jax 0.11.2 with
the CUDA 13 plugin; shared/GPU.md) as on the pinned one: it only starts `sys.executable` on this repository.
"""

import argparse
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

from trainer.run import gpu_env  # noqa: E402  (imports no jax)
ROWS = ('gpt2_b64', 'gpt2_b64_minimal', 'llama_b16_auto', 'llama_b16_auto_minimal', 'gpt2_b32_packed', 'moe_b4',
        'moe_b8', 'moe_b8_capacity', 'moe_b8_profile')
PROFILE_ROW = 'moe_b8_profile'  # benchmarks/moe_profile.py: the traced step's kernels by category, a table in OUT.
SMOKE_ROWS = ('gpt2_b32', 'gpt2_b32_minimal', 'moe_b8')


class Log:
  """OUT/acceptance.log: every child's output under a header line naming the command."""

  def __init__(self, path: pathlib.Path):
    self.path = path
    path.write_text('')

  def add(self, title: str, text: str) -> None:
    with self.path.open('a') as f:
      f.write(f'===== {title}\n{text.rstrip()}\n')


def _run(command: list[str], timeout_s: float, env: dict | None = None) -> subprocess.CompletedProcess:
  try:
    return subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=max(1.0, timeout_s),
                          env={**os.environ, **(env or {})})
  except subprocess.TimeoutExpired as e:
    out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or '')
    err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or '')
    return subprocess.CompletedProcess(command, 124, out, err + f'\ntimed out after {timeout_s:.0f} s')


def _last_line(text: str) -> str:
  lines = [line for line in text.strip().splitlines() if line.strip()]
  return lines[-1][:300] if lines else ''


def _launch(config: str, overrides: list[str], timeout_s: float, env: dict | None = None):
  """One fresh launch.py in a temporary workdir, removed after (a llama_1b checkpoint is 11-17 GB): (its completed
  process, its metrics.jsonl records, its seconds)."""
  workdir = tempfile.mkdtemp(prefix='acceptance_launch_')
  try:
    started = time.perf_counter()
    done = _run([sys.executable, str(REPO / 'launch.py'), f'--config={config}', f'--workdir={workdir}',
                 '--max_restarts=0', *overrides], timeout_s, env)
    metrics = pathlib.Path(workdir) / 'metrics.jsonl'
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  return done, records, round(time.perf_counter() - started, 1)


def launches(count: int, config: str, overrides: list[str], log: Log, deadline: float,
             env: dict | None = None) -> dict:
  """`count` fresh launches of `config`; their exit codes, crashes and tokens/s."""
  runs = []
  for i in range(count):
    done, records, seconds = _launch(config, overrides, deadline - time.monotonic(), env)
    rates = [r['tokens_per_s'] for r in records if r.get('tokens_per_s')]
    log.add(f'launch {i + 1}/{count}: {config} (exit {done.returncode})', done.stdout + done.stderr)
    runs.append({'exit_code': done.returncode, 'seconds': seconds,
                 'tokens_per_s': rates[-1] if rates else None,
                 'failure': _last_line(done.stderr) if done.returncode else None})
  crashes = sum(1 for r in runs if r['exit_code'] != 0)
  return {'config': config, 'launches': runs, 'crashes': crashes, 'passed': count - crashes}


def rows(names: tuple[str, ...], log: Log, deadline: float, smoke: bool, steps: int, warmup: int,
         out: pathlib.Path) -> list[dict]:
  """benchmarks/bench_gpu.py's rows, each in its own process (its peak memory its own; a failure ends only it)."""
  results = []
  for name in names:
    left = deadline - time.monotonic()
    if left < 20:
      results.append({'row': name, 'error': 'not run: the time budget was spent'})
      continue
    command = [sys.executable, str(REPO / 'benchmarks' / 'bench_gpu.py'), f'--steps={steps}', f'--warmup={warmup}']
    command += ['--smoke', f'--rows={name}'] if smoke else ['--one_row', name]
    if name == PROFILE_ROW:  # A few traced steps are enough: the table is per step.
      command = [sys.executable, str(REPO / 'benchmarks' / 'moe_profile.py'), f'--out={out}',
                 f'--steps={min(steps, 3)}', f'--warmup={warmup}'] + (['--smoke'] if smoke else [])
    done = _run(command, left)
    log.add(f'row {name} (exit {done.returncode})', done.stdout + done.stderr)
    last = (done.stdout.strip().splitlines() or [''])[-1]  # Whole: a row's JSON is longer than _last_line keeps.
    if done.returncode == 0 and (name == PROFILE_ROW or not smoke) and last.startswith('{'):
      results.append(json.loads(last))
    elif done.returncode == 0 and smoke:
      results.append({'row': name, 'table_line': last})
    else:
      results.append({'row': name, 'error': _last_line(done.stderr) or f'exit {done.returncode}'})
  return results


QUANTIZATION_PRECISIONS = (None, 'fp8')  # bf16 matmuls, then fp8 (issue 56), side by side in one run.


def quantization_rows(steps: int, log: Log, deadline: float, smoke: bool) -> list[dict]:
  """llama_1b at batch 16 trained `steps` steps on text through launch.py, once per precision of the layer matmuls.

  Fresh launches on the default job's byte-level text from the same seed, so the losses compare: tokens/s is the
  median of the logged windows after the first (which holds the compile), the loss that of the last window, the eval
  loss at the last step. remat_policy 'auto' chooses each precision's policy as a user's launch does.
  """
  config = 'configs/tiny.py' if smoke else 'configs/llama_1b.py'
  every = max(1, steps // 8)
  common = [f'--config.train.steps={steps}', '--config.data.source=text', f'--config.log.every_steps={every}',
            f'--config.train.eval_every_steps={steps}', '--config.train.eval_batches=4',
            f'--config.train.warmup_steps={max(1, steps // 10)}', '--config.ckpt.every_steps=1000000']
  common += [] if smoke else ['--config.train.batch_size=16']
  results = []
  for precision in QUANTIZATION_PRECISIONS:
    name = f"{'llama_b16' if not smoke else 'tiny'}_{precision or 'bf16'}"
    left = deadline - time.monotonic()
    if left < 30:
      results.append({'row': name, 'error': 'not run: the time budget was spent'})
      continue
    done, records, seconds = _launch(
        config, [*common, *([f'--config.train.quantization={precision}'] if precision else [])], left)
    log.add(f'quantization {name} (exit {done.returncode})', done.stdout + done.stderr)
    windows = [r for r in records if 'tokens_per_s' in r][1:]
    evals = [r['eval_loss'] for r in records if 'eval_loss' in r]
    row = {'row': name, 'quantization': precision, 'exit_code': done.returncode,
           'seconds': seconds,
           'tokens_per_s': sorted(r['tokens_per_s'] for r in windows)[len(windows) // 2] if windows else None,
           'mfu': windows[-1].get('mfu') if windows else None,
           'loss': windows[-1]['loss'] if windows else None, 'eval_loss': evals[-1] if evals else None,
           'steps': records[-1]['step'] if records else 0}
    if done.returncode:
      row['error'] = _last_line(done.stderr) or f'exit {done.returncode}'
    results.append(row)
  return results


def versions() -> dict:
  found = {'python': platform.python_version()}
  for module in ('jax', 'jaxlib', 'flax', 'optax', 'orbax.checkpoint'):
    try:
      found[module] = __import__(module, fromlist=['__version__']).__version__
    except Exception:  # pylint: disable=broad-except  (a missing package is reported, not fatal)
      found[module] = None
  return found


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', default=os.environ.get('OUT'), help='Folder for acceptance.json and .log ($OUT).')
  parser.add_argument('--launches', type=int, default=5)
  parser.add_argument('--budget_s', type=float, default=480.0, help='Wall-clock budget for everything.')
  parser.add_argument('--steps', type=int, default=10, help='Timed steps per row.')
  parser.add_argument('--warmup', type=int, default=2)
  parser.add_argument('--smoke', action='store_true', help='CPU: configs/tiny.py launches and shrunk rows.')
  parser.add_argument('--rows', default=None, help=f'Comma-separated, in order (default: {",".join(ROWS)}).')
  parser.add_argument('--quantization_steps', type=int, default=0,
                      help='llama_1b b16 trained this many steps in bf16 and in fp8, side by side (0: skipped).')
  args = parser.parse_args(argv)
  if not args.out:
    raise SystemExit('bench_gpu_acceptance.py: give --out=DIR (or set $OUT) for acceptance.json and .log.')
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  start = time.monotonic()
  deadline = start + args.budget_s
  log = Log(out / 'acceptance.log')
  gpu_flags = gpu_env.apply()  # Children inherit os.environ; a no-op without NVIDIA GPUs.
  config, overrides = (('configs/tiny.py', ['--config.train.steps=4']) if args.smoke
                       else ('configs/default.py', ['--config.ckpt.every_steps=1000000']))
  names = tuple(args.rows.split(',')) if args.rows else SMOKE_ROWS if args.smoke else ROWS
  result = {'versions': versions(), 'smoke': args.smoke,
            'xla_flags': os.environ.get('XLA_FLAGS', '') if gpu_flags else None,
            'default_job': launches(args.launches, config, overrides, log, deadline),
            'quantization': (quantization_rows(args.quantization_steps, log, deadline, args.smoke)
                             if args.quantization_steps else []),
            'rows': rows(names, log, deadline, args.smoke, args.steps, args.warmup, out)}
  import jax  # After the children ran: this process holds no GPU memory while they measure.
  result['device'] = jax.devices()[0].device_kind
  result['seconds'] = round(time.monotonic() - start, 1)
  (out / 'acceptance.json').write_text(json.dumps(result, indent=2))
  jobs = result['default_job']
  print(f"default job: {jobs['crashes']} of {len(jobs['launches'])} launches crashed; "
        f"rows: {sum('error' not in r for r in result['rows'])} of {len(result['rows'])} ran; "
        f"{result['seconds']:.0f} s; {out / 'acceptance.json'}")
  return result


if __name__ == '__main__':
  main()
