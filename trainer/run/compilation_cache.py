"""The persistent XLA compilation cache (`train.compilation_cache_dir`): a relaunch reuses the compiled step.

The cache key covers the computation, the devices and the compiler flags, so a
changed config or mesh compiles afresh; a folder can be shared by every run of
a machine (or, on a shared filesystem, a cluster).
"""

import pathlib

import jax
from jax.experimental.compilation_cache import compilation_cache

from trainer.base.errors import UserError


def enable(cache_dir: str | None) -> None:
  """Points jax at `cache_dir` (created if missing); None leaves the cache off."""
  if not cache_dir:
    return
  path = pathlib.Path(cache_dir).expanduser().absolute()
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise UserError(f'train.compilation_cache_dir={cache_dir!r} cannot be created ({e.strerror}); '
                    f'give a writable folder, or None to disable the cache.') from e
  jax.config.update('jax_compilation_cache_dir', str(path))
  # jax's default skips programs that compile in under a second; a small model's step is one,
  # and on a busy host its compile still takes several.
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  # jax decides whether the cache is on at the process's first compile; start over in case one happened.
  compilation_cache.reset_cache()
