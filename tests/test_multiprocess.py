"""Real multi-process runs: 2 processes x 4 CPU devices joined over 127.0.0.1 with gloo, against 1 process x 8.

Every subprocess runs in its own session under a timeout, and is killed with its
whole group if it overruns, so a hung collective fails the test instead of the suite.
"""

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, free_port, read_metrics, run_launcher, xla_flags
from parallel import distributed
from trainer.base.errors import UserError

TINY = ('--config=configs/tiny.py', '--config.log.every_steps=1')
ACCEPT = '--config.train.accept_schedule_change=True'  # Runs extended on resume move their cosine schedule.
RUN_TIMEOUT_S = 600  # A hang guard only.


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
  """Runs `cmd` in its own session; past `timeout`, stops its whole process group and fails the test."""
  proc = subprocess.Popen(cmd, cwd=REPO, env=env or dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGTERM)  # launch_local.py stops its own processes on SIGTERM.
    try:
      out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)
      out, err = proc.communicate()
    pytest.fail(f'{shlex.join(cmd)} ran past {timeout}s:\n{err[-4000:]}')
  return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _two_processes(*args: str) -> subprocess.CompletedProcess:
  cmd = [sys.executable, str(REPO / 'scripts/launch_local.py'), '--num_processes=2', '--devices_per_process=4',
         f'--timeout_s={RUN_TIMEOUT_S - 30}', *TINY, *args]
  result = _run(cmd, RUN_TIMEOUT_S)
  assert result.returncode == 0, result.stderr[-4000:]
  return result



@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """6 steps, then a relaunch to 10, each as 2 processes x 4 devices and as 1 process x 8 devices."""
  two, one = tmp_path_factory.mktemp('two_processes'), tmp_path_factory.mktemp('one_process')
  first = _two_processes(f'--workdir={two}', '--config.train.steps=6')
  first_records = read_metrics(two)
  for steps in (6, 10):
    reference = run_launcher(*TINY, f'--workdir={one}', f'--config.train.steps={steps}', ACCEPT,
                             timeout=RUN_TIMEOUT_S)
    assert reference.returncode == 0, reference.stderr[-4000:]
  second = _two_processes(f'--workdir={two}', '--config.train.steps=10', ACCEPT)
  return {'two': two, 'one': one, 'first': first, 'second': second, 'first_records': first_records}


def _lines_of(result: subprocess.CompletedProcess, process: int) -> list[str]:
  return [line for line in result.stderr.splitlines() if line.startswith(f'[{process}] ')]


def test_two_processes_train_exactly_like_one(runs):
  for process in (0, 1):
    assert any(f'Joined 2 processes as process {process}' in l for l in _lines_of(runs['first'], process))
  assert "Mesh {'data': 8, 'fsdp': 1, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1} over 8 devices (2 processes)" in runs['first'].stderr
  two, one = read_metrics(runs['two']), read_metrics(runs['one'])
  assert [r['step'] for r in two] == [r['step'] for r in one] == list(range(1, 11))
  for a, b in zip(two, one):
    for key in ('loss', 'eval_loss'):
      if key in b:
        assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (a['step'], key, a[key], b[key])
  assert two[-1]['loss'] < min(two[0]['loss'], math.log(256)) - 0.3  # Learns (as in tests/test_launch.py).


def test_relaunch_resumes_every_process_from_the_shared_checkpoint(runs):
  assert [r['step'] for r in runs['first_records']] == list(range(1, 7))
  for process in (0, 1):
    assert any('Resuming from checkpoint at step 6' in l for l in _lines_of(runs['second'], process))
  step_6 = runs['two'] / 'checkpoints' / '6'
  # Each process saved its own array shards; the data position is one global count, the same for every process.
  assert {p.name for p in (step_6 / 'state').glob('ocdbt.process_*')} == {'ocdbt.process_0', 'ocdbt.process_1'}
  assert json.loads((step_6 / 'data' / 'metadata').read_text())['examples_consumed'] == 6 * 8


def test_a_run_saved_by_two_processes_resumes_exactly_in_one(runs, tmp_path):
  """2 -> 1 processes: the global data position continues with the same global batches, so the losses match."""
  workdir = tmp_path / 'copy'
  shutil.copytree(runs['two'], workdir)
  for later in [p for p in (workdir / 'checkpoints').iterdir() if p.name.isdigit() and int(p.name) > 6]:
    shutil.rmtree(later)  # Resume the 2-process checkpoint of step 6 in one process, to step 10.
  result = run_launcher(*TINY, f'--workdir={workdir}', '--config.train.steps=10', ACCEPT, timeout=RUN_TIMEOUT_S)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Resuming from checkpoint at step 6' in result.stderr and '(1 processes)' in result.stderr
  resumed = {r['step']: r['loss'] for r in read_metrics(workdir)[-4:]}
  reference = {r['step']: r['loss'] for r in read_metrics(runs['one']) if r['step'] > 6}  # 1 process throughout.
  assert list(resumed) == list(reference) == [7, 8, 9, 10]
  for step, loss in reference.items():
    assert abs(resumed[step] - loss) <= 1e-5 * abs(loss), (step, resumed, reference)


