"""Links and special files planted in a shared folder (trainer/base/confined.py): nothing is written through them, and
nothing outside a model folder is read from it.

A real tiny run lists the files a launch writes into its workdir; each is then planted as a link to a victim file in a
fresh workdir and the launch relaunched: one line, exit 2, the victim untouched. The writers that keep a file open or
rewrite it are also run in-process against a link, as they would meet one planted after the launch's first check.
The files an export reads or copies from a model folder are each replaced by a link to a private file outside it.
"""

import json
import os
import pathlib
import re
import shutil
import signal
import stat

import jax
import numpy as np
import pytest

from configs import base
from conftest import run_launcher
from trainer.base import confined, storage
from trainer.base.errors import UserError
from trainer.hf import load as hf_load
from trainer.hf import safetensors_files, save, serving
from trainer.data import hf_tokenizer
from trainer.safety import lock, workdir as workdir_lib

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'hf'
VICTIM_TEXT = 'the victim file: never truncated, overwritten or appended to\n'
PRIVATE_TEXT = 'PRIVATE KEY, never to be read into an export\n'


def _victim(tmp_path: pathlib.Path) -> pathlib.Path:
  victim = tmp_path / 'victim.txt'
  victim.write_text(VICTIM_TEXT)
  return victim


@pytest.fixture(scope='module')
def written(tmp_path_factory) -> list[str]:
  """The files one real tiny run wrote into its workdir, relative to it (checkpoints apart: Orbax writes them).
  Supervised, as a user's launch is by default: the supervisor writes attempts.jsonl."""
  workdir = tmp_path_factory.mktemp('tiny') / 'run'
  result = run_launcher('--config=configs/tiny.py', f'--workdir={workdir}', '--max_restarts=1', timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return sorted(p.relative_to(workdir).as_posix() for p in workdir.rglob('*')
                if p.is_file() and p.relative_to(workdir).parts[0] != 'checkpoints')


def test_every_file_a_run_writes_is_refused_as_a_planted_link_and_its_target_untouched(written, tmp_path):
  by_name = [name for name in written if not name.startswith('tensorboard/')]
  assert {'launch.lock', 'config.json', 'sharding.txt', 'metrics.jsonl', 'goodput.jsonl',
          'attempts.jsonl'} <= set(by_name)
  assert set(by_name) <= set(workdir_lib.WRITTEN), 'a new file a run writes: add it to workdir.WRITTEN'
  victim = _victim(tmp_path)
  for name in by_name:
    workdir = tmp_path / f'run_{name.replace("/", "_")}'
    (workdir / name).parent.mkdir(parents=True)
    (workdir / name).symlink_to(victim)
    result = run_launcher('--config=configs/tiny.py', f'--workdir={workdir}', '--max_restarts=1', timeout=600)
    lines = [l for l in result.stderr.splitlines() if l.startswith('launch.py: error:')]
    assert result.returncode == 2 and len(lines) == 1 and 'Traceback' not in result.stderr, (name, result.stderr)
    assert lines[0].startswith(f'launch.py: error: {workdir / name} is a symbolic link (to {victim})'), lines[0]
    assert f"rm '{workdir / name}'" in lines[0]
    assert victim.read_text() == VICTIM_TEXT, name
    assert [p.name for p in workdir.iterdir()] == [name.split('/')[0]], name  # Nothing else written.


def test_a_link_in_place_of_a_folder_the_launch_makes_for_predictable_names_is_refused(tmp_path):
  """evals/ -> a victim's folder would have evals/step_N.json replace the victim's file of that name."""
  elsewhere = tmp_path / 'elsewhere'
  elsewhere.mkdir()
  for name in workdir_lib.OWN_FOLDERS:
    workdir = tmp_path / f'run_{name}'
    workdir.mkdir()
    (workdir / name).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UserError, match=rf'^{workdir / name} is a symbolic link \(to {elsewhere}\), not a folder'):
      workdir_lib.check(str(workdir))  # What launch.py calls first, before the lock or the supervisor.
  assert not list(elsewhere.iterdir())


def test_tensorboards_file_name_cannot_be_guessed_to_plant_a_link(written):
  [events] = [name for name in written if name.startswith('tensorboard/')]
  assert re.fullmatch(r'tensorboard/events\.out\.tfevents\.\d+\.[^/]+\.[0-9a-f]{16}', events), events


def test_a_fifo_in_place_of_the_lock_is_refused_without_waiting_for_a_reader(tmp_path):
  os.mkfifo(tmp_path / 'launch.lock')

  def waited(*_):
    raise TimeoutError('blocked on the fifo')

  before = signal.signal(signal.SIGALRM, waited)
  signal.alarm(20)  # Read through, the fifo blocks for good: fail instead.
  try:
    with pytest.raises(confined.Planted, match=rf'^{tmp_path}/launch.lock is a fifo, not a regular file'):
      lock.acquire(tmp_path)
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


