"""Faults users meet, through the real launcher: a bad --workdir or config file, a damaged newest checkpoint, a full disk.

Each ends in one line (`launch.py: error: ...`), the right exit code, no
traceback, and nothing lost. The --workdir and config-file checks run before jax
is imported, so those launches take about a second each.
"""

import errno
import logging as std_logging
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import pytest

from configs import tiny
from conftest import REPO, make_text_dir, read_metrics, run_launcher
from parallel import sharding
from trainer import data
from trainer.base.errors import UserError
from trainer.run import job as job_lib
from trainer.safety import checksums, disk
from trainer.training import checkpoint
from trainer.training import manifest as manifests

TINY = '--config=configs/tiny.py'


def _error_line(result: subprocess.CompletedProcess) -> str:
  lines = [l for l in result.stderr.splitlines() if l.startswith('launch.py: error:')]
  assert len(lines) == 1 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  return lines[0]


def test_a_url_workdir_is_refused_and_nothing_named_s3_is_created(tmp_path):
  result = subprocess.run([sys.executable, str(REPO / 'launch.py'), f'--config={REPO}/configs/tiny.py',
                           '--workdir=s3://bucket/run'],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert result.returncode == 2
  assert _error_line(result) == ('launch.py: error: --workdir=s3://bucket/run: s3:// paths are not supported; use a '
                                 'local folder or a Cloud Storage URL (gs://bucket/run).')
  assert not list(tmp_path.iterdir()) and not (REPO / 's3:').exists()


def test_a_workdir_that_is_a_file_is_refused(tmp_path):
  (tmp_path / 'notes.txt').write_text('x')
  result = run_launcher(TINY, f'--workdir={tmp_path}/notes.txt/run', timeout=600)
  assert result.returncode == 2
  assert f'--workdir={tmp_path}/notes.txt/run is inside {tmp_path}/notes.txt, which is a file' in _error_line(result)


def _read_only_dir(tmp_path: pathlib.Path):
  """A read-only folder: a read-only tmpfs as root (root ignores mode bits), else mode 0555."""
  target = tmp_path / 'ro'
  target.mkdir()
  if os.geteuid() != 0:
    target.chmod(0o555)
    return target, lambda: target.chmod(0o755)
  if subprocess.run(['mount', '-t', 'tmpfs', '-o', 'ro,size=1m', 'tmpfs', str(target)]).returncode != 0:
    pytest.skip('running as root without permission to mount a read-only tmpfs')
  return target, lambda: subprocess.run(['umount', str(target)], check=True)


def test_a_read_only_workdir_is_refused(tmp_path):
  target, undo = _read_only_dir(tmp_path)
  try:
    result = run_launcher(TINY, f'--workdir={target}/run', timeout=600)
  finally:
    undo()
  assert result.returncode == 2
  line = _error_line(result)
  assert f'--workdir={target}/run is not writable by this user (' in line and 'fix its permissions' in line


@pytest.mark.parametrize('entry, made_as', [('checkpoints', 'a file'), ('tensorboard', 'a file'),
                                            ('metrics.jsonl', 'a folder')])
def test_a_workdir_entry_of_the_wrong_kind_is_one_line_before_anything(tmp_path, entry, made_as):
  """Was NotADirectoryError at each of --max_restarts' attempts: now exit 2 before the supervisor or jax starts."""
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / entry).mkdir() if made_as == 'a folder' else (workdir / entry).write_text('notes')
  result = run_launcher(TINY, f'--workdir={workdir}', '--max_restarts=2', timeout=600)
  assert result.returncode == 2
  assert _error_line(result) == (f'launch.py: error: {workdir / entry} is {made_as}, but the run keeps '
                                 f'{"a file" if made_as == "a folder" else "a folder"} there; move it out of the '
                                 f'workdir (or choose another --workdir).')
  assert sorted(p.name for p in workdir.iterdir()) == [entry]  # Nothing written, no attempt recorded.