def test_only_process_0_writes_metrics_and_config(runs):
  for result in (runs['first'], runs['second']):
    assert not [l for l in _lines_of(result, 1) if 'metrics.py' in l]
    assert [l for l in _lines_of(result, 0) if 'metrics.py' in l]
  # One TensorBoard event file per launch, both from process 0.
  assert len(list((runs['two'] / 'tensorboard').glob('events.out.tfevents.*'))) == 2
  assert json.loads((runs['two'] / 'config.json').read_text())['train']['steps'] == 10


def test_gloo_connection_lines_are_dropped_unless_a_peer_is_missing(runs):
  import importlib.util
  import io
  spec = importlib.util.spec_from_file_location('launch_local', REPO / 'scripts/launch_local.py')
  launch_local = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(launch_local)
  for result in (runs['first'], runs['second']):
    assert '[Gloo]' not in result.stderr
  short = '[Gloo] Rank 3 is connected to 6 peer ranks. Expected number of connected peer ranks is : 7\n'
  sink = io.StringIO()
  launch_local._relay(iter(['[Gloo] Rank 1 is connected to 7 peer ranks. Expected number of connected peer ranks is '
                            ': 7\n', short, 'step 1\n']), sink, '[0] ')
  assert sink.getvalue() == f'[0] {short}[0] step 1\n'


def test_a_process_that_never_joins_fails_every_waiting_process_in_one_line(tmp_path):
  port = free_port()
  env = {**os.environ, 'XLA_FLAGS': xla_flags(4), 'JAX_PLATFORMS': 'cpu'}
  start = time.monotonic()
  result = _run([sys.executable, str(REPO / 'launch.py'), TINY[0], f'--workdir={tmp_path}',
                 f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2', '--process_id=0',
                 '--distributed_timeout_s=10'], timeout=600, env=env)
  elapsed = time.monotonic() - start
  assert result.returncode == 2, result.stderr[-3000:]
  assert 10 <= elapsed  # Waited out the timeout, then failed (the run's timeout=600 is the hang guard).
  lines = [l for l in result.stderr.splitlines() if 'error' in l.lower()]
  assert lines == [
      f'launch.py: error: process 1 of 2 did not join within --distributed_timeout_s=10 (1 of 2 joined at the '
      f'coordinator 127.0.0.1:{port}); check that every process was started with --num_processes=2, '
      f'--coordinator_address=127.0.0.1:{port} and its own --process_id, and that 127.0.0.1:{port} is reachable '
      f'from its host.'], result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  assert not (tmp_path / 'checkpoints').exists()


def test_a_detected_slurm_launch_with_a_missing_task_fails_in_one_line(tmp_path):
  port = free_port()
  env = {**os.environ, 'XLA_FLAGS': xla_flags(4), 'JAX_PLATFORMS': 'cpu',
         'SLURM_JOB_ID': '77', 'SLURM_STEP_NODELIST': 'localhost', 'SLURM_NTASKS': '2', 'SLURM_PROCID': '0',
         'SLURM_LOCALID': '0', 'JAX_COORDINATOR_PORT': str(port)}
  start = time.monotonic()
  result = _run([sys.executable, str(REPO / 'launch.py'), TINY[0], f'--workdir={tmp_path}',
                 '--distributed_timeout_s=5'], timeout=600, env=env)
  elapsed = time.monotonic() - start
  assert result.returncode == 2, result.stderr[-3000:]
  assert 5 <= elapsed
  lines = [l for l in result.stderr.splitlines() if 'error' in l.lower()]
  assert len(lines) == 1 and lines[0].startswith(
      'launch.py: error: not every process of this SLURM launch joined within --distributed_timeout_s=5 '
      '(task 0 of 2 of SLURM job 77 waited for the others)'), result.stderr[-3000:]


def _check_in_concurrently(*processes: tuple[int, int], port: int, timeout_s: int = 2) -> list[str]:
  """Runs distributed.initialize for each (process_id, num_processes) in a thread; returns each one's error."""
  errors = [''] * len(processes)

  def one(i, process_id, num_processes):
    try:
      distributed.initialize(f'127.0.0.1:{port}', num_processes, process_id, timeout_s)
      errors[i] = 'joined'  # Never expected: some process is always missing or misconfigured below.
    except UserError as e:
      errors[i] = str(e)

  threads = [threading.Thread(target=one, args=(i, *p)) for i, p in enumerate(processes)]
  for t in threads:
    t.start()
    time.sleep(0.1)  # Process 0 listens first, as it usually would.
  for t in threads:
    t.join(timeout=timeout_s + 15)
  return errors


def test_every_waiting_process_names_the_missing_one():
  port = free_port()
  errors = _check_in_concurrently((0, 3), (1, 3), port=port)
  for error in errors:
    assert error.startswith(f'process 2 of 3 did not join within --distributed_timeout_s=2 (2 of 3 joined at the '
                            f'coordinator 127.0.0.1:{port})'), error


