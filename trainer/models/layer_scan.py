"""Whether a model scans its blocks: `model.scan_layers` is True, False or 'auto' (the default).

Scanning runs one traced block over parameters stacked on a 'layers' axis, so
compile time stays flat in depth; unrolling lets XLA schedule and fuse across
blocks. Measured on XLA:CPU (BENCHMARKS.md, "The train step"): at 2 layers the
scan saves no compile time (22.7 vs 22.8 s) and costs 40% per step (200.6 vs
143.5 ms); at 16 layers it compiles in 16.3 s against 39.5 s unrolled.

'auto' therefore scans only deeper models (more than UNROLL_UP_TO_LAYERS
blocks). It looks at depth alone, not at the platform, on purpose: scanned and
unrolled models have differently shaped parameter trees, so a platform-dependent
choice would make a checkpoint written on a GPU unreadable by the same config on
a CPU (export, sampling, plan mode on a laptop).
"""

from trainer.base.errors import UserError

UNROLL_UP_TO_LAYERS = 4
VALUES = (True, False, 'auto')


def check(model_config) -> None:
  value = model_config.scan_layers
  if not (isinstance(value, bool) or value == 'auto'):
    raise UserError(f"model.scan_layers={value!r}: choose True (scan the blocks), False (unroll them) or 'auto' "
                    f'(scan only above {UNROLL_UP_TO_LAYERS} layers).')


def scans(model_config) -> bool:
  """Whether the model of `model_config` (config.model) scans its blocks; a bad value is a UserError."""
  check(model_config)
  if model_config.scan_layers == 'auto':
    return model_config.num_layers > UNROLL_UP_TO_LAYERS
  return model_config.scan_layers
