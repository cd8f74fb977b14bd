"""Files kept to their folder: written without following what someone planted in their place, read without leaving
the folder they were named in.

A workdir or model folder may be shared, and whoever can write into it can put a
symbolic link where the launcher or a tool is about to write (`launch.lock ->
~/.bashrc`), or where it reads (`merges.txt -> ~/.ssh/id_ed25519`, which an
export would copy into a folder meant for others). So, for local paths:
- a file written is refused in one line (`Planted`, a UserError) when a link, a
  fifo or a device stands in its place, never opened through it: whole files are
  written to a temporary file in the same folder and renamed over the name (a
  link planted after the check is then replaced, never followed), files kept
  open (a lock, an appended log) are opened with O_NOFOLLOW and checked regular;
- a file read from a folder is refused when its name is absolute or climbs out
  (`..`), or when it resolves outside the folder. A link that stays inside is
  read. Hugging Face's own cache is the one layout whose links leave the folder by
  design: a snapshot (`models--ORG--NAME/snapshots/REV/`) links into its repository's
  `blobs/`, which is allowed.
Links in the folders above a file (the workdir itself, a checkpoints folder moved
to a larger disk) are the user's own choice and followed, except in place of the
folders a launch makes for files of predictable names (`check_folder`). gs://
paths go to the storage layer's path objects unchanged: a bucket has no links.
"""

import errno
import os
import pathlib
import stat
import tempfile

from trainer.base.errors import UserError

# storage.SCHEME: storage.py imports this module (AppendLog), so this one cannot import it.
_CLOUD = 'gs://'

# O_NONBLOCK: opening a fifo for writing would otherwise wait for a reader before the check below could refuse it.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_KINDS = {stat.S_IFDIR: 'a folder', stat.S_IFIFO: 'a fifo', stat.S_IFCHR: 'a character device',
          stat.S_IFBLK: 'a block device', stat.S_IFSOCK: 'a socket'}


class Planted(UserError):
  """A link or other non-regular file where a file is to be written."""


def _refusal(path: pathlib.Path, kind: str) -> Planted:
  return Planted(f'{path} is {kind}, not a regular file; it is written here by this program itself and never through '
                 f'a link or special file (anyone who can write into the folder could have put it there to make this '
                 f'user write elsewhere): remove it (rm {str(path)!r}) and rerun.')


def _kind(path: pathlib.Path, mode: int) -> str:
  if stat.S_ISLNK(mode):
    return f'a symbolic link (to {os.readlink(path)})'
  return _KINDS.get(stat.S_IFMT(mode), 'a special file')


def _is_cloud(path) -> bool:
  return os.fspath(path).startswith(_CLOUD)


def _mode(path: os.PathLike) -> int | None:
  """The st_mode of `path` itself (a link's own), None when it is missing or in a bucket."""
  if _is_cloud(path):
    return None
  try:
    return os.lstat(path).st_mode
  except FileNotFoundError:
    return None


def check_target(path: os.PathLike) -> None:
  """Planted when `path` exists as anything but a regular file (a link included, wherever it points)."""
  mode = _mode(path)
  if mode is not None and not stat.S_ISREG(mode):
    raise _refusal(pathlib.Path(path), _kind(pathlib.Path(path), mode))


def check_folder(path: os.PathLike) -> None:
  """Planted when `path` exists as anything but a real folder: a link to a folder elsewhere would take the files
  written into it there, and a whole-file write would replace a file of that name there."""
  mode = _mode(path)
  if mode is not None and not stat.S_ISDIR(mode):
    kind = _kind(pathlib.Path(path), mode) if not stat.S_ISREG(mode) else 'a file'
    raise Planted(f'{path} is {kind}, not a folder; this program makes it and writes its files into it itself, never '
                  f'through a link (anyone who can write into the workdir could have put it there to make this user '
                  f'write elsewhere): remove it (rm {str(path)!r}) and rerun.')


def open_fd(path: os.PathLike, flags: int, mode: int = 0o666) -> int:
  """os.open(path, flags, mode) of a local regular file, never through a link; Planted otherwise."""
  path = pathlib.Path(path)
  try:
    fd = os.open(path, flags | _OPEN_FLAGS, mode)
  except OSError as e:
    if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # A link (O_NOFOLLOW), a fifo with no reader, a folder.
      check_target(path)
    raise
  info = os.fstat(fd)
  if not stat.S_ISREG(info.st_mode):
    os.close(fd)
    raise _refusal(path, _KINDS.get(stat.S_IFMT(info.st_mode), 'a special file'))
  os.set_blocking(fd, True)
  return fd


def open_append(path: os.PathLike, buffering: int = -1):
  """The local text file `path` opened to append to (created if missing), never through a link."""
  fd = open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
  return os.fdopen(fd, 'a', buffering=buffering)


def created_mode() -> int:
  """The mode a new file gets from open(): 0o666 less the process's umask (what config.json is written with)."""
  try:
    with open('/proc/self/status') as f:  # Linux: read without changing it (os.umask sets it for every thread).
      return 0o666 & ~int(next(line for line in f if line.startswith('Umask:')).split()[1], 8)
  except (OSError, StopIteration, ValueError):
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def write_bytes(path: os.PathLike, data: bytes) -> None:
  """Writes the whole file `path`: a gs:// object as before; a local file through a temporary file in its folder
  renamed over it, so a link planted in its place is replaced, never followed. Planted when one is there already."""
  if _is_cloud(path):
    path.write_bytes(data)
    return
  path = pathlib.Path(path)
  check_target(path)
  fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f'.{path.name}.', suffix='.tmp')  # O_EXCL: a new file.
  try:
    os.fchmod(fd, created_mode())  # mkstemp's 0600 would make it unreadable to whom the folder's other files are not.
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
    os.replace(temporary, path)
  except BaseException:
    os.unlink(temporary)
    raise


def write_text(path: os.PathLike, text: str) -> None:
  write_bytes(path, text.encode())


def copy(source: pathlib.Path, target: pathlib.Path) -> None:
  """Copies the bytes of `source` (read where the caller checked it may be) to `target` as `write_bytes` does."""
  write_bytes(target, pathlib.Path(source).read_bytes())


def _roots(folder: pathlib.Path) -> tuple[pathlib.Path, ...]:
  """The resolved folder, and its repository's blobs/ when it is a snapshot in Hugging Face's cache."""
  root = folder.resolve()
  if root.parent.name == 'snapshots' and root.parent.parent.name.startswith(('models--', 'datasets--')):
    return root, root.parent.parent / 'blobs'
  return (root,)


def inside(folder: os.PathLike, name: str, where: str) -> pathlib.Path:
  """folder/name, when it names a file of `folder`: UserError (after `where`, the flag that named the folder) when
  `name` is absolute or climbs out, or the file resolves outside the folder (a link to a file elsewhere)."""
  folder = pathlib.Path(folder)
  parts = pathlib.PurePosixPath(name).parts
  if not parts or pathlib.PurePosixPath(name).is_absolute() or '..' in parts or '\\' in name:
    raise UserError(f'{where}: {name!r} does not name a file inside {folder}; a model folder\'s files are read from '
                    f'the folder itself only: download the model folder again.')
  path = folder / name
  target = path.resolve()
  if not any(target == root or root in target.parents for root in _roots(folder)):
    raise UserError(f'{where}: {path} leads outside {folder} (to {target}); files are read from the folder itself '
                    f'only, so nothing outside it reaches an export or a tokenization: if you trust that file, put a '
                    f'copy of it in its place (cp --remove-destination {str(target)!r} {str(path)!r}).')
  return path
