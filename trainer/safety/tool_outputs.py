"""A tool's output (an export folder, an eval's result file) appears under its name whole, or not at all.

scripts/export_hf.py, export_params.py and eval.py write into a temporary name beside the output,
`.NAME.partial-PID`, and rename it to NAME once everything is written. A tool stopped by a signal removes it on
the way out (trainer/safety/startup_signals.py `on_stop`); one killed without a word (kill -9, a lost machine)
leaves it, and the next run for the same output removes it, so "run the same command again" works: before, a
killed export left a half-written --output that the rerun refused as existing.

An --output that is a symbolic link, dangling or not, is refused in one line: the tool would write through it
to wherever it points (a dangling one ended in a FileExistsError traceback). A bucket (gs://) has no rename:
there the output is written in place, as before.
"""

import contextlib
import os
import pathlib
import re
import shutil
from typing import Iterator

from trainer.base.errors import UserError
from trainer.safety import startup_signals

_PARTIAL = '.partial-'


def refuse_link(flag: str, output: str) -> None:
  """One line for an output that is a symbolic link: nothing is written through one."""
  if '://' not in output and os.path.islink(output):
    raise UserError(f'{flag}={output} is a symbolic link (to {os.readlink(output)}); give the path to create '
                    f'itself, not a link: nothing is written through one.')


def refuse_existing(flag: str, output: str) -> None:
  """One line for an output that is a link or exists: nothing is overwritten."""
  refuse_link(flag, output)
  if '://' not in output and os.path.exists(output):
    raise UserError(f'{flag}={output} exists; choose a new folder (nothing is overwritten).')


def _owner_alive(partial: pathlib.Path, stem: str) -> bool:
  match = re.match(r'\d+', partial.name[len(stem):])
  if not match or int(match.group()) == os.getpid():
    return False
  try:
    os.kill(int(match.group()), 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # Another user's live process.
  return True


def _remove(path: pathlib.Path) -> None:
  if path.is_dir() and not path.is_symlink():
    shutil.rmtree(path, ignore_errors=True)
  elif path.exists() or path.is_symlink():
    path.unlink(missing_ok=True)


def remove_stale(output: pathlib.Path) -> None:
  """Removes what a killed earlier run left beside `output` (its `.NAME.partial-PID*`), unless PID still runs."""
  stem = f'.{output.name}{_PARTIAL}'
  if output.parent.is_dir():
    for partial in output.parent.glob(f'{_glob_escape(stem)}*'):
      if not _owner_alive(partial, stem):
        _remove(partial)


def _glob_escape(name: str) -> str:
  return re.sub(r'([*?\[])', r'[\1]', name)


def _remove_own(partial: pathlib.Path) -> None:
  """The partial output and what a library wrote beside it (Orbax's `.orbax-checkpoint-tmp-*`)."""
  for leftover in partial.parent.glob(f'{_glob_escape(partial.name)}*'):
    if not leftover.name[len(partial.name):][:1].isdigit():  # Not another process's `.NAME.partial-PID0`.
      _remove(leftover)


@contextlib.contextmanager
def written_whole(output: str, replace: bool = False) -> Iterator[str]:
  """Yields the temporary path to write `output` at; renames it to `output` when the block ends without error.

  `replace`: a file `output` already there is replaced (an eval's result file), else the rename refuses it.
  """
  if '://' in output:
    yield output
    return
  path = pathlib.Path(output).absolute()
  path.parent.mkdir(parents=True, exist_ok=True)
  remove_stale(path)
  partial = path.parent / f'.{path.name}{_PARTIAL}{os.getpid()}'
  startup_signals.on_stop(lambda: _remove_own(partial))
  try:
    yield str(partial)
    if replace and not path.is_dir():
      os.replace(partial, path)
    else:
      refuse_existing('--output', output)  # Created by someone else while this one wrote.
      os.rename(partial, path)
  finally:
    _remove_own(partial)