def test_each_writer_refuses_a_link_planted_after_the_launchs_check(tmp_path):
  """The writers themselves, past workdir.check: the lock, the appended logs, attempts.jsonl, the library log."""
  from trainer.observe import console
  from trainer.supervision import supervisor
  victim = _victim(tmp_path)
  for name in ('launch.lock', 'metrics.jsonl', 'attempts.jsonl', 'config.json'):
    (tmp_path / name).symlink_to(victim)
  with pytest.raises(confined.Planted, match='launch.lock is a symbolic link'):
    lock.acquire(tmp_path)
  with pytest.raises(confined.Planted, match='metrics.jsonl is a symbolic link'):
    storage.AppendLog(tmp_path / 'metrics.jsonl')
  with pytest.raises(confined.Planted, match='config.json is a symbolic link'):
    confined.write_text(tmp_path / 'config.json', '{}')
  supervisor.Supervisor(['x'], str(tmp_path), 1, 0.0, writes_record=True)._append({'attempt': 1})  # A warning line.
  (tmp_path / 'logs').mkdir()
  (tmp_path / 'logs' / 'library_errors.log').symlink_to(victim)
  assert not console._Sink(tmp_path / 'logs' / 'library_errors.log').write('a library error\n')  # Dropped.
  assert victim.read_text() == VICTIM_TEXT


def test_the_held_locks_heartbeat_touches_its_own_file_not_a_link_put_at_its_name(tmp_path, monkeypatch):
  import time
  victim = _victim(tmp_path)
  os.utime(victim, (1e9, 1e9))
  monkeypatch.setattr(lock, 'HEARTBEAT_S', 0.05)
  workdir = tmp_path / 'run'
  workdir.mkdir()
  held = lock.acquire(workdir)
  (workdir / 'launch.lock').unlink()
  (workdir / 'launch.lock').symlink_to(victim)
  time.sleep(0.3)  # Several heartbeats.
  held.release()
  assert victim.stat().st_mtime == 1e9 and victim.read_text() == VICTIM_TEXT


def test_a_whole_file_write_replaces_a_link_planted_between_check_and_write(tmp_path, monkeypatch):
  victim = _victim(tmp_path)
  (tmp_path / 'sharding.txt').symlink_to(victim)
  monkeypatch.setattr(confined, 'check_target', lambda path: None)  # The race: planted after the check.
  confined.write_text(tmp_path / 'sharding.txt', 'the table\n')
  assert victim.read_text() == VICTIM_TEXT
  assert not (tmp_path / 'sharding.txt').is_symlink() and (tmp_path / 'sharding.txt').read_text() == 'the table\n'
  assert sorted(p.name for p in tmp_path.iterdir()) == ['sharding.txt', 'victim.txt']  # No temporary file left.


def _model_folder(tmp_path: pathlib.Path) -> pathlib.Path:
  """The Llama fixture with its tokenizer and every other file an export carries: the names serving copies."""
  folder = tmp_path / 'model'
  shutil.copytree(FIXTURES / 'llama', folder)
  shutil.copy(FIXTURES / 'llama_tied' / serving.GENERATION_CONFIG, folder)
  for file in (FIXTURES / 'tokenizer').iterdir():
    shutil.copy(file, folder)
  for name in serving.TOKENIZER_FILES:
    if not (folder / name).exists():
      (folder / name).write_text('{}\n' if name.endswith('.json') else 'a b\n')
  return folder


def _config(folder):
  c = base.get_config()
  c.model.init_from = f'hf:{folder}'
  c.data.source, c.data.seq_len = 'synthetic', 24
  return hf_load.configure(c)


def _export(folder: pathlib.Path, out: pathlib.Path) -> None:
  """What scripts/export_hf.py does with a run imported from `folder`: its serving files, then the write."""
  from trainer.run import job as job_lib
  config = _config(folder)
  info = serving.of_run(config)
  abstract = job_lib.build_job(config, jax.devices()[:1]).abstract.params
  save.export(config.model, jax.tree.map(lambda p: np.zeros(p.shape, p.dtype), abstract), out, serving=info)


def _readers(folder: pathlib.Path) -> None:
  """Every read of a model folder: the import's config and weights, the tokenizer (prepare_data, sample, eval)."""
  _config(folder)
  safetensors_files.weight_files(folder, 'model.init_from')
  hf_tokenizer.load(str(folder))


