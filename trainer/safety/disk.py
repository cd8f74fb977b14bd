"""A save that fails for lack of space or permission: one line naming the workdir and the space needed.

Orbax writes a save into `<step>.orbax-checkpoint-tmp*` and renames it only
once complete (trainer/training/checkpoint.py), so a save that fails midway leaves every
earlier checkpoint as it was; `SaveFailedError` names the newest of them. Each
of Orbax's background threads also logs the failure with its own traceback
(a full disk printed 5 to 79 of them); `quiet_orbax_tracebacks` keeps those
records to one line each, since the run ends with the one that matters.
"""

import errno
import logging as std_logging
import os
import pathlib
import shutil
import sys

from trainer.base import storage
from trainer.base.errors import UserError

# errno values meaning "this folder cannot take the write", whoever asks.
WRITE_FAILURES = {errno.ENOSPC: 'no space left on the device', errno.EDQUOT: 'the disk quota is exceeded',
                  errno.EACCES: 'permission denied', errno.EPERM: 'operation not permitted',
                  errno.EROFS: 'the file system is read-only',
                  errno.EFBIG: 'a file grew past the largest this process may write (its file-size limit, ulimit -f)'}
_TEXTS = {'No space left on device': errno.ENOSPC, 'Disk quota exceeded': errno.EDQUOT,
          'Permission denied': errno.EACCES, 'Read-only file system': errno.EROFS, 'File too large': errno.EFBIG}
_FIXES = {errno.ENOSPC: 'free some space', errno.EDQUOT: 'free some space or raise the quota',
          errno.EFBIG: 'raise the file-size limit (ulimit -f unlimited)'}
SAVE_FAILED_EXIT_CODE = 2


class SaveFailedError(UserError):
  """A checkpoint could not be written; the newest complete one is named in the message."""
  exit_code = SAVE_FAILED_EXIT_CODE
  # Orbax's writer threads and coroutines outlive the failed save: an interpreter shutdown beside them printed
  # "Exception ignored ... Python is likely shutting down" tracebacks after the line. launch.py ends at once instead.
  exit_at_once = True


def write_failure(error: BaseException | None) -> int | None:
  """The errno of a disk/permission failure in `error` or anything it was raised from (Orbax wraps them)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in WRITE_FAILURES:
      return error.errno
    # tensorstore reports the same failures as text inside its own error types.
    for text, code in _TEXTS.items():
      if text in str(error):
        return code
    error = error.__cause__ or error.__context__
  return None


def _size(path: pathlib.Path) -> int:
  if storage.is_cloud(path):
    return 0  # A bucket is never full; a failed write there is about permission.
  return sum(p.stat().st_size for p in path.rglob('*') if p.is_file()) if path.exists() else 0


def save_failed(checkpoints: pathlib.Path, step: int, code: int, good_steps: list[int]) -> SaveFailedError:
  """The one-line error for a failed save of `step` into `checkpoints`, given the complete steps left on disk."""
  newest = max(good_steps, default=None)
  need = _size(checkpoints / str(newest)) if newest is not None else 0
  try:
    free = shutil.disk_usage(checkpoints).free
  except OSError:
    free = None
  space = (f'; a checkpoint needs about {_mb(need)} and {_mb(free)} is free there' if need and free is not None
           else '')
  kept = (f'The last good checkpoint, step {newest}, is intact; the run resumes from it' if newest is not None
          else 'No checkpoint was completed; the run starts over')
  fix = _FIXES.get(code, 'restore write access')
  return SaveFailedError(f'could not save step {step} to {checkpoints}: {WRITE_FAILURES[code]}{space}. {kept} '
                         f'once you {fix} (or copy the workdir elsewhere) and relaunch the same command.')


def _mb(size: int) -> str:
  return f'{size / 2**20:.1f} MiB'


# Where a failed save's echoes come from: Orbax's writer threads, and the asyncio tasks and loops they ran on
# ("Task exception was never retrieved" at exit; "Event loop is closed" from threads finishing after their loop).
_ECHO_SOURCES = ('orbax', 'asyncio', 'concurrent')


def _is_save_echo(error: BaseException | None) -> bool:
  return error is not None and (write_failure(error) is not None or
                                (isinstance(error, RuntimeError) and str(error) == 'Event loop is closed'))


class _OneLine(std_logging.Filter):
  """A failed write's records, kept as one line each: the traceback is dropped, the error kept."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if (any(s in record.pathname for s in _ECHO_SOURCES) and record.exc_info
        and _is_save_echo(record.exc_info[1])):
      if 'asyncio' in record.pathname:  # "... exception was never retrieved", one per array: Orbax said it once.
        return False
      record.msg = f'{record.getMessage()} ({" ".join(str(record.exc_info[1]).split())[:200]})'
      record.args, record.exc_info, record.exc_text = None, None, None
    return True


_FILTER = _OneLine()


def _one_line_unraisable(unraisable) -> None:
  """sys.unraisablehook: the same echoes, raised where Python can only print them, dropped; any other printed."""
  if _is_save_echo(unraisable.exc_value):
    return  # The run's own line names the failed save; each echo (one per array written) said it again.
  sys.__unraisablehook__(unraisable)


def quiet_orbax_tracebacks() -> None:
  """Installs the one-line filter on the handlers absl logs through, and the unraisable hook (idempotent)."""
  for handler in std_logging.getLogger().handlers + std_logging.getLogger('absl').handlers:
    if _FILTER not in handler.filters:
      handler.addFilter(_FILTER)
  sys.unraisablehook = _one_line_unraisable


def describe(error: BaseException, workdir: str | os.PathLike) -> str | None:
  """A one-line message for a disk/permission failure anywhere in `error`'s chain, else None."""
  code = write_failure(error)
  if code is None:
    return None
  return (f'cannot write to --workdir={workdir}: {WRITE_FAILURES[code]} ({" ".join(str(error).split())[:200]}); '
          f'free some space or restore write access, then relaunch the same command.')
