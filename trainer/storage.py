"""Where a run's files live: a local folder, or a Cloud Storage URL (`--workdir=gs://bucket/run`).

Every module that reads or writes the workdir takes its paths from `path()`: a
pathlib.Path for a local folder (as before), an etils epath.Path for gs://
(fsspec and gcsfs underneath; Orbax writes the arrays itself through
tensorstore's GCS driver, given the same epath). gcsfs is optional:
requirements-gcs.txt installs it.

What a bucket does not do like a disk is handled here, once:
- an object cannot be appended to: `AppendLog` keeps the text and rewrites the
  whole object, at most every CLOUD_FLUSH_EVERY_S seconds and on close;
- a folder is only a name prefix (it exists once an object is under it) and has
  no rename: `move` copies then deletes;
- an emulator (STORAGE_EMULATOR_HOST, the variable Google's clients read) is
  also handed to tensorstore, which reads its own variables (see `_use_emulator`).
"""

import os
import pathlib
import socket
import time
from typing import Union

from trainer.errors import UserError

SCHEME = 'gs://'
REQUIREMENTS = 'requirements-gcs.txt'
# How stale metrics.jsonl and TensorBoard's event file in a bucket may get: each flush rewrites the whole object.
CLOUD_FLUSH_EVERY_S = 30.0

Path = Union[pathlib.Path, 'epath.Path']  # noqa: F821  (epath is imported only for gs://)


def is_cloud(workdir: str | os.PathLike) -> bool:
  return os.fspath(workdir).startswith(SCHEME)


def path(workdir: str | os.PathLike) -> Path:
  """The workdir (or any path in it) as a path object: local ones absolute, gs:// ones as epath paths."""
  if not is_cloud(workdir):
    return pathlib.Path(workdir).absolute()
  _use_emulator()
  try:
    import gcsfs  # noqa: F401  (etils reaches gs:// through it)
  except ImportError:
    raise UserError(f'{os.fspath(workdir)} is on Cloud Storage, which needs gcsfs: pip install -r '
                    f'{REQUIREMENTS}.') from None
  from etils import epath
  return epath.Path(os.fspath(workdir).rstrip('/'))


def bucket(workdir: str | os.PathLike) -> str:
  return os.fspath(workdir)[len(SCHEME):].split('/', 1)[0]


def _use_emulator() -> None:
  """With STORAGE_EMULATOR_HOST set, points every client at it without Google credentials.

  gcsfs and google-cloud-storage (TensorBoard's writer) read that variable
  themselves. tensorstore reads TENSORSTORE_GCS_HTTP_URL for the endpoint and
  takes GOOGLE_AUTH_TOKEN_FOR_TESTING as its token instead of looking for
  credentials. gcsfs would try credentials in turn (the metadata server among
  them) and ask a gRPC API for the bucket's type, which an emulator does not
  serve: 60 s per bucket before it falls back (measured with gcsfs 2026.10.1).
  """
  host = os.environ.get('STORAGE_EMULATOR_HOST')
  if not host:
    return
  os.environ.setdefault('TENSORSTORE_GCS_HTTP_URL', host if '://' in host else f'http://{host}')
  os.environ.setdefault('GOOGLE_AUTH_TOKEN_FOR_TESTING', 'emulator')
  os.environ.setdefault('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT', 'false')  # Read when gcsfs is imported, and
  import fsspec
  for protocol in ('gs', 'gcs'):  # its plain file system named, in case gcsfs was imported before.
    fsspec.register_implementation(protocol, 'gcsfs.core.GCSFileSystem', clobber=True)
  fsspec.config.conf.setdefault('gcs', {}).setdefault('token', 'anon')
  fsspec.config.conf.setdefault('gs', {}).setdefault('token', 'anon')


def filesystem():
  """gcsfs's file system, for what epath does not offer (conditional create, copy)."""
  _use_emulator()
  import fsspec
  return fsspec.filesystem('gcs')


def check_writable(workdir: str) -> Path:
  """Proves the bucket exists and these credentials can write to the run's prefix; UserError naming the fix."""
  root = path(workdir)
  name = bucket(workdir)
  probe = root / f'.write_probe.{socket.gethostname()}.{os.getpid()}'
  try:
    probe.write_bytes(b'')
    probe.unlink()
  except FileNotFoundError:
    raise UserError(f'--workdir={workdir}: bucket gs://{name} does not exist (or these credentials cannot see it); '
                    f'create it (gcloud storage buckets create gs://{name}) or fix the bucket name.') from None
  except Exception as e:  # pylint: disable=broad-except  (gcsfs: OSError for 403, HttpError for 401 and others)
    text = ' '.join(str(e).split())[:200]
    raise UserError(f'--workdir={workdir}: cannot write to bucket gs://{name} ({type(e).__name__}: {text}); give '
                    f'this host\'s credentials (gcloud auth application-default login, or the VM\'s service account) '
                    f'roles/storage.objectUser on gs://{name}.') from None
  return root


def move(source: Path, target: Path) -> None:
  """Moves a file or folder within one workdir; in a bucket, by copying then deleting (no rename there)."""
  if not is_cloud(source):
    target.parent.mkdir(parents=True, exist_ok=True)
    source.rename(target)
    return
  fs = filesystem()
  if fs.isdir(os.fspath(source)):
    fs.copy(os.fspath(source), os.fspath(target), recursive=True)
    fs.rm(os.fspath(source), recursive=True)
  else:
    fs.mv(os.fspath(source), os.fspath(target))


def upload_folder(local: pathlib.Path, target: Path) -> None:
  """Copies every file under local folder `local` to the same relative path under `target`."""
  for file in sorted(p for p in local.rglob('*') if p.is_file()):
    (target / file.relative_to(local).as_posix()).write_bytes(file.read_bytes())


class AppendLog:
  """A text file that only grows (metrics.jsonl, goodput.jsonl).

  On disk it is appended to and flushed at every write. A bucket object cannot
  be appended to: the text (what the file held before, then every write) is
  kept and the whole object rewritten, at most every `flush_every_s` seconds and
  at close, so a reader of the bucket lags by that much.
  """

  def __init__(self, file: Path, flush_every_s: float = CLOUD_FLUSH_EVERY_S):
    self.file = file
    self._cloud = is_cloud(file)
    self._flush_every_s = flush_every_s
    self._flushed_at = float('-inf')
    if self._cloud:
      self._text = file.read_text() if file.exists() else ''
      self._dirty = False
    else:
      file.parent.mkdir(parents=True, exist_ok=True)
      self._handle = file.open('a')

  def write(self, text: str) -> None:
    if not self._cloud:
      self._handle.write(text)
      self._handle.flush()
      return
    self._text += text
    self._dirty = True
    if time.monotonic() - self._flushed_at >= self._flush_every_s:
      self.flush()

  def flush(self) -> None:
    if self._cloud and self._dirty:
      self.file.write_text(self._text)
      self._dirty, self._flushed_at = False, time.monotonic()

  def close(self) -> None:
    if self._cloud:
      self.flush()
    else:
      self._handle.close()
