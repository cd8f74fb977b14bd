"""Where a run's files live: a local folder, or a Cloud Storage URL (`--workdir=gs://bucket/run`).

Every module that reads or writes the workdir takes its paths from `path()`: a
pathlib.Path for a local folder (as before), an etils epath.Path for gs://
(fsspec and gcsfs underneath; Orbax writes the arrays itself through
tensorstore's GCS driver, given the same epath). gcsfs is optional:
requirements-gcs.txt installs it.

What a bucket does not do like a disk is handled here, once:
- an object cannot be appended to: `AppendLog` keeps the text and rewrites the
  whole object, at most every CLOUD_FLUSH_EVERY_S seconds (from a thread of its
  own, off the step loop) and on close;
- a folder is only a name prefix (it exists once an object is under it) and has
  no rename: `move` copies then deletes;
- an emulator (STORAGE_EMULATOR_HOST, the variable Google's clients read) is
  also handed to tensorstore, which reads its own variables (see `_use_emulator`);
- a storage server can stop answering without closing the connection, and a host
  can have no route to it or no credentials: `check_writable` tells those apart in
  seconds (a TCP connect to the endpoint, then the credentials, then a probe
  write), and the calls on the run's start-up path (the probe, the lock, reading
  the checkpoints' manifests) run under `within_deadline`: past
  `ckpt.storage_deadline_s` they end in one line naming the bucket, the operation
  and the time waited (exit 74, which the supervisor retries). gcsfs retries
  transient errors itself with backoff; the deadline bounds the whole. Bulk array
  reads and writes (Orbax) are bounded by the hang watch (trainer/supervision/hang.py).
"""

import os
import pathlib
import re
import socket
import threading
from typing import Union

from absl import logging

from trainer.base import confined
from trainer.base.errors import UserError

SCHEME = 'gs://'
REQUIREMENTS = 'requirements-gcs.txt'
# How stale metrics.jsonl and TensorBoard's event file in a bucket may get: each flush rewrites the whole object.
CLOUD_FLUSH_EVERY_S = 30.0
# How long AppendLog.close() waits for a background upload under way before writing the final text itself.
CLOSE_WAIT_S = 60.0

Path = Union[pathlib.Path, 'epath.Path']  # noqa: F821  (epath is imported only for gs://)
STALL_EXIT_CODE = 74  # EX_IOERR in sysexits.h: an input/output error, worth a retry.
_CONNECT_TIMEOUT_S = 5.0
_deadline_s = [120.0]  # ckpt.storage_deadline_s, set once by launch.py (`configure`).


class StorageStall(UserError):
  """A storage call got no answer within the deadline."""
  exit_code = STALL_EXIT_CODE


def configure(deadline_s: float) -> None:
  if not (isinstance(deadline_s, (int, float)) and deadline_s > 0):
    raise UserError(f'ckpt.storage_deadline_s={deadline_s!r} must be a number of seconds > 0.')
  _deadline_s[0] = float(deadline_s)


def endpoint() -> tuple[str, int]:
  """(host, port) of the storage server this process talks to: the emulator's, or Cloud Storage's."""
  emulator = os.environ.get('STORAGE_EMULATOR_HOST')
  if not emulator:
    return 'storage.googleapis.com', 443
  import urllib.parse
  url = urllib.parse.urlsplit(emulator if '://' in emulator else f'http://{emulator}')
  return url.hostname or '127.0.0.1', url.port or (443 if url.scheme == 'https' else 80)


