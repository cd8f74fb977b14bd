"""How the pure train and eval steps run over the mesh.

'jit' hands NamedShardings for the state and batch to the compiler and lets
GSPMD partition the step; the state is donated so its buffers are reused for
the new state. Other strategies wrap the same step functions.
"""

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from parallel import sharding

STRATEGIES = ('jit',)


def partition_train_step(strategy: str, train_step: Callable[..., Any], mesh: Mesh, state_shardings: Any,
                         batch_sharding: NamedSharding) -> Callable[..., Any]:
  """The jitted `(state, batch) -> (state, metrics)`; metrics come back replicated."""
  if strategy != 'jit':
    raise ValueError(f'unknown strategy {strategy!r}')  # validation rejects these earlier
  return jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                 out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0)


def partition_eval_step(strategy: str, eval_step: Callable[..., Any], mesh: Mesh, params_shardings: Any,
                        batch_sharding: NamedSharding) -> Callable[..., Any]:
  if strategy != 'jit':
    raise ValueError(f'unknown strategy {strategy!r}')
  return jax.jit(eval_step, in_shardings=(params_shardings, batch_sharding), out_shardings=sharding.replicated(mesh))