def test_a_workdir_under_a_folder_this_user_cannot_enter_is_one_line(tmp_path):
  """A real permission check: the check runs in a fork that, as root (whom mode bits do not stop), becomes `nobody`.

  In-process: launch.py turns the UserError into its one line and exit 2 as for every --workdir check above.
  """
  from trainer.safety import workdir as workdir_lib
  locked = tmp_path / 'locked'
  locked.mkdir(mode=0o700)
  if os.geteuid() != 0:
    locked.chmod(0o600)  # No x bit: this user may not enter it.
  tmp_path.chmod(0o755)  # `nobody` may reach tmp_path, not inside locked/ (root's, mode 0700).
  read, write = os.pipe()
  pid = os.fork()
  if pid == 0:  # The child: report the check's outcome through the pipe, never return into pytest.
    try:
      if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
      try:
        workdir_lib.check(f'{locked}/run')
        os.write(write, b'passed')
      except UserError as e:
        os.write(write, str(e).encode())
      except BaseException as e:  # pylint: disable=broad-except
        os.write(write, f'{type(e).__name__}: {e}'.encode())
    finally:
      os._exit(0)
  os.close(write)
  with os.fdopen(read) as pipe:
    said = pipe.read()
  os.waitpid(pid, 0)
  locked.chmod(0o700)
  assert said == (f'--workdir={locked}/run: this user cannot enter {locked} (permission denied); give it search '
                  f'permission (chmod +x) or choose another folder.')
  assert not (locked / 'run').exists()


@pytest.mark.parametrize('source, expected', [
    ('def get_config(:\n  pass\n', 'cfg.py, line 1: invalid syntax; fix the file.'),
    ('import no_such_module\n\ndef get_config():\n  return None\n',
     "cfg.py, line 1: ModuleNotFoundError: No module named 'no_such_module'; fix the file."),
    ('x = 1\n', 'cfg.py has no get_config() function; a config file defines get_config()'),
    ('from configs import tiny\n\ndef get_config():\n  c = tiny.get_config()\n  c.train.steps = 3\n',
     'cfg.py: get_config() returned None; it must return the ConfigDict it built'),
    ('from configs import tiny\n\ndef get_config():\n  c = tiny.get_config()\n  c.train.stepz = 3\n'
     '  c.model.d_modle = 8\n  return c\n',
     'cfg.py sets keys that no code reads: model.d_modle (did you mean model.d_model?); train.stepz (did you mean '
     'train.steps?). Every key is declared in configs/base.py.'),
])
def test_a_broken_config_file_is_named_with_its_line(tmp_path, source, expected):
  (tmp_path / 'cfg.py').write_text(source)
  result = run_launcher(f'--config={tmp_path}/cfg.py', f'--workdir={tmp_path}/run', timeout=600)
  assert result.returncode == 2
  assert _error_line(result).startswith(f'launch.py: error: --config file {tmp_path}/{expected}'), result.stderr


@pytest.fixture(scope='module')
def text_dir(tmp_path_factory):
  return make_text_dir(tmp_path_factory.mktemp('text'))


@pytest.fixture(scope='module')
def trained(tmp_path_factory, text_dir):
  """The tiny config to step 8 (checkpoints 4 and 8)."""
  workdir = tmp_path_factory.mktemp('trained')
  result = run_launcher(TINY, f'--workdir={workdir}', f'--config.data.text_dir={text_dir}')
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir


def test_a_damaged_newest_checkpoint_is_moved_aside_and_its_step_trained_again(trained, text_dir, tmp_path):
  """The issue's repro: rm -rf checkpoints/8/manifest and relaunch (was StepAlreadyExistsError at every relaunch).

  The relaunch keeps train.steps=8, so its step compiles from the shared cache.
  """
  workdir = tmp_path / 'run'
  shutil.copytree(trained, workdir)
  shutil.rmtree(workdir / 'checkpoints' / '8' / 'manifest')
  damaged_files = sorted(str(p.relative_to(workdir / 'checkpoints' / '8')) for p in
                         (workdir / 'checkpoints' / '8').rglob('*'))
  result = run_launcher(TINY, f'--workdir={workdir}', f'--config.data.text_dir={text_dir}')
  assert result.returncode == 0, result.stderr[-3000:]
  [moved] = (workdir / 'damaged_checkpoints').iterdir()
  assert moved.name.startswith('8-')
  assert sorted(str(p.relative_to(moved)) for p in moved.rglob('*')) == damaged_files  # Kept whole.
  assert f'{workdir}/checkpoints/8 is damaged (manifest/commit_success.txt is missing, and 1 more file(s) differ): moved to {moved}' in result.stderr
  assert 'Resuming from checkpoint at step 4' in result.stderr
  assert 'step 5: waiting for input' not in result.stderr  # The first window after a resume starts the threads.
  assert sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir()) == [4, 8]
  assert [r['step'] for r in read_metrics(workdir)][-3:] == [5, 6, 8]  # Steps 5..8 trained again.
  assert checkpoint.Checkpointer(str(workdir), tiny.get_config().ckpt).read_manifest(8)['config']['train']['steps'] == 8


