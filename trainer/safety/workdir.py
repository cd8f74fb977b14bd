"""The --workdir, checked before anything is compiled or written: a writable local folder or gs:// prefix.

A Cloud Storage URL (gs://bucket/run) is checked by writing a probe object
there (trainer/base/storage.py): a missing bucket or missing write permission ends
in one line. Other URL schemes (s3://, ...) are refused by their scheme, so
nothing named `./s3:` is ever created and no compile is wasted.
"""

import os
import pathlib
import re
import socket

from trainer.base import confined, storage
from trainer.base.errors import UserError
from trainer.supervision import attempt

# The files a launch writes into a local workdir by fixed names, refused at once when a link, fifo or device stands in
# their place (each is also opened by trainer/base/confined.py, which refuses one planted later). tests/
# test_faults_symlinks.py checks this list against the files a real run leaves.
WRITTEN = ('launch.lock', 'config.json', 'sharding.txt', 'metrics.jsonl', 'goodput.jsonl', 'attempts.jsonl',
           'logs/library_errors.log')
# The folders it makes for files of predictable names (checkpoints/ and tensorboard/ may be links to another disk).
OWN_FOLDERS = ('logs', 'hangs', 'evals', 'memory_profiles')
_URL = re.compile(r'^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*):/')
# What a run makes under its workdir, by kind: one there of the other kind failed deep in the run, as a traceback
# a supervised run retried (a file named checkpoints: NotADirectoryError at every attempt).
_FOLDERS = ('checkpoints', 'damaged_checkpoints', 'tensorboard', 'plugins', 'mlruns') + OWN_FOLDERS
_FILES = tuple(name for name in WRITTEN if '/' not in name)


def check(workdir: str) -> storage.Path:
  """Creates `workdir` if needed and proves it writable; returns it absolute. Raises UserError otherwise."""
  if storage.is_cloud(workdir):
    # A supervised attempt runs after its supervisor's probe of the same bucket passed.
    return storage.check_writable(workdir, answered_before=attempt.supervised())
  match = _URL.match(workdir)
  if match:
    raise UserError(f'--workdir={workdir}: {match["scheme"]}:// paths are not supported; use a local folder or a '
                    f'Cloud Storage URL (gs://bucket/run).')
  path = pathlib.Path(workdir).expanduser().absolute()
  try:
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
  except PermissionError as e:  # A folder on the way that this user may not enter (no x bit for it).
    raise UserError(f'--workdir={workdir}: this user cannot enter {pathlib.Path(e.filename).parent} (permission '
                    f'denied); give it search permission (chmod +x) or choose another folder.') from None
  if existing is not None and not existing.is_dir():
    what = 'is a file' if existing == path else f'is inside {existing}, which is a file'
    raise UserError(f'--workdir={workdir} {what}, not a folder; choose a folder (it is created if missing).')
  try:
    path.mkdir(parents=True, exist_ok=True)
    # Every process probes with its own name: processes on one host (or sharing a file system) do not collide.
    probe = path / f'.write_probe.{socket.gethostname()}.{os.getpid()}'
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # O_EXCL: never through a planted link.
    probe.unlink()
  except OSError as e:
    raise UserError(f'--workdir={workdir} is not writable by this user ({e.strerror}: {e.filename}); fix its '
                    f'permissions or choose another folder.') from e
  _check_entries(path)  # A folder where a file goes (or the other way) is named as such, not as a planted link.
  for name in WRITTEN:  # Before the lock or the supervisor: a planted link stops the launch before anything is written.
    confined.check_target(path / name)
  for name in OWN_FOLDERS:
    confined.check_folder(path / name)
  return path


def _check_entries(path: pathlib.Path) -> None:
  """UserError naming an entry of the workdir that the run needs as a folder but is a file, or the other way."""
  for names, wrong, want in ((_FOLDERS, pathlib.Path.is_file, 'a folder'), (_FILES, pathlib.Path.is_dir, 'a file')):
    for name in names:
      if wrong(path / name):
        raise UserError(f'{path / name} is {"a file" if want == "a folder" else "a folder"}, but the run keeps '
                        f'{want} there; move it out of the workdir (or choose another --workdir).')
