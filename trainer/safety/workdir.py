"""The --workdir, checked before anything is compiled or written: a writable local (or mounted) folder.

Writing checkpoints to a bucket URL (gs://, s3://) is not supported yet: such a
path is refused by its scheme, so nothing named `./gs:` is ever created and no
compile is wasted. A mounted bucket (gcsfuse, s3fs) is a local path and works.
"""

import os
import pathlib
import re
import socket

from trainer.errors import UserError

_URL = re.compile(r'^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*):/')


def check(workdir: str) -> pathlib.Path:
  """Creates `workdir` if needed and proves it writable; returns it absolute. Raises UserError otherwise."""
  match = _URL.match(workdir)
  if match:
    raise UserError(f'--workdir={workdir}: {match["scheme"]}:// paths are not supported yet; use a local folder, or '
                    f'mount the bucket (e.g. gcsfuse) and give the mounted path.')
  path = pathlib.Path(workdir).expanduser().absolute()
  existing = next((p for p in (path, *path.parents) if p.exists()), None)
  if existing is not None and not existing.is_dir():
    what = 'is a file' if existing == path else f'is inside {existing}, which is a file'
    raise UserError(f'--workdir={workdir} {what}, not a folder; choose a folder (it is created if missing).')
  try:
    path.mkdir(parents=True, exist_ok=True)
    # Every process probes with its own name: processes on one host (or sharing a file system) do not collide.
    probe = path / f'.write_probe.{socket.gethostname()}.{os.getpid()}'
    probe.write_bytes(b'')
    probe.unlink()
  except OSError as e:
    raise UserError(f'--workdir={workdir} is not writable by this user ({e.strerror}: {e.filename}); fix its '
                    f'permissions or choose another folder.') from e
  return path