def test_a_process_without_its_coordinator_says_so():
  port = free_port()
  [error] = _check_in_concurrently((1, 2), port=port, timeout_s=1)
  assert error.startswith(f'process 0 of 2 (the coordinator at 127.0.0.1:{port}) did not join within '
                          f'--distributed_timeout_s=1: process 1 could not reach it'), error


@pytest.mark.parametrize('processes, expected', [
    (((0, 2), (1, 3)), 'process 1 (from 127.0.0.1) was started with --num_processes=3, process 0 with '
                       '--num_processes=2'),
    (((0, 3), (1, 3), (1, 3)), 'two processes were started with --process_id=1'),
])
def test_inconsistent_processes_fail_all_of_them(processes, expected):
  errors = _check_in_concurrently(*processes, port=free_port(), timeout_s=10)
  for error in errors:
    assert expected in error, error


@pytest.mark.parametrize('flags, expected', [
    (('localhost', 2, 0), '--coordinator_address=\'localhost\' is not HOST:PORT'),
    (('127.0.0.1:99999', 2, 0), '--coordinator_address=\'127.0.0.1:99999\' is not HOST:PORT'),
    (('127.0.0.1:1234', 0, 0), '--num_processes=0 must be an integer >= 1'),
    (('127.0.0.1:1234', 2, 2), '--process_id=2 must be an integer from 0 to --num_processes-1 = 1'),
    (('127.0.0.1:1234', 2, -1), '--process_id=-1 must be'),
    (('127.0.0.1:1234', None, 1), '--num_processes missing'),
    ((None, 2, None), '--coordinator_address and --process_id missing'),
])
def test_bad_flags_name_the_flag(flags, expected):
  with pytest.raises(UserError, match=re.escape(expected)):
    distributed.initialize(*flags)


def test_bad_timeout_names_the_flag():
  with pytest.raises(UserError, match='--distributed_timeout_s=0 must be'):
    distributed.initialize('127.0.0.1:1234', 2, 0, timeout_s=0)


@pytest.mark.parametrize('env, expected', [
    ({'SLURM_JOB_ID': '7', 'SLURM_STEP_NODELIST': 'node[1-2]', 'SLURM_NTASKS': '2', 'SLURM_PROCID': '1',
      'SLURM_LOCALID': '0'}, 'SLURM'),
    ({'SLURM_JOB_ID': '7', 'SLURM_STEP_NODELIST': 'node1', 'SLURM_NTASKS': '1', 'SLURM_PROCID': '0',
      'SLURM_LOCALID': '0'}, None),
    ({'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '4'}, None),  # sbatch's shell, outside `srun`.
    ({'TPU_WORKER_HOSTNAMES': 'w0,w1,w2,w3', 'TPU_WORKER_ID': '2'}, 'TPU pod'),
    ({'TPU_WORKER_HOSTNAMES': 'w0'}, None),
    ({'MEGASCALE_NUM_SLICES': '2'}, 'TPU pod'),
    ({}, None),
])
def test_cluster_detection_keys_on_multi_process_launches_only(monkeypatch, env, expected):
  for key in list(os.environ):
    if key.startswith(('SLURM_', 'TPU_', 'MEGASCALE_')):
      monkeypatch.delenv(key)
  for key, value in env.items():
    monkeypatch.setenv(key, value)
  assert distributed.detected_cluster() == expected


def test_a_cloud_tpu_vm_is_left_to_jaxs_detection(monkeypatch):
  from jax._src import cloud_tpu_init  # What jax found at import: TPU chips and libtpu on this host.
  monkeypatch.setattr(cloud_tpu_init, 'running_in_cloud_tpu_vm', True)
  assert distributed.detected_cluster() == 'Cloud TPU VM'


def test_launch_local_dry_run_prints_each_command_and_its_environment(tmp_path):
  result = _run([sys.executable, str(REPO / 'scripts/launch_local.py'), '--dry_run', '--num_processes=3',
                 '--devices_per_process=2', TINY[0], f'--workdir={tmp_path}', '--config.train.steps=3'], timeout=600)
  assert result.returncode == 0, result.stderr
  lines = result.stdout.splitlines()
  assert lines[0::2] == ['# process 0', '# process 1', '# process 2']
  ports = set()
  for process, line in enumerate(lines[1::2]):
    words = shlex.split(line)
    env = dict(w.split('=', 1) for w in words[:3])
    # conftest's 8-device flag is replaced, not added to; its other flag passes through.
    assert env == {'JAX_PLATFORMS': 'cpu', 'XLA_FLAGS': xla_flags(2), 'PYTHONUNBUFFERED': '1'}
    assert words[3:5] == [sys.executable, str(REPO / 'launch.py')]
    assert words[5:8] == [TINY[0], f'--workdir={tmp_path}', '--config.train.steps=3']
    assert words[8].startswith('--coordinator_address=127.0.0.1:')
    assert words[9:] == ['--num_processes=3', f'--process_id={process}']
    ports.add(words[8])
  assert len(ports) == 1
  assert not any(tmp_path.iterdir())  # Ran nothing.
