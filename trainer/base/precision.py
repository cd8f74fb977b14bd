"""The compute dtype a config asks for, shared by every model builder."""

import jax
import jax.numpy as jnp


def compute_dtype(name: str) -> jnp.dtype:
  """'auto' is bfloat16 on accelerators and float32 on CPU, where bfloat16 is emulated and slower."""
  if name == 'auto':
    return jnp.float32 if jax.default_backend() == 'cpu' else jnp.bfloat16
  return jnp.dtype(name)
