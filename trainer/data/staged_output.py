"""The folder scripts/prepare_data.py writes: built beside it under a temporary name, renamed into place when complete.

`--output=OUT` never holds a partial result. A run works in `OUT.partial/` (the stage): `job.json` (the settings
and the identity of every input file: its size and modification time), the tokenized chunks
(trainer/data/tokenize_job.py) and `output/`, where the shards, meta.json and the tokenizer are written; when all
are written, `output/` is renamed to OUT (one rename: a reader sees all of it or nothing) and the stage removed.

An interrupted run leaves the stage. The same command again resumes from its chunks only when the settings and
every input file are as they were; otherwise it says what changed and how to start over, since chunks of the old
input mixed with documents of the new would be silently wrong. A stage that holds no chunk keeps nothing worth
resuming: it is replaced by the next run, and a run that fails before its first chunk removes its own, as does one
that fails reading its input (the fix changes the input, so its chunks could not be resumed). A run holds its
stage locked (flock), so a second run into the same --output is refused rather than mixing its chunks in.
"""

import dataclasses
import fcntl
import json
import os
import pathlib
import shlex
import shutil

from trainer.base import confined
from trainer.base.errors import UserError

Identity = list[list]  # [name, size in bytes, modification time in ns] per input file, in reading order.


def identity(paths: list[pathlib.Path]) -> Identity:
  """What says a file is the same one a stage was made from, without reading it."""
  found = []
  for path in paths:
    try:
      stat = path.stat()
    except OSError as e:
      raise UserError(f'cannot read {str(path)!r} ({e.strerror}); fix it or leave it out.') from None
    found.append([os.path.abspath(path), stat.st_size, stat.st_mtime_ns])  # The same from any working folder.
  return found


def changes(then: Identity, now: Identity) -> str:
  """The first differences between two identities, in words ('' when equal)."""
  old, new = ({name: (size, mtime) for name, size, mtime in files} for files in (then, now))
  differ = [name for name in sorted(old.keys() | new.keys()) if old.get(name) != new.get(name)]
  words = []
  for name in differ[:3]:
    if name not in new:
      words.append(f'{name!r} is gone')
    elif name not in old:
      words.append(f'{name!r} is new')
    else:
      words.append(f'{name!r} was {old[name][0]:,} bytes, now {new[name][0]:,}' if old[name][0] != new[name][0]
                   else f'{name!r} was modified')
  return '; '.join(words) + (f'; and {len(differ) - 3} more file(s)' if len(differ) > 3 else '')


def check_output(out: pathlib.Path) -> None:
  """Refuses an --output that is a link, a file, or a folder with anything in it: nothing is written through a link
  or over what is there. `out` is absolute."""
  if not out.name:
    raise UserError(f'--output={str(out)!r} names no folder; give a new folder.')
  for path, what in ((out, f'--output={str(out)!r}'), (stage_path(out), f'its work folder {str(stage_path(out))!r}')):
    if path.is_symlink():
      raise UserError(f'{what} is a symbolic link (to {os.readlink(path)!r}); prepare_data.py does not write '
                      f'through links: give the real path, or remove the link.')
  if out.exists() and not out.is_dir():
    raise UserError(f'--output={str(out)!r} is a file; give a new folder.')
  if out.is_dir() and any(out.iterdir()):
    if {p.name for p in out.iterdir()} == {'.partial'}:
      raise UserError(f'--output={str(out)!r} holds only .partial/, an interrupted run of an earlier prepare_data.py '
                      f'that this one cannot resume; remove it (rm -r {shlex.quote(str(out))}) and run again.')
    raise UserError(f'--output={str(out)!r} is not empty; choose a new folder (nothing was overwritten).')


def stage_path(out: pathlib.Path) -> pathlib.Path:
  return out.with_name(out.name + '.partial')