def within_deadline(operation: str, where: str | os.PathLike, fn, *args):
  """`fn(*args)`, or StorageStall naming the bucket and `operation` once it has waited ckpt.storage_deadline_s.

  Local paths call `fn` directly. For gs:// the call runs on a daemon thread the
  caller stops waiting for: a stalled socket cannot hold the launch, and the
  process exits without joining it.
  """
  if not is_cloud(where):
    return fn(*args)
  outcome = {}

  def call():
    try:
      outcome['value'] = fn(*args)
    except BaseException as e:  # pylint: disable=broad-except  (handed to the caller's thread)
      outcome['error'] = e

  worker = threading.Thread(target=call, daemon=True, name=f'storage: {operation}')
  worker.start()
  worker.join(_deadline_s[0])
  host, port = endpoint()
  if worker.is_alive():
    state = _endpoint_state() or 'the endpoint is reachable but stopped answering'
    raise StorageStall(f'gs://{bucket(where)}: {operation} got no answer from the storage endpoint {host}:{port} '
                       f'in {_deadline_s[0]:g}s (ckpt.storage_deadline_s); {state}. Every complete checkpoint is '
                       f'intact; relaunch when it answers again (a supervised run retries).')
  if 'error' in outcome:
    # gcsfs gives up on a refused endpoint after its own retries (33 s, measured with gcsfs 2026.10.1), before a
    # longer deadline: the same lost endpoint, so the same line and exit, not a traceback classed a crash.
    lost = _endpoint_state() if _is_connection_error(outcome['error']) else None
    if lost:
      raise StorageStall(f'gs://{bucket(where)}: {operation} could not connect to the storage endpoint {host}:{port}; '
                         f'{lost}. Every complete checkpoint is intact; relaunch when it answers again (a supervised '
                         f'run retries).') from None
    raise outcome['error']
  return outcome.get('value')


def _endpoint_state() -> str | None:
  """'the endpoint is lost (REASON ...)' when a new connection to it fails now; None when it connects."""
  try:
    socket.create_connection(endpoint(), timeout=_CONNECT_TIMEOUT_S).close()
    return None
  except OSError as e:
    return f'the endpoint is lost ({e.strerror or type(e).__name__} on a new connection)'


def _is_connection_error(error: BaseException) -> bool:
  """Whether `error`, or an error it was raised from, is a failed connection (aiohttp's types, or the OS's)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, (ConnectionError, TimeoutError)) or any(
        t.__name__ == 'ClientConnectionError' for t in type(error).__mro__):  # aiohttp's, not imported here.
      return True
    error = error.__cause__ or error.__context__
  return False


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


_BUCKET_CHARS = re.compile(r'^[a-z0-9][a-z0-9._-]*[a-z0-9]$')


def bucket_name_problem(name: str) -> str | None:
  """What Cloud Storage's bucket naming rules refuse in `name` (cloud.google.com/storage/docs/buckets#naming), or None.

  An emulator accepts any name, and the real service refuses a bad one only when a
  save first writes to it: checked here, before jax loads.
  """
  parts = name.split('.')
  if not 3 <= len(name) <= (222 if len(parts) > 1 else 63):
    return f'is {len(name)} characters long; a bucket name has 3 to 63 (up to 222 with dots)'
  if not _BUCKET_CHARS.match(name):
    return ('may hold only lowercase letters, digits, dashes, underscores and dots, and must start and end with a '
            'letter or digit')
  if any(not 1 <= len(part) <= 63 for part in parts):
    return 'has a dot-separated part that is empty or longer than 63 characters'
  if len(parts) == 4 and all(part.isdigit() for part in parts):
    return 'is an IP address'
  if name.startswith('goog') or 'google' in name or 'g00gle' in name:
    return 'starts with "goog" or contains "google", which Cloud Storage reserves'
  return None


class ObjectsGone(StorageStall):
  """Objects this run wrote to its bucket are gone (the bucket deleted or emptied): exit 74, at once, since every
  writer still open to the bucket (TensorBoard's) would fail again at exit, each with its own traceback."""
  exit_at_once = True


def objects_gone(where: str | os.PathLike, what: str) -> ObjectsGone:
  """The error for `what` (objects this run wrote under gs:// path `where`) found gone: names the bucket and why."""
  name = bucket(where)
  try:
    deleted = not bucket_exists(where)
  except Exception:  # pylint: disable=broad-except  (no answer either: say what is known)
    deleted = False
  if deleted:
    return ObjectsGone(f'gs://{name}: the bucket no longer exists (deleted, or its storage server lost it), and the '
                       f'run\'s checkpoints with it; recreate it (gcloud storage buckets create gs://{name}) or choose '
                       f'another --workdir, then relaunch.')
  return ObjectsGone(f'gs://{name}: {what} is gone from the bucket (it was emptied, or its storage server lost it); '
                     f'relaunch to resume from the newest checkpoint still there, or from step 0 if none is.')


def bucket_exists(where: str | os.PathLike) -> bool:
  """Whether the bucket of gs:// path `where` exists now (asked of the server, not gcsfs's cache)."""
  fs = filesystem()
  fs.invalidate_cache()
  return within_deadline('looking up the bucket', where, fs.exists, bucket(where))


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


def forget_listings() -> None:
  """Drops what every gcsfs file system here has listed (ours and etils' for Orbax, which are two instances): after
  objects were moved, a cached listing still shows them."""
  for fs in list(type(filesystem())._cache.values()):  # fsspec keeps one instance per set of arguments.
    fs.invalidate_cache()


def _check_reachable(workdir: str, answered_before: bool) -> None:
  """The endpoint answers a TCP connect; else UserError (exit 2), or StorageStall (74) if it answered before.

  At a first launch a refused or unanswered connect is this host's network or
  settings, which a retry does not fix. A supervised attempt starts only after its
  supervisor's own probe passed (launch.py), so there the same refusal is the
  endpoint lost since: worth the supervisor's retries, with its back-off.
  """
  host, port = endpoint()
  try:
    socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S).close()
  except OSError as e:
    if isinstance(e, TimeoutError):
      reason = f'no answer to a connect in {_CONNECT_TIMEOUT_S:g}s'
    else:
      reason = e.strerror or type(e).__name__
    if answered_before:
      raise StorageStall(f'gs://{bucket(workdir)}: the storage endpoint {host}:{port} answered earlier in this run '
                         f'and is lost now ({reason} on a new connection); every complete checkpoint is intact; '
                         f'relaunch when it answers again (a supervised run retries until --max_restarts).') from None
    raise UserError(f'--workdir={workdir}: this host cannot reach the storage endpoint {host}:{port} ({reason}); '
                    f'check its network (DNS, a route or a proxy to it, or Private Google Access on a VPC without '
                    f'external IPs), then relaunch. Nothing was written.') from None