def test_a_finished_run_whose_final_state_is_damaged_trains_its_last_steps_again(trained, text_dir, tmp_path):
  """The finished-run check happens before the compile; it must not call a run finished whose final state is gone."""
  workdir = tmp_path / 'run'
  shutil.copytree(trained, workdir)
  for leaf in (workdir / 'checkpoints' / '8' / 'state').rglob('*'):
    if leaf.is_file() and leaf.stat().st_size > 1000:
      leaf.write_bytes(leaf.read_bytes()[:100])
  result = run_launcher(TINY, f'--workdir={workdir}', f'--config.data.text_dir={text_dir}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'nothing to train' not in result.stderr
  assert 'Resuming from checkpoint at step 4' in result.stderr
  [moved] = (workdir / 'damaged_checkpoints').iterdir()
  assert moved.name.startswith('8-')
  assert [r['step'] for r in read_metrics(workdir)][-3:] == [5, 6, 8]  # Steps 5..8 trained again.


def _checkpointer(workdir, config):
  job = job_lib.build_job(config)
  return job, checkpoint.Checkpointer(str(workdir), config.ckpt)


@pytest.mark.parametrize('damage', ['empty folder', 'truncated state'])
def test_an_unrestorable_newest_step_is_moved_aside_so_it_can_be_saved_again(trained, text_dir, tmp_path, damage):
  shutil.copytree(trained / 'checkpoints', tmp_path / 'checkpoints')
  step_dir = tmp_path / 'checkpoints' / '8'
  if damage == 'empty folder':
    shutil.rmtree(step_dir)
    step_dir.mkdir()
  else:
    for leaf in (step_dir / 'state').rglob('*'):
      if leaf.is_file() and leaf.stat().st_size > 1000:
        leaf.write_bytes(leaf.read_bytes()[:100])
  config = tiny.get_config()
  config.data.text_dir = str(text_dir)
  job, ckpt = _checkpointer(tmp_path, config)
  manifest = manifests.run_manifest(config, job.abstract, job.mesh)
  iterator = data.train_iterator_for(config)
  steps = ckpt.resumable_steps(manifest)
  step, state = ckpt.restore_newest_intact(steps, sharding.with_shardings(job.abstract, job.shardings), iterator)
  assert step == 4 and int(state.step) == 4
  [moved] = (tmp_path / 'damaged_checkpoints').iterdir()
  assert moved.name.startswith('8-') and not step_dir.exists()
  ckpt.save(8, state, iterator, manifest, force=True)  # Was StepAlreadyExistsError.
  ckpt.close()
  assert sorted(int(p.name) for p in (tmp_path / 'checkpoints').iterdir()) == [4, 8]


def _flip(file: pathlib.Path, offset_fraction: float = 0.5, count: int = 64) -> None:
  """Inverts `count` bytes (fewer in a smaller file) from `offset_fraction` of the way into `file`: silent damage."""
  data = bytearray(file.read_bytes())
  start = min(int(len(data) * offset_fraction), max(len(data) - count, 0))
  data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
  file.write_bytes(bytes(data))


def _largest_state_data(step_dir: pathlib.Path) -> pathlib.Path:
  return max((p for p in (step_dir / 'state').rglob('*') if p.is_file() and '/d/' in str(p)),
             key=lambda p: p.stat().st_size)


def test_64_bytes_overwritten_in_the_newest_state_data_are_found_and_the_older_step_trains_on(trained, text_dir,
                                                                                               tmp_path):
  """Issue 54's repro: OCDBT data changed in place restored silently (a non-finite loss at every relaunch)."""
  workdir = tmp_path / 'run'
  shutil.copytree(trained, workdir)
  flipped = _largest_state_data(workdir / 'checkpoints' / '8')
  _flip(flipped, 0.3)
  result = run_launcher(TINY, f'--workdir={workdir}', f'--config.data.text_dir={text_dir}')
  assert result.returncode == 0, result.stderr[-3000:]
  name = flipped.relative_to(workdir / 'checkpoints' / '8').as_posix()
  assert (f'{workdir}/checkpoints/8 is damaged ({name} does not match the checksum recorded when it was saved)'
          in result.stderr), result.stderr[-3000:]
  [moved] = (workdir / 'damaged_checkpoints').iterdir()
  assert f'{workdir}/checkpoints/8 is damaged ({name} does not match the checksum recorded when it was saved): ' \
         f'moved to {moved}' in result.stderr
  assert 'Resuming from checkpoint at step 4' in result.stderr
  assert [r['step'] for r in read_metrics(workdir)][-3:] == [5, 6, 8]  # Steps 5..8 trained again, to the end.
  assert (workdir / 'checkpoints' / '8' / 'checksums.json').exists()  # The step saved again has its checksums.


@pytest.mark.parametrize('where', ['state/_METADATA', 'state/ocdbt.process_0/manifest.ocdbt', 'smallest state data',
                                   'data/metadata', 'manifest/metadata'])
def test_a_changed_file_anywhere_in_the_newest_checkpoint_sets_it_aside_for_the_older_one(trained, text_dir, tmp_path,
                                                                                         where, caplog):
  """The arrays' metadata and data, the data iterator's position, the run manifest: each checked before it is read."""
  shutil.copytree(trained / 'checkpoints', tmp_path / 'checkpoints')
  step_dir = tmp_path / 'checkpoints' / '8'
  if where == 'smallest state data':
    target = min((p for p in (step_dir / 'state').rglob('*') if p.is_file() and '/d/' in str(p)),
                 key=lambda p: p.stat().st_size)
  else:
    target = step_dir / where
  _flip(target, 0.6, count=4)
  config = tiny.get_config()
  config.data.text_dir = str(text_dir)
  job, ckpt = _checkpointer(tmp_path, config)
  manifest = manifests.run_manifest(config, job.abstract, job.mesh)
  iterator = data.train_iterator_for(config)
  with caplog.at_level(std_logging.WARNING):
    steps = ckpt.resumable_steps(manifest)
    step, state = ckpt.restore_newest_intact(steps, sharding.with_shardings(job.abstract, job.shardings), iterator)
  assert step == 4 and int(state.step) == 4
  name = target.relative_to(step_dir).as_posix()
  assert f'{step_dir} is damaged ({name} does not match the checksum recorded when it was saved)' in caplog.text
  [moved] = (tmp_path / 'damaged_checkpoints').iterdir()
  assert moved.name.startswith('8-') and not step_dir.exists()
  ckpt.save(8, state, iterator, manifest, force=True)  # The run goes on: step 8 saved again, with its checksums.
  ckpt.close()
  assert sorted(int(p.name) for p in (tmp_path / 'checkpoints').iterdir()) == [4, 8]
  checksums.verify(step_dir)


def test_a_checkpoint_saved_without_checksums_still_restores_and_a_sync_save_records_them(trained, text_dir,
                                                                                          tmp_path, caplog):
  shutil.copytree(trained / 'checkpoints', tmp_path / 'checkpoints')
  (tmp_path / 'checkpoints' / '8' / 'checksums.json').unlink()  # As an earlier version saved it.
  config = tiny.get_config()
  config.data.text_dir, config.ckpt.async_save = str(text_dir), False
  job, ckpt = _checkpointer(tmp_path, config)
  manifest = manifests.run_manifest(config, job.abstract, job.mesh)
  iterator = data.train_iterator_for(config)
  with caplog.at_level(std_logging.DEBUG):
    step, state = ckpt.restore_newest_intact(ckpt.resumable_steps(manifest),
                                             sharding.with_shardings(job.abstract, job.shardings), iterator)
  assert step == 8 and 'has no checksums.json (saved by an earlier version)' in caplog.text
  ckpt.save(12, state, iterator, manifest, force=True)
  ckpt.close()
  checksums.verify(tmp_path / 'checkpoints' / '12')
  _flip(tmp_path / 'checkpoints' / '12' / 'data' / 'metadata', count=1)
  with pytest.raises(checksums.Damaged, match='data/metadata does not match'):
    checksums.verify(tmp_path / 'checkpoints' / '12')


def test_a_changed_data_order_is_named_not_called_damage(trained, text_dir, tmp_path):
  shutil.copytree(trained / 'checkpoints', tmp_path / 'checkpoints')
  config = tiny.get_config()
  config.data.text_dir, config.data.seq_len = str(text_dir), 64
  job, ckpt = _checkpointer(tmp_path, config)
  with pytest.raises(UserError, match=r"data position belongs to a different data order .*seq_len: checkpoint 32 vs "
                                      r"now 64"):
    ckpt.restore_newest_intact([8, 4], sharding.with_shardings(job.abstract, job.shardings),
                               data.train_iterator_for(config))
  assert sorted(p.name for p in tmp_path.iterdir()) == ['checkpoints']  # Nothing moved aside.


def test_write_failures_are_recognised_through_wrappers_and_never_as_out_of_memory():
  from trainer.observe import profiling
  wrapped = RuntimeError('commit failed')
  wrapped.__cause__ = OSError(errno.ENOSPC, 'No space left on device')
  assert disk.write_failure(wrapped) == errno.ENOSPC
  assert disk.write_failure(ValueError('RESOURCE_EXHAUSTED: No space left on device')) == errno.ENOSPC
  assert disk.write_failure(ValueError('RESOURCE_EXHAUSTED: out of memory allocating 3 GiB')) is None
  assert not profiling.is_out_of_memory(ValueError('RESOURCE_EXHAUSTED: No space left on device'))
  assert profiling.is_out_of_memory(ValueError('RESOURCE_EXHAUSTED: out of memory allocating 3 GiB'))


def test_a_full_disk_stops_in_one_line_and_keeps_the_last_good_checkpoint(trained, text_dir, tmp_path):
  """A real full disk: a tmpfs that holds the step-4 checkpoint and half of the step-8 one (the last).

  Sized from the same run on a roomy disk: a fixed 1 MiB held both checkpoints in one fresh-clone CI run.
  """
  used = lambda root: sum(p.lstat().st_blocks * 512 for p in root.rglob('*') if p.is_file())
  checkpoint_bytes = used(trained / 'checkpoints' / '4')
  size_kib = (used(trained) - used(trained / 'checkpoints') + 3 * checkpoint_bytes // 2) // 1024
  target = tmp_path / 'tinyfs'
  target.mkdir()
  mount = ['mount', '-t', 'tmpfs', '-o', f'size={size_kib}k', 'tmpfs', str(target)]
  if os.geteuid() != 0 or subprocess.run(mount).returncode:
    pytest.skip('needs root and mount -t tmpfs for a real full disk')
  try:
    result = run_launcher(TINY, f'--workdir={target}/run', f'--config.data.text_dir={text_dir}')
    saved = sorted(p.name for p in (target / 'run' / 'checkpoints').iterdir())
    intact = checkpoint.Checkpointer(str(target / 'run'), tiny.get_config().ckpt, move_damaged=False)
    manifest_step = intact.read_manifest(4)['config']['train']['steps']
    intact.close()
  finally:
    subprocess.run(['umount', str(target)], check=True)
  assert result.returncode == 2, result.stderr[-3000:]
  line = _error_line(result)
  assert line.startswith(f'launch.py: error: could not save step 8 to {target}/run/checkpoints: no space left on the '
                         f'device; a checkpoint needs about 0.')
  assert 'The last good checkpoint, step 4, is intact' in line
  assert 'Out of memory' not in result.stderr and 'meta_path' not in result.stderr
  noise = [l for l in result.stderr.splitlines() if l.startswith(('E1', 'Traceback', 'RuntimeError'))]
  assert not noise, noise[:10]  # The one line is all a user reads; Orbax's errors are in WORKDIR/logs.
  assert saved[0] == '4' and all(s == '4' or 'tmp' in s for s in saved)
  assert manifest_step == 8  # Step 4 reads back.


def test_a_folder_of_binary_files_is_refused_as_text_and_a_few_are_named(tmp_path):
  from trainer.data import text
  config = tiny.get_config()
  config.data.text_dir, config.data.file_glob = str(tmp_path), '**/*'
  rng = __import__('numpy').random.default_rng(0)
  for i in range(4):
    (tmp_path / f'blob_{i}.bin').write_bytes(rng.integers(0, 256, 3000, dtype='uint8').tobytes())
  (tmp_path / 'notes.txt').write_text('plain text ' * 300)
  with pytest.raises(UserError, match=r"4 of the 5 files matching data.file_glob='\*\*/\*' are not text \(NUL or "
                                      r"control bytes: 'blob_0.bin', 'blob_1.bin', 'blob_2.bin' \.\.\.\)"):
    text.load_text_corpus(config.data)
  for i in range(1, 4):
    (tmp_path / f'blob_{i}.bin').unlink()
    (tmp_path / f'more_{i}.txt').write_text('more text ' * 300)
  with absl_warnings() as caught:
    corpus = text.load_text_corpus(config.data)
  assert corpus.num_train_files + corpus.num_eval_files == 5
  assert "1 of the 5 files are not text (NUL or control bytes: 'blob_0.bin')" in caught.text


class absl_warnings:
  """Collects absl's warnings (absl logs through the standard `absl` logger)."""

  def __enter__(self):
    import io
    self.stream = io.StringIO()
    self.handler = std_logging.StreamHandler(self.stream)
    std_logging.getLogger('absl').addHandler(self.handler)
    return self

  def __exit__(self, *exc):
    std_logging.getLogger('absl').removeHandler(self.handler)

  @property
  def text(self) -> str:
    return self.stream.getvalue()


def test_warmup_longer_than_the_run_is_named_with_both_keys():
  from trainer.training import validation
  config = tiny.get_config()
  config.train.warmup_steps = 30
  with absl_warnings() as caught:
    validation.validate_config(config)
  assert 'train.warmup_steps=30 is more than train.steps=8: warmup is cut to 8 steps' in caught.text
  config.train.warmup_steps = 8
  with absl_warnings() as caught:
    validation.validate_config(config)
  assert 'warmup' not in caught.text
