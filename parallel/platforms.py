"""Which of jax's backends a launch starts: the TPU runtime only on a machine that has TPU chips.

With libtpu installed (requirements-tpu-plan.txt, for `--plan --topology=v5p:...`), jax tries its TPU backend on
every launch, before the CPU or GPU one. On a machine without TPU chips libtpu then prints five lines to stderr
("could not determine TPU accelerator type", "E0000 ... INVALID_ARGUMENT: Error: unexpected worker hostname") and jax
falls back quietly: the run is fine, but the lines read as a failure and bury a one-line config error under them.
jax already skips its CUDA backend where no NVIDIA GPU is visible; `skip_absent_tpu` does the same for the TPU, with
jax's own chip count (the one its cloud_tpu_init uses). tests/test_first_launch.py checks both the choice and, where
libtpu is installed, that a CPU launch prints none of those lines.
"""

import dataclasses
import os


def skip_absent_tpu() -> bool:
  """Keeps jax from starting libtpu where no TPU chip is present; returns whether it did.

  Call before anything asks jax for devices. Leaves jax's own choice alone where the user made one
  (JAX_PLATFORMS, JAX_FORCE_TPU_INIT).
  """
  if os.environ.get('JAX_PLATFORMS') or 'JAX_FORCE_TPU_INIT' in os.environ:
    return False
  try:  # jax internals: where a later jax moved them, the lines come back and nothing else changes.
    from jax._src import hardware_utils, xla_bridge  # pylint: disable=import-outside-toplevel
    if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
      return False
    factories = xla_bridge._backend_factories  # pylint: disable=protected-access
  except (ImportError, AttributeError):
    return False
  if 'tpu' not in factories:
    return False
  # Replaced, not removed: 'tpu' must stay a known platform (modules register TPU lowering rules as they import).
  # jax reads the factory only when it first starts its backends, and tries TPU quietly: this one's error is a debug
  # record, and the CPU or GPU backend is chosen as it would have been after libtpu's failed start.
  factories['tpu'] = dataclasses.replace(factories['tpu'], factory=_no_tpu_chips, fail_quietly=True)
  return True


def _no_tpu_chips():
  raise RuntimeError('no TPU chips on this machine (parallel/platforms.py did not start libtpu)')