def _check_credentials(workdir: str) -> None:
  """Application default credentials exist (not needed for an emulator, which takes none)."""
  if os.environ.get('STORAGE_EMULATOR_HOST'):
    return
  try:
    import google.auth
    import google.auth.exceptions
  except ImportError:
    return  # gcsfs reports it on the probe.
  try:
    within_deadline('looking up credentials', workdir, google.auth.default)
  except google.auth.exceptions.DefaultCredentialsError:
    raise UserError(f'--workdir={workdir}: this host has no Google credentials to reach gs://{bucket(workdir)}; run '
                    f'`gcloud auth application-default login`, set GOOGLE_APPLICATION_CREDENTIALS to a key file, or '
                    f'run on a VM with a service account.') from None


def check_writable(workdir: str, answered_before: bool = False) -> Path:
  """Proves the bucket exists and these credentials can write to the run's prefix; UserError naming the fix.

  In this order, each within seconds: the endpoint answers a TCP connect, credentials
  exist, and a probe object can be written and deleted (which tells a missing bucket
  and a missing permission apart). `answered_before`: the endpoint answered this
  run already (a supervised attempt), so losing it is exit 74, not 2.
  """
  name = bucket(workdir)
  problem = bucket_name_problem(name)
  if problem:
    raise UserError(f'--workdir={workdir}: {name!r} cannot be a Cloud Storage bucket: the name {problem}; use the '
                    f'name of an existing bucket (gs://BUCKET/run).')
  root = path(workdir)
  _check_reachable(workdir, answered_before)
  _check_credentials(workdir)
  probe = root / f'.write_probe.{socket.gethostname()}.{os.getpid()}'

  def write_probe():
    probe.write_bytes(b'')
    probe.unlink()

  try:
    within_deadline('writing a probe object', workdir, write_probe)
  except StorageStall:
    raise
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


def _torn(text: str) -> bool:
  return bool(text) and not text.endswith('\n')


def _untorn(text: str, file) -> str:
  """`text` without a last line cut short by a kill (logged), else unchanged."""
  if not _torn(text):
    return text
  kept = text[:text.rfind('\n') + 1]
  logging.warning('%s: its last line was cut short (%d bytes, the process writing it was killed); dropped it so that '
                  'every line stays a whole record.', file, len(text) - len(kept))
  return kept


