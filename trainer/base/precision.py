"""The compute dtype a config asks for, shared by every model builder."""

import jax
import jax.numpy as jnp


def compute_dtype(name: str, platform: str | None = None) -> jnp.dtype:
  """The dtype train.compute_dtype `name` stands for: every use of the setting outside the config goes through here.

  'auto' is bfloat16 on accelerators and float32 on CPU, where bfloat16 is
  emulated and slower; `platform` (a mesh's) is read instead of this host's
  default backend where given (a plan for a TPU made on a laptop).
  """
  if name == 'auto':
    return jnp.dtype(jnp.float32 if (platform or jax.default_backend()) == 'cpu' else jnp.bfloat16)
  return jnp.dtype(name)
