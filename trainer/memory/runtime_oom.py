"""An out-of-memory while training, after pre-flight approved the step: one line and exit 2, never a retry.

The same step on the same devices asks for the same memory again, so a restart
cannot help (the supervisor does not retry exit 2). The line says what the
device was asked for (XLA's figure), what pre-flight approved (the compiled
step's figure against the limit) and what to change.
"""

import re

from trainer.errors import UserError
from trainer.memory import footprint

# XLA's allocator: 'Out of memory while trying to allocate 34.48GiB with allocator GPU_0_bfc'.
_ALLOCATION = re.compile(r'(?:trying to allocate|allocating)\s+([\d.]+)\s*([KMGT]i?B|B)\b')
_UNITS = {'B': 1, 'KiB': 2**10, 'MiB': 2**20, 'GiB': 2**30, 'TiB': 2**40, 'KB': 2**10, 'MB': 2**20, 'GB': 2**30,
          'TB': 2**40}


def requested_bytes(text: str) -> int | None:
  """The allocation XLA's message names, in bytes; None if it names none."""
  found = _ALLOCATION.search(text)
  return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else None


def explain(error: BaseException, compiled, config, devices) -> UserError | None:
  """A UserError (exit 2) for a device out-of-memory raised while `compiled` (the approved step) trained; None for
  any other error. `compiled` may be None when the error came before the step was compiled."""
  from trainer import profiling
  if not profiling.is_out_of_memory(error) or isinstance(error, UserError):
    return None
  asked = requested_bytes(str(error))
  need = f'one allocation of {footprint.gib(asked)}' if asked else 'more memory than the device had left'
  limit = footprint.device_limit(config, devices)
  if compiled is not None:
    approved = (f'pre-flight approved {footprint.gib(footprint.compiled_bytes(compiled))} per device of '
                f'{footprint.gib(limit.bytes) if limit.bytes else "an unknown limit"} ({limit.source})')
  else:
    approved = 'before the train step was compiled and checked'
  batch = config.train.batch_size
  smaller = f'--config.train.batch_size={batch // 2}' if batch > 1 else 'a smaller model'
  explained = UserError(
      f'out of memory while training: the device was asked for {need}; {approved}. The step needs more than '
      f'pre-flight counted (trainer/memory/runtime_oom.py): rerun with {smaller} or '
      f"--config.train.remat_policy=full, or set train.device_memory_gb below the device's memory to make "
      f'pre-flight stricter. Checkpoints on disk are intact; a restart would fail the same way, so none was made.')
  explained.__cause__ = error
  return explained