@dataclasses.dataclass
class Stage:
  """A run's work folder beside --output; `published` once its output has been renamed into place."""
  out: pathlib.Path
  work: pathlib.Path
  published: bool = False
  locked: int | None = None  # The descriptor of the folder, flock()ed while this run works in it.

  @property
  def output(self) -> pathlib.Path:
    return self.work / 'output'

  def chunks(self) -> int:
    """Tokenized chunks kept (a chunk cut short is only a .tmp.npz, redone on resume)."""
    try:
      return sum(1 for p in os.scandir(self.work)
                 if p.name.startswith('chunk-') and p.name.endswith('.npz') and not p.name.endswith('.tmp.npz'))
    except OSError:
      return 0

  def lock(self) -> None:
    """Holds the stage for this process (until it ends, or `close`): two runs into one --output would mix chunks."""
    self.work.mkdir(parents=True, exist_ok=True)
    self.locked = os.open(self.work, os.O_RDONLY)
    try:
      fcntl.flock(self.locked, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      self.close()
      raise UserError(f'another prepare_data.py is writing {str(self.work)!r} for --output={str(self.out)!r}; wait '
                      f'for it to finish, or choose another --output.') from None

  def close(self) -> None:
    if self.locked is not None:
      os.close(self.locked)
      self.locked = None

  def discard(self) -> None:
    shutil.rmtree(self.work, ignore_errors=True)
    self.close()

  def discard_if_empty(self) -> None:
    """Removes the stage when it keeps nothing worth resuming (no chunk): a failed run leaves nothing in the way."""
    if not self.published and not self.chunks():
      self.discard()

  def fresh_output(self) -> pathlib.Path:
    """`output/`, emptied of what a run cut short while writing it left."""
    shutil.rmtree(self.output, ignore_errors=True)
    self.output.mkdir()
    return self.output

  def publish(self) -> None:
    """Renames the finished output to --output (an empty folder there is replaced), then removes the stage."""
    try:
      os.rename(self.output, self.out)
    except OSError:  # OUT is an empty folder on another file system or a mount point: move its entries, meta last.
      self.out.mkdir(parents=True, exist_ok=True)
      for entry in sorted(self.output.iterdir(), key=lambda p: p.name == 'meta.json'):
        shutil.move(str(entry), str(self.out / entry.name))
    self.published = True
    self.discard()


def open_stage(out: pathlib.Path, settings: dict, inputs: Identity) -> Stage:
  """The stage of this run: new, or an interrupted one of the same settings and input to resume."""
  stage = Stage(out, stage_path(out))
  job = stage.work / 'job.json'
  if stage.work.exists() and not stage.work.is_dir():
    raise UserError(f'{str(stage.work)!r}, where prepare_data.py keeps its work, is a file; move it away.')
  stage.lock()
  try:
    if stage.chunks():
      try:
        saved = json.loads(job.read_text())
        saved_settings, saved_inputs = saved['settings'], saved['inputs']
      except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f'{str(stage.work)!r} holds chunks but no job.json of prepare_data.py; remove it '
                        f'(rm -r {shlex.quote(str(stage.work))}) and run again.') from None
      start_over = f'remove it to start over (rm -r {shlex.quote(str(stage.work))})'
      if saved_settings != settings:
        changed = ', '.join(f'{k}: {saved_settings.get(k)!r} then, {v!r} now' for k, v in settings.items()
                            if saved_settings.get(k) != v)
        raise UserError(f'{str(stage.work)!r} holds an interrupted run with other settings ({changed}); rerun it with '
                        f'those to resume, {start_over}, or choose a new --output.')
      if saved_inputs != inputs:
        raise UserError(f'the input or the tokenizer changed since the interrupted run in {str(stage.work)!r} '
                        f'({changes(saved_inputs, inputs)}): its {stage.chunks()} chunk(s) would mix old and new '
                        f'documents; {start_over}, or restore the input as it was.')
      return stage
    for entry in os.scandir(stage.work):  # Nothing kept: a run cut short before its first chunk (the folder is locked).
      shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.unlink(entry.path)
    confined.write_text(job, json.dumps({'settings': settings, 'inputs': inputs}, indent=1) + '\n')  # Whole.
    return stage
  except BaseException:  # Refused, or cut short: the lock goes with it (main() also runs in-process).
    stage.close()
    raise


def check_unchanged(stage: Stage, inputs: Identity) -> None:
  """Refuses to publish what was read from input files that changed while this run read them."""
  saved = json.loads((stage.work / 'job.json').read_text())['inputs']
  if saved != inputs:
    stage.discard()
    raise UserError(f'the input changed while it was read ({changes(saved, inputs)}), so the documents may mix '
                    f'old and new: nothing was kept; run the same command again once the input no longer changes.')
