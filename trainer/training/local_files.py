"""A local-tier step's files (trainer/training/local_tier.py): written as new files, never through a link; read back
checked, since the tier is a cache anyone with the host can damage: a step folder that is a real folder, a meta.json
that parses and names its step, a manifest.json that parses as the run's manifest (trainer/training/manifest.py: what
a resume checks the launch against), and shard files that are regular files holding every expected block at its
shape and dtype (a truncated or flipped byte fails the zip's CRC as the data is read). What fails is `Unusable`, in
words: the tier treats that copy as missing. Entries are removed without following a link (a link's target is never
touched).
"""

import json
import os
import pathlib
import shutil
import stat
import zipfile
from typing import Any

import jax
import numpy as np

from trainer.base import confined
from trainer.training import peer_copy

META_KEYS = ('step', 'data', 'layout', 'peer_layout', 'peer_in_own')
# What a resume reads of a step's manifest.json (trainer/training/manifest.py: check_resume), each a dict.
MANIFEST_KEYS = ('model', 'param_shapes', 'config')


class Unusable(Exception):
  """A local copy that cannot be used, and why (a line's clause)."""


def make_folder(root: pathlib.Path, folder: pathlib.Path) -> None:
  """Makes `folder` (and its run folder) under `root`, 0700, refusing a link or a file planted at either."""
  if root.exists() and not root.is_dir():
    raise NotADirectoryError(f'{root} is not a folder')
  root.mkdir(parents=True, exist_ok=True)  # A local SSD's folder may be new; a RAM disk's mount point is there.
  for path in (folder.parent, folder):
    confined.check_folder(path)
    try:
      os.mkdir(path, 0o700)
    except FileExistsError:
      confined.check_folder(path)  # Made between the check and here: still never a link.
  probe = folder / f'.probe-{os.getpid()}'
  write_file(probe, b'0')
  probe.unlink()


def write_file(path: pathlib.Path, data: bytes) -> None:
  fd = confined.open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # A new file, never through a link.
  with os.fdopen(fd, 'wb') as f:
    f.write(data)


def write_npz(path: pathlib.Path, arrays: dict[str, np.ndarray]) -> None:
  fd = confined.open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, 'wb') as f:
    np.savez(f, **arrays)


def is_folder(path: pathlib.Path) -> bool:
  """Whether `path` itself is a folder: a link to one is not."""
  try:
    return stat.S_ISDIR(os.lstat(path).st_mode)
  except OSError:
    return False


def is_file(path: pathlib.Path) -> bool:
  """Whether `path` itself is a regular file: a link to one is not."""
  return _kind(path) is None


def entries(folder: pathlib.Path | None) -> list[tuple[int, pathlib.Path]]:
  """(step, path) of every step-named entry of a process's folder, oldest first, whatever each is."""
  if folder is None or not (is_folder(folder.parent) and is_folder(folder)):  # A planted link is not listed through.
    return []
  return sorted((int(p.name), p) for p in folder.iterdir() if p.name.isdigit())


def remove(path: pathlib.Path) -> None:
  """Removes a step entry: a real folder with what is in it (links in it unlinked, not followed), anything else
  unlinked; never what a link points at."""
  if is_folder(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    try:
      os.unlink(path)
    except FileNotFoundError:
      pass


def _kind(path: pathlib.Path) -> str | None:
  """What `path` is when it is not a regular file, in words; None for a regular file."""
  try:
    mode = os.lstat(path).st_mode
  except FileNotFoundError:
    return 'missing'
  if stat.S_ISREG(mode):
    return None
  if stat.S_ISLNK(mode):
    return f'a symbolic link (to {os.readlink(path)})'
  return 'a folder' if stat.S_ISDIR(mode) else 'a special file'


def read_meta(folder: pathlib.Path, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
  """The step folder's meta.json and manifest.json; Unusable when the folder or a file is not what the tier wrote (a
  step saved before the tier kept manifests has none: it cannot be checked against the launch, so it is not used)."""
  if not is_folder(folder):
    raise Unusable(f'{_kind(folder)}, not a folder')
  meta, manifest = _read_json(folder / 'meta.json'), _read_json(folder / 'manifest.json')
  if not isinstance(meta, dict) or any(k not in meta for k in META_KEYS) or meta['step'] != step:
    raise Unusable('its meta.json is not the one the tier wrote for this step')
  if not isinstance(manifest, dict) or not all(isinstance(manifest.get(k), dict) for k in MANIFEST_KEYS):
    raise Unusable('its manifest.json is not a run manifest')
  return meta, manifest


def _read_json(path: pathlib.Path) -> Any:
  kind = _kind(path)
  if kind:
    raise Unusable(f'its {path.name} is {kind}')
  try:
    with os.fdopen(confined.open_fd(path, os.O_RDONLY), 'rb') as f:
      return json.loads(f.read())
  except (OSError, ValueError, confined.Planted) as e:
    raise Unusable(f'its {path.name} cannot be read ({why(e)})') from None


def read_shards(path: pathlib.Path, expected: dict[str, tuple[tuple[int, ...], np.dtype]]) -> dict[str, np.ndarray]:
  """Every block of `expected` ({key: (shape, dtype)}) from the .npz `path`; Unusable when it is not a regular file
  (never opened through a link), not an intact .npz, or lacks a block or holds one of another shape or dtype."""
  kind = _kind(path)
  if kind:
    raise Unusable(kind)
  try:
    with os.fdopen(confined.open_fd(path, os.O_RDONLY), 'rb') as f:
      loaded = np.load(f, allow_pickle=False)  # Never unpickled.
      if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise Unusable('not an .npz file')
      with loaded:
        blocks = {name: loaded[name] for name in loaded.files}  # Each read whole: its CRC checked.
  except (OSError, ValueError, EOFError, zipfile.BadZipFile, confined.Planted) as e:
    raise Unusable(f'truncated or corrupt: {why(e)}') from None
  missing = sorted(set(expected) - set(blocks))
  if missing:
    raise Unusable(f'{len(missing)} of its {len(expected)} blocks missing (block {missing[0]} first)')
  for name, (shape, dtype) in expected.items():
    block = blocks[name]
    # np.savez keeps bfloat16 as raw 2-byte values ('V2').
    if block.shape != shape or not (block.dtype == dtype or (block.dtype.kind == 'V'
                                                             and block.dtype.itemsize == dtype.itemsize)):
      raise Unusable(f'block {name} is {block.dtype}{list(block.shape)}, not {dtype}{list(shape)}')
  return {name: blocks[name] for name in expected}


def expected_blocks(state) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
  """{key: (shape, dtype)} of every block this process's devices hold of `state` (leaves with shardings)."""
  out = {}
  for i, leaf in enumerate(jax.tree.leaves(state)):
    for index in leaf.sharding.addressable_devices_indices_map(leaf.shape).values():
      shape = tuple(len(range(*s.indices(d))) for s, d in zip(index, leaf.shape))
      out[peer_copy.key(i, index, leaf.shape)] = (shape, np.dtype(leaf.dtype))
  return out


def why(error: BaseException) -> str:
  if isinstance(error, OSError) and error.strerror:
    return f'{error.strerror}: {error.filename}' if error.filename else error.strerror
  return ' '.join(str(error).split())[:200] or type(error).__name__
