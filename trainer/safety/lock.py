"""One launch per workdir: WORKDIR/launch.lock, held for the whole run by process 0.

Two launches in one workdir would interleave their steps in metrics.jsonl and
save over each other's checkpoints, and a second launch's `--start_over` would
move a live run's files away. So a launch takes the lock before it compiles or
moves anything, and a second one stops with one line naming the first.

How the lock works, and how a stale one is told apart:
- `flock` on the file is the lock itself. The kernel drops it when the holding
  process dies however it dies (kill -9 included), so a lock left by a dead
  process on the same host is free again at once and simply taken over.
- The file's content says who holds it (host, pid, since when, the command) so
  the refusal can name it; it is cleared (never deleted) when the run ends.
- On a shared file system `flock` may not reach across hosts (NFS maps it to
  its own locks; some FUSE mounts keep it per host). So the holder also touches
  the file every HEARTBEAT_S seconds. A lock naming another host whose file
  was touched in the last STALE_AFTER_S seconds is taken as live, even when
  `flock` succeeded; one older than that is stale (its host died or lost the
  mount) and is taken over with a warning naming it.
- On the holder's own host `flock` is trusted: free means the holder is gone
  (its pid may since belong to another program).
In a multi-process run only process 0 takes the lock; the others learn its
outcome through jax's key-value store and stop with the same line.

In a bucket (gs://) there is no flock. The lock is the object itself, created
only if absent (precondition ifGenerationMatch=0: the create is refused when the
object exists), holding the same content; the holder rewrites it every
HEARTBEAT_S seconds and deletes it when the run ends. An object found there is
live unless its holder ran on this host and that pid is gone, or its last
rewrite is older than STALE_AFTER_S (by the service's clock against this
host's). A stale one is deleted only in the generation that was found stale
(ifGenerationMatch again) and the create tried once more, so of two launches
taking over at once, one gets the refusal.
"""

import dataclasses
import datetime
import fcntl
import json
import os
import pathlib
import socket
import sys
import threading
import time

from absl import logging

from trainer.base import confined, storage
from trainer.base.errors import UserError
from trainer.supervision import attempt

LOCK_NAME = 'launch.lock'
HEARTBEAT_S = 30
STALE_AFTER_S = 120
_KV_KEY = 'jax_launch/workdir_lock'


@dataclasses.dataclass(frozen=True)
class Holder:
  host: str
  pid: int
  since: str  # UTC, ISO 8601.
  command: str
  supervisor: int = 0  # The pid of the supervisor (--max_restarts) that started it; 0 if none.
  attempt: int = 1

  def describe(self) -> str:
    return f'pid {self.pid} on host {self.host}, running since {self.since}: {self.command}'


def _took_over(workdir, holder: Holder | None, why: str) -> None:
  """Says whose lock this launch took: a warning for another launch's, one info line for the attempt before this one
  of the same supervisor (its own child, which it ended or which died: nothing anyone else was running)."""
  if (holder is not None and attempt.supervised() and holder.supervisor == os.getppid()
      and holder.host == socket.gethostname()):
    logging.info('--workdir=%s: attempt %d takes the lock from attempt %d (pid %d), which ended.', workdir,
                 attempt.number(), holder.attempt, holder.pid)
    return
  logging.warning('--workdir=%s: took over the lock of an earlier launch (%s; %s).', workdir,
                  holder.describe() if holder else 'unreadable', why)


def _read(path: pathlib.Path) -> Holder | None:
  try:
    fields = json.loads(path.read_text() or 'null')
    return Holder(**fields) if isinstance(fields, dict) else None
  except (OSError, ValueError, TypeError):
    return None  # Empty (released) or unreadable: nobody to name.


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # Someone else's live process.
  return True


class WorkdirLock:
  """The held lock; `release()` (or the process's death) frees it."""

  def __init__(self, path: pathlib.Path, fd: int):
    self.path, self._fd = path, fd
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._heartbeat, daemon=True, name='workdir-lock-heartbeat')
    self._thread.start()

  def _heartbeat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      try:
        os.utime(self._fd)  # The file held, not whatever may since stand at its name (a link).
      except OSError:
        pass  # A full or lost disk is reported by the checkpointer, not here.

  def release(self) -> None:
    if self._fd is None:
      return
    self._stop.set()
    self._thread.join(5)  # Its touch is of this descriptor: done before the number is closed and maybe reused.
    try:
      os.ftruncate(self._fd, 0)  # Cleared, not deleted: deleting would let two launches lock two different files.
    except OSError:
      pass
    fcntl.flock(self._fd, fcntl.LOCK_UN)
    os.close(self._fd)
    self._fd = None


def _me() -> Holder:
  since = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')
  return Holder(socket.gethostname(), os.getpid(), since, ' '.join(sys.argv),
                os.getppid() if attempt.supervised() else 0, attempt.number())


