"""An out-of-memory while training, after pre-flight approved the step: one line and exit 2, never a retry.

The same step on the same devices asks for the same memory again, so a restart
cannot help (the supervisor does not retry exit 2). The line says what the
device was asked for (XLA's figure), what pre-flight approved (the compiled
step's figure against the limit) and what to change.
"""

import re

import jax

from trainer.base.errors import UserError
from trainer.memory import footprint

# XLA's allocator: 'Out of memory while trying to allocate 34.48GiB with allocator GPU_0_bfc'.
_ALLOCATION = re.compile(r'(?:trying to allocate|allocating)\s+([\d.]+)\s*([KMGT]i?B|B)\b')
_UNITS = {'B': 1, 'KiB': 2**10, 'MiB': 2**20, 'GiB': 2**30, 'TiB': 2**40, 'KB': 2**10, 'MB': 2**20, 'GB': 2**30,
          'TB': 2**40}


def requested_bytes(text: str) -> int | None:
  """The allocation XLA's message names, in bytes; None if it names none."""
  found = _ALLOCATION.search(text)
  return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else None


def diagnosis(stats: dict | None, asked: int | None, arguments: int | None) -> str:
  """What the allocator held when the allocation failed (a GPU's `memory_stats()`), and which of the two causes
  pre-flight cannot see it shows: the free memory split into blocks smaller than the request (fragmentation: XLA
  asks for all of a step's temporaries as ONE block, which on moe_1b b8 for an H100 is 47% of the pool), or more
  live than the step's arguments (a second copy of something). '' where the backend reports no such figures."""
  if not stats or asked is None or 'bytes_in_use' not in stats or 'bytes_limit' not in stats:
    return ''
  in_use, limit, largest = stats['bytes_in_use'], stats['bytes_limit'], stats.get('largest_free_block_bytes')
  parts = [f'{footprint.gib(in_use)} in use of {footprint.gib(limit)}']
  if largest is not None:
    parts.append(f'largest free block {footprint.gib(largest)}')
  if in_use + asked <= limit and largest is not None and largest < asked:
    cause = 'the free memory was there but split into smaller blocks (fragmentation)'
  elif arguments is not None and in_use > arguments * 1.05:
    cause = f'more was live than the step\'s {footprint.gib(arguments)} of inputs'
  else:
    cause = 'the step asked for more than was free'
  return f' At the failure the allocator had {", ".join(parts)}: {cause}.'


def explain(error: BaseException, compiled, train, devices) -> UserError | None:
  """A UserError (exit 2) for a device out-of-memory raised while `compiled` (the approved step) trained; None for
  any other error. `compiled` may be None when the error came before the step was compiled."""
  from trainer.observe import profiling
  if not profiling.is_out_of_memory(error) or isinstance(error, UserError):
    return None
  asked = requested_bytes(str(error))
  need = f'one allocation of {footprint.gib(asked)}' if asked else 'more memory than the device had left'
  limit = footprint.device_limit(train.device_memory_gb, devices)
  local = [d for d in devices if getattr(d, 'process_index', 0) == jax.process_index()]
  stats = max((d.memory_stats() or {} for d in local), key=lambda x: x.get('bytes_in_use', 0), default=None)
  arguments = compiled.memory_analysis().argument_size_in_bytes if compiled is not None else None
  seen = diagnosis(stats, asked, arguments)
  if compiled is not None:
    approved = (f'pre-flight approved {footprint.gib(footprint.compiled_bytes(compiled))} per device of '
                f'{footprint.gib(limit.bytes) if limit.bytes else "an unknown limit"} ({limit.source}).{seen}')
  else:
    approved = f'before the train step was compiled and checked.{seen}'
  batch = train.batch_size
  smaller = f'--config.train.batch_size={batch // 2}' if batch > 1 else 'a smaller model'
  explained = UserError(
      f'out of memory while training: the device was asked for {need}; {approved} The step needs more than '
      f'pre-flight counted (trainer/memory/runtime_oom.py): rerun with {smaller} or '
      f"--config.train.remat_policy=full, or set train.device_memory_gb below the device's memory to make "
      f'pre-flight stricter. Checkpoints on disk are intact; a restart would fail the same way, so none was made.')
  explained.__cause__ = error
  return explained


def after_first_step(compiled, outputs) -> str | None:
  """Once the first step has finished (`outputs` computed): `allocator_line` for the devices holding them, logged
  (a warning when no free block is as large as the next step's temporaries)."""
  from absl import logging
  if not hasattr(compiled, 'memory_analysis'):
    return None
  devices = {d for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array) for d in x.devices()}
  temp = compiled.memory_analysis().temp_size_in_bytes
  line = allocator_line(temp, [d.memory_stats() for d in devices if d.process_index == jax.process_index()])
  if line:
    (logging.warning if 'No free block' in line else logging.info)('%s', line)
  return line


def allocator_line(temp: int, stats: list[dict | None]) -> str | None:
  """The fullest device's allocator after step 1 against the ONE block of `temp` bytes each step asks for; None
  where the backend reports no such figures (the CPU)."""
  if not stats or not all(s and 'largest_free_block_bytes' in s and 'bytes_in_use' in s for s in stats):
    return None
  worst = min(stats, key=lambda s: s['largest_free_block_bytes'])
  line = (f'After step 1: {footprint.gib(worst["bytes_in_use"])} in use, largest free block '
          f'{footprint.gib(worst["largest_free_block_bytes"])}; each step asks for its temporaries as one block of '
          f'{footprint.gib(temp)}.')
  if worst['largest_free_block_bytes'] < temp:
    line += ' No free block is that large: the next step will run out of memory (fragmentation).'
  return line
