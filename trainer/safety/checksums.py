"""Checksums of a checkpoint's files: recorded when its save finishes, checked before it is restored.

Orbax's format verifies little of what it reads back: zarr3 puts a crc32c on
each shard's index, not on the chunk bytes, and the JSON items (the data
iterator's position, the run manifest) carry none. 64 overwritten bytes inside
the state's OCDBT data restored silently as other numbers (issue 54), and the
run stopped on a non-finite loss at every relaunch, never trying the intact
older step. So every file of a checkpoint gets a checksum in `checksums.json`
inside its step folder, written after Orbax has written everything else and
before it commits the folder (renames `<step>.orbax-checkpoint-tmp`, or writes
commit_success.txt in a bucket): a committed checkpoint has its checksums, or
was saved by an earlier version (restored unverified, with a debug line).

Local files get SHA-256 (hashlib, ~1.7 GB/s here; it releases the GIL, so the
hashing thread does not hold the step loop). A bucket already keeps a CRC32C of
every object, computed by Cloud Storage on upload and checked by it at rest:
there the record is those values, read from one listing, so neither the save
nor the check downloads the data; what it catches is an object replaced or
removed since the save.

Orbax updates `_CHECKPOINT_METADATA` (a commit time) and writes
commit_success.txt while committing, after the checksums: those two are left out.
"""

import base64
import hashlib
import json
import os

from absl import logging

from trainer.base import confined, storage

FILE = 'checksums.json'
# Written by Orbax after the checksums (see the docstring); neither holds the state, the data position or the manifest.
_CHANGED_AT_COMMIT = ('_CHECKPOINT_METADATA', 'commit_success.txt')
_CHUNK_BYTES = 16 << 20
_CLOUD = 'gcs-crc32c'


class Damaged(Exception):
  """A file of a checkpoint is missing or no longer holds what was saved."""


def record(folder: storage.Path) -> None:
  """Writes FILE in `folder` (a step folder whose save has written everything): every file's checksum."""
  algorithm, files = _digests(folder)
  text = json.dumps({'algorithm': algorithm, 'files': files}, indent=0, sort_keys=True)
  if storage.is_cloud(folder):
    (folder / FILE).write_text(text)  # One object write: it is there whole or not at all.
    return
  confined.write_text(folder / FILE, text)  # Whole, under a temporary name nobody can guess; never through a link.


def verify(folder: storage.Path) -> None:
  """Raises Damaged if a file of checkpoint `folder` is missing or changed since its save.

  A checkpoint without FILE (saved by an earlier version) passes, with a debug line.
  """
  listed = folder / FILE
  if not listed.exists():
    logging.debug('Checkpoint %s has no %s (saved by an earlier version): restored without verifying it.',
                  folder, FILE)
    return
  try:
    saved = json.loads(listed.read_text())
    algorithm, expected = saved['algorithm'], saved['files']
  except (ValueError, KeyError, TypeError) as e:
    raise Damaged(f'its {FILE} is unreadable ({type(e).__name__})') from None
  if (algorithm == _CLOUD) != storage.is_cloud(folder):  # Copied between a bucket and a disk: the other kind's record.
    logging.debug('Checkpoint %s was copied from %s: restored without verifying it.', folder,
                  'a bucket' if algorithm == _CLOUD else 'a local disk')
    return
  _, found = _digests(folder, only=set(expected), algorithm=algorithm)
  missing = sorted(name for name in expected if name not in found)
  changed = sorted(name for name, digest in expected.items() if name in found and found[name] != digest)
  if missing or changed:
    first, more = (missing or changed)[0], len(missing) + len(changed) - 1
    raise Damaged(f'{first} {"is missing" if missing else "does not match the checksum recorded when it was saved"}'
                  f'{f", and {more} more file(s) differ" if more else ""}')


def _digests(folder: storage.Path, only: set[str] | None = None,
             algorithm: str | None = None) -> tuple[str, dict[str, str]]:
  """(algorithm, {relative path: digest}) of the files under `folder`, or of those named in `only`."""
  if storage.is_cloud(folder):
    return _object_crc32cs(folder, only)
  algorithm = algorithm or 'sha256'
  if only is not None:
    paths = [folder / name for name in only if (folder / name).is_file()]
  else:
    paths = [p for p in folder.rglob('*') if p.is_file() and p.name != FILE
             and not (p.parent == folder and p.name in _CHANGED_AT_COMMIT)]
  return algorithm, {p.relative_to(folder).as_posix(): _file_digest(p, algorithm) for p in paths}


def _file_digest(file, algorithm: str) -> str:
  digest = hashlib.new(algorithm)
  with open(file, 'rb') as f:
    while chunk := f.read(_CHUNK_BYTES):
      digest.update(chunk)
  return digest.hexdigest()


def _object_crc32cs(folder: storage.Path, only: set[str] | None) -> tuple[str, dict[str, str]]:
  """The CRC32C Cloud Storage keeps for each object under `folder`, from one listing."""
  prefix = os.fspath(folder)[len(storage.SCHEME):].rstrip('/') + '/'
  fs = storage.filesystem()
  fs.invalidate_cache(prefix)  # Orbax wrote these through tensorstore, not gcsfs: its listing cache knows none.
  listing = fs.find(prefix, detail=True)
  found = {}
  for name, info in listing.items():
    relative = name[len(prefix):]
    if only is None and (relative == FILE or relative in _CHANGED_AT_COMMIT):
      continue
    if only is not None and relative not in only:
      continue
    crc = info.get('crc32c') or ''
    found[relative] = base64.b64decode(crc).hex() if crc else f'size {info.get("size")}'
  return _CLOUD, found