def acquire(workdir: str | os.PathLike) -> 'WorkdirLock | ObjectLock':
  """Takes WORKDIR/launch.lock for this process, or raises UserError naming the launch that holds it."""
  if storage.is_cloud(workdir):
    return storage.within_deadline('taking the workdir lock', workdir, _acquire_object, workdir)
  path = pathlib.Path(workdir).absolute() / LOCK_NAME
  fd = confined.open_fd(path, os.O_RDWR | os.O_CREAT, 0o644)  # Never through a link planted in its place.
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise _in_use(workdir, _read(path)) from None
    holder, age_s = _read(path), time.time() - os.fstat(fd).st_mtime
    if holder is not None:
      here = holder.host == socket.gethostname()
      if not here and age_s < STALE_AFTER_S:
        raise _in_use(workdir, holder, age_s)
      why = (f'process {holder.pid} is gone' if not _pid_alive(holder.pid) else f'pid {holder.pid} no longer holds '
             f'it') if here else f'no heartbeat for {age_s:.0f}s'
      _took_over(workdir, holder, why)
    me = _me()
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(dataclasses.asdict(me)).encode(), 0)
    os.fsync(fd)
  except BaseException:
    os.close(fd)  # Closing drops our flock, if we got it.
    raise
  return WorkdirLock(path, fd)


class ObjectLock:
  """The held lock object in a bucket; `release()` deletes it. Rewritten every HEARTBEAT_S while held."""

  def __init__(self, fs, key: str, content: bytes):
    self.path, self._fs, self._content = key, fs, content
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._heartbeat, daemon=True, name='workdir-lock-heartbeat')
    self._thread.start()

  def _still_ours(self) -> bool:
    self._fs.invalidate_cache(self.path)
    return self._fs.cat_file(self.path) == self._content

  def _heartbeat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      try:
        if not self._still_ours():  # Taken over (this host was stalled past STALE_AFTER_S): leave it be.
          logging.warning('%s: the lock was taken over by another launch; no longer renewing it.', self.path)
          return
        self._fs.pipe_file(self.path, self._content)
      except Exception:  # pylint: disable=broad-except  (a lost connection is reported by the checkpointer)
        pass

  def release(self) -> None:
    if self._stop.is_set():
      return
    self._stop.set()
    try:
      if self._still_ours():
        self._fs.rm_file(self.path)
    except Exception:  # pylint: disable=broad-except  (left behind, it goes stale after STALE_AFTER_S)
      pass


def _acquire_object(workdir) -> ObjectLock:
  key = os.fspath(storage.path(workdir) / LOCK_NAME)
  fs = storage.filesystem()
  content = json.dumps(dataclasses.asdict(_me())).encode()
  for retry in range(2):  # Not `attempt`: that name is the supervision module this file imports.
    try:
      fs.pipe_file(key, content, mode='create')  # ifGenerationMatch=0: refused if the object exists.
      return ObjectLock(fs, key, content)
    except FileExistsError:
      if retry:
        raise _in_use(workdir, None) from None
    try:
      fs.invalidate_cache(key)
      info, text = fs.info(key), fs.cat_file(key)  # Read in this order: the text is of this generation or newer.
    except FileNotFoundError:
      continue  # Released meanwhile.
    try:
      holder = Holder(**json.loads(text))
    except (ValueError, TypeError):
      holder = None
    age_s = time.time() - info['mtime'].timestamp()
    gone = holder is not None and holder.host == socket.gethostname() and not _pid_alive(holder.pid)
    if not gone and age_s < STALE_AFTER_S:
      raise _in_use(workdir, holder, age_s)
    _took_over(workdir, holder, f'process {holder.pid} is gone' if gone else f'no heartbeat for {age_s:.0f}s')
    try:
      bucket_name, name = key[len(storage.SCHEME):].split('/', 1)
      fs.call('DELETE', 'b/{}/o/{}', bucket_name, name, ifGenerationMatch=info['generation'])
    except (FileNotFoundError, FileExistsError):  # Gone, or renewed or retaken since (412): the create decides.
      pass
    fs.invalidate_cache(key)
  raise _in_use(workdir, None)


def _in_use(workdir, holder: Holder | None, heartbeat_age_s: float | None = None) -> UserError:
  attempt.note(workdir_in_use=True)  # The supervisor then writes nothing into the live run's attempts.jsonl.
  who = holder.describe() if holder else 'another launch'
  stale = (f' Its last heartbeat was {heartbeat_age_s:.0f}s ago; if that host is down, the lock is taken over once '
           f'it is {STALE_AFTER_S}s old.' if heartbeat_age_s is not None else '')
  return UserError(f'--workdir={workdir} is in use by another launch ({who}). Wait for it to finish or stop it, '
                   f'or choose another --workdir; nothing was changed.{stale}')


def acquire_for_run(workdir: str) -> WorkdirLock | None:
  """Process 0 takes the lock; in a multi-process run the others wait for its outcome and share it.

  Returns the lock on process 0, None on the others.
  """
  import jax
  if jax.process_count() == 1:
    return acquire(workdir)
  from jax._src import distributed as jax_distributed  # The key-value store of the already joined processes.
  client = jax_distributed.global_state.client
  if jax.process_index() == 0:
    try:
      lock = acquire(workdir)
    except UserError as e:
      client.key_value_set(_KV_KEY, f'fail {e}')
      raise
    client.key_value_set(_KV_KEY, 'ok')
    return lock
  answer = client.blocking_key_value_get(_KV_KEY, 600_000)
  if answer != 'ok':
    raise UserError(answer.removeprefix('fail '))
  return None