def test_no_file_of_a_model_folder_is_read_through_a_link_out_of_it(tmp_path):
  source = _model_folder(tmp_path)
  private = tmp_path / 'private.txt'
  private.write_text(PRIVATE_TEXT)
  _export(source, tmp_path / 'baseline')
  copied = sorted(p.name for p in (tmp_path / 'baseline').iterdir())
  assert set(serving.TOKENIZER_FILES) | {serving.GENERATION_CONFIG, 'config.json'} <= set(copied)
  names = sorted(p.name for p in source.iterdir())
  assert 'model.safetensors' in names
  for name in names:
    folder = tmp_path / f'linked_{name}'
    shutil.copytree(source, folder)
    (folder / name).unlink()
    (folder / name).symlink_to(private)
    refusals = []
    for read in (_readers, lambda f: _export(f, tmp_path / f'out_{name}')):
      try:
        read(folder)
      except UserError as e:
        refusals.append(str(e))
    assert refusals, f'{name}, a link to a private file, was read'
    for line in refusals:
      assert f'{folder / name} leads outside {folder} (to {private})' in line and '\n' not in line, line
    out = tmp_path / f'out_{name}'
    assert not out.exists() or all(PRIVATE_TEXT not in p.read_text(errors='replace') for p in out.iterdir()), name


@pytest.mark.parametrize('named', ['../elsewhere/model.safetensors', '/ABS/model.safetensors', 'model-1.safetensors'])
def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path, named):
  folder, elsewhere = tmp_path / 'model', tmp_path / 'elsewhere'
  shutil.copytree(FIXTURES / 'llama', folder)
  elsewhere.mkdir()
  shutil.copy(FIXTURES / 'llama' / 'model.safetensors', elsewhere)
  named = named.replace('/ABS', str(elsewhere))
  if named == 'model-1.safetensors':  # A name inside, which is a link out.
    (folder / named).symlink_to(elsewhere / 'model.safetensors')
  (folder / 'model.safetensors').rename(folder / 'kept.safetensors')
  tensors = list(safetensors_files.read_header(folder / 'kept.safetensors'))
  index = {'metadata': {}, 'weight_map': {**{t: 'kept.safetensors' for t in tensors}, tensors[0]: named}}
  (folder / safetensors_files.INDEX).write_text(json.dumps(index))
  with pytest.raises(UserError) as refused:
    safetensors_files.weight_files(folder, 'model.init_from')
  assert 'model.init_from' in str(refused.value) and ('leads outside' in str(refused.value)
                                                      or 'does not name a file inside' in str(refused.value))


def test_a_snapshot_of_hugging_faces_cache_reads_its_blobs(tmp_path):
  """The one layout whose links leave the folder by design: snapshots/REV/NAME -> ../../blobs/HASH."""
  repo = tmp_path / 'hub' / 'models--org--tiny'
  snapshot, blobs = repo / 'snapshots' / 'abc123', repo / 'blobs'
  snapshot.mkdir(parents=True)
  blobs.mkdir()
  for file in (*(FIXTURES / 'llama').iterdir(), *(FIXTURES / 'tokenizer').iterdir()):
    shutil.copy(file, blobs / f'hash-{file.name}')
    (snapshot / file.name).symlink_to(f'../../blobs/hash-{file.name}')
  _readers(snapshot)
  assert [p.name for p in serving.of_run(_config(snapshot)).files] == ['tokenizer.json', 'tokenizer_config.json',
                                                                     'generation_config.json']


def test_exported_weights_are_readable_like_the_exports_other_files(tmp_path):
  before = os.umask(0o022)
  try:
    _export(_model_folder(tmp_path), tmp_path / 'out')
  finally:
    os.umask(before)
  modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / 'out').iterdir()}
  assert modes['model.safetensors'] == modes['config.json'] == modes['tokenizer.json'] == 0o644, modes


def test_prepare_data_keeps_a_tokenizer_link_inside_its_folder_and_refuses_one_out_of_it(tmp_path, capsys):
  import sys
  from conftest import REPO
  sys.path.insert(0, str(REPO / 'scripts'))
  import prepare_data  # pylint: disable=import-outside-toplevel
  folder, docs, private = tmp_path / 'tokenizer', tmp_path / 'docs', tmp_path / 'private.txt'
  shutil.copytree(FIXTURES / 'tokenizer', folder)
  (folder / 'template.txt').write_text('{{ messages }}')
  (folder / 'chat_template.jinja').symlink_to('template.txt')  # Inside the folder: read, and kept as a file.
  private.write_text(PRIVATE_TEXT)
  docs.mkdir()
  (docs / 'doc.txt').write_text('what is two plus three ? it is five .')
  prepare_data.main([f'--input={docs}', f'--output={tmp_path / "kept"}', f'--tokenizer={folder}'])
  kept = tmp_path / 'kept' / 'tokenizer' / 'chat_template.jinja'
  assert kept.read_text() == '{{ messages }}' and not kept.is_symlink()
  (folder / 'special_tokens_map.json').symlink_to(private)
  capsys.readouterr()
  with pytest.raises(SystemExit) as refused:
    prepare_data.main([f'--input={docs}', f'--output={tmp_path / "refused"}', f'--tokenizer={folder}'])
  [line] = capsys.readouterr().err.splitlines()
  assert refused.value.code == 2 and line.startswith(
      f"prepare_data.py: error: --tokenizer='{folder}': {folder}/special_tokens_map.json leads outside"), line
  assert not (tmp_path / 'refused').exists()
