"""What a compiled train step needs per device, what a device has, and the verdict comparing the two.

One formula for the step's peak (used by plan mode, the pre-flight check and
remat 'auto'): arguments + outputs not aliased to donated inputs + temporaries +
generated code, from `compiled.memory_analysis()`. On the H100 plan mode's
figure for llama_1b at batch 16 (47.62 GiB) matched the run's measured peak to
0.01 GiB (shared/GPU.md).
"""

import dataclasses
import re
from collections.abc import Sequence

import jax

GIB = 2**30
# Free memory below this fraction of the limit: the pre-flight warns, and remat 'auto' does not count it as a fit
# (allocator fragmentation and the data pipeline's device buffers come on top of the compiled step).
MARGIN = 0.05
# XLA's TPU compiler refuses a step that cannot fit instead of returning its memory analysis.
_HBM_OOM = re.compile(r'CompileTimeHbmOom.*?required for HLO temporaries \(([\d.]+)([KMGT])\).*?'
                      r'available HBM \(([\d.]+)([KMGT])\)', re.S)
_UNITS = {'K': 2**10, 'M': 2**20, 'G': 2**30, 'T': 2**40}


def step_bytes(argument: int, output: int, alias: int, temp: int, code: int) -> int:
  """Peak bytes per device while the step runs: inputs, outputs not aliased to them, temporaries, code."""
  return argument + output - alias + temp + code


def compiled_bytes(compiled) -> int:
  """`step_bytes` of a compiled step's `memory_analysis()`."""
  m = compiled.memory_analysis()
  return step_bytes(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                    m.temp_size_in_bytes, m.generated_code_size_in_bytes)


class CompilerRefused(Exception):
  """The compiler itself found that the step cannot fit (XLA TPU's CompileTimeHbmOom)."""

  def __init__(self, needed_bytes: int, available_bytes: int, text: str):
    super().__init__(text)
    self.needed_bytes, self.available_bytes = needed_bytes, available_bytes


def compile_step(job):
  """`job.compile_train_step()`, with the TPU compiler's out-of-memory refusal raised as CompilerRefused."""
  try:
    return job.compile_train_step()
  except jax.errors.JaxRuntimeError as e:
    found = _HBM_OOM.search(str(e))
    if not found:
      raise
    needed = float(found.group(1)) * _UNITS[found.group(2)]
    available = float(found.group(3)) * _UNITS[found.group(4)]
    raise CompilerRefused(int(needed), int(available), ' '.join(str(e).split())[:300]) from e


@dataclasses.dataclass(frozen=True)
class Limit:
  """Bytes one device may use (the smallest over the devices), and where that figure comes from."""
  bytes: int | None  # None: unknown (a backend that reports none, and train.device_memory_gb unset).
  source: str


def device_limit(memory_gb: float | None, devices: Sequence[jax.Device]) -> Limit:
  """`train.device_memory_gb` (`memory_gb`) when set, else the smallest `bytes_limit` the local devices report, else
  unknown.

  The setting wins over the device's own figure, so a user can hold memory back (a shared GPU); the CPU
  backend reports no limit at all (memory_stats() is None), so there the setting is the only source.
  """
  gb = memory_gb
  if gb is not None:
    return Limit(int(gb * GIB), f'train.device_memory_gb={gb:g}')
  local = [d for d in devices if d.process_index == jax.process_index()]
  limits = [(d.memory_stats() or {}).get('bytes_limit') for d in local]
  if local and all(limits):
    return Limit(min(limits), f"the {local[0].device_kind} devices' reported bytes_limit")
  return Limit(None, f'no limit known: {local[0].platform if local else "these"} devices report none and '
                     f'train.device_memory_gb is unset')


def fits(needed: int, limit: int, margin: float = 0.0) -> bool:
  return needed <= limit * (1 - margin)


def gib(n: float) -> str:
  """Bytes in the largest binary unit that keeps three significant digits in view."""
  for unit, size in (('GiB', GIB), ('MiB', 2**20), ('KiB', 2**10)):
    if abs(n) >= size:
      return f'{n / size:,.2f} {unit}'
  return f'{n:,.0f} B'


def verdict(needed: int, limit: Limit) -> str:
  """One line: fits, fits with little margin, or does not fit."""
  if limit.bytes is None:
    return f'Memory: {gib(needed)} per device; not checked ({limit.source}).'
  free = 1 - needed / limit.bytes
  if needed > limit.bytes:
    return f'Does not fit: {gib(needed)} per device, over the {gib(limit.bytes)} available ({limit.source}).'
  if free < MARGIN:
    return (f'Fits with little margin: {gib(needed)} of {gib(limit.bytes)} per device ({free:.1%} free, under '
            f'{MARGIN:.0%}; {limit.source}): fragmentation or the input pipeline may still run out.')
  return f'Fits: {gib(needed)} of {gib(limit.bytes)} per device ({free:.0%} free; {limit.source}).'