class AppendLog:
  """A text file that only grows (metrics.jsonl, goodput.jsonl).

  On disk it is appended to and flushed at every write. A bucket object cannot
  be appended to: the text (what the file held before, then every write) is
  kept and the whole object rewritten, so a reader of the bucket lags by up to
  `flush_every_s` seconds. That upload grows with the run, so it runs on this
  log's own daemon thread, never on the writer's (the step loop's): the thread
  uploads the latest text as soon as there is new text, then waits
  `flush_every_s`; writes in between only replace what it will upload next, so
  no text is queued twice. A failed upload is logged once and retried at the
  next flush; it never ends the run. close() waits up to CLOSE_WAIT_S for an
  upload under way, then writes the final text itself.

  A last line cut short (the writer was killed mid-write) is dropped on opening, so
  new records never glue onto it and the file stays one JSON object a line; the
  step it was logging is logged again by the attempt that redoes it.
  """

  def __init__(self, file: Path, flush_every_s: float = CLOUD_FLUSH_EVERY_S):
    self.file = file
    self._cloud = is_cloud(file)
    if not self._cloud:
      file.parent.mkdir(parents=True, exist_ok=True)
      confined.check_target(file)  # A link planted in its place is refused, not read or appended through.
      if file.exists():
        text = file.read_text()
        if _torn(text):
          confined.write_text(file, _untorn(text, file))
      self._handle = confined.open_append(file)
      return
    self._flush_every_s = flush_every_s
    self._text = _untorn(file.read_text(), file) if file.exists() else ''
    # Writes not yet joined to the text: joining copies the text, which the log's thread does, not the writer.
    self._new: list[str] = []
    # The text only grows, so its length names a version: what the object holds, as far as this process knows.
    self._uploaded_len = len(self._text)
    self._failed = False  # Whether an upload failed already (logged once).
    self._closing = False
    self._changed = threading.Condition()
    self._thread = threading.Thread(target=self._upload_loop, name=f'AppendLog {file}', daemon=True)
    self._thread.start()

  def write(self, text: str) -> None:
    if not self._cloud:
      self._handle.write(text)
      self._handle.flush()
      return
    with self._changed:
      self._new.append(text)
      self._changed.notify()

  def _upload_loop(self) -> None:
    while True:
      with self._changed:
        self._changed.wait_for(lambda: self._closing or self._new or len(self._text) != self._uploaded_len)
        if self._closing:
          return
        text = self._take_new()
      self._upload(text, final=False)
      with self._changed:
        closing = self._changed.wait_for(lambda: self._closing, timeout=self._flush_every_s)
        final = self._take_new()
      if closing and len(final) != len(text):
        # close() came since the upload above, with newer text: written here while close() waits. Had close()
        # given up waiting and written `final` itself, the older text may have landed after it: this puts it back.
        self._upload(final, final=True)
        return

  def _take_new(self) -> str:
    """The whole text, the new writes joined to it; called holding `_changed`."""
    if self._new:
      self._text += ''.join(self._new)
      self._new.clear()
    return self._text

  def _upload(self, text: str, final: bool) -> None:
    try:
      self.file.write_text(text)
    except Exception as e:  # pylint: disable=broad-except  (gcsfs raises OSError, HttpError, timeouts, ...)
      if final:
        logging.error('Could not write %s at close (%s: %s): its last %d characters are not in the bucket.',
                      self.file, type(e).__name__, e, len(text) - self._uploaded_len)
      elif not self._failed:
        logging.warning('Could not write %s (%s: %s); retrying every %g s (further failures are not logged).',
                        self.file, type(e).__name__, e, self._flush_every_s)
      self._failed = True
      return
    with self._changed:
      self._uploaded_len = max(self._uploaded_len, len(text))

  def close(self) -> None:
    if not self._cloud:
      self._handle.close()
      return
    with self._changed:
      self._closing = True
      self._changed.notify()
    self._thread.join(CLOSE_WAIT_S)
    if self._thread.is_alive():
      logging.warning('An upload of %s is still under way after %g s; writing the final text now.', self.file,
                      CLOSE_WAIT_S)
    with self._changed:
      final = self._take_new()
    if len(final) != self._uploaded_len:
      self._upload(final, final=True)
