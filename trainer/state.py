"""The typed train state, and how it is created already sharded.

Parameters and optimizer state are never materialized whole on one host:
`jax.eval_shape` gives the abstract state with its logical axes, the rules turn
those into NamedShardings, and one jitted init writes every shard in place.
"""

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from parallel import sharding


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken.
  params: Any  # The model's parameter tree (plain arrays, no metadata boxes).
  opt_state: optax.OptState
  rng: jax.Array  # uint32[2] key for any randomness in the step (e.g. dropout).


def _init_boxed(rng: jax.Array, model: nn.Module, tx: optax.GradientTransformation,
                example_tokens: jax.ShapeDtypeStruct) -> TrainState:
  """The initial state with Flax's logical-axis boxes still on the parameter leaves."""
  init_rng, state_rng = jax.random.split(rng)
  params = model.init(init_rng, jnp.zeros(example_tokens.shape, example_tokens.dtype))['params']
  # optax maps over the boxes, so Adam's moments inherit the parameters' logical axes.
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=state_rng)


def abstract_state(model, tx, example_tokens, mesh: Mesh, rules) -> tuple[TrainState, TrainState]:
  """(abstract state, its NamedShardings), both as TrainState trees; nothing is allocated."""
  boxed = jax.eval_shape(lambda r: _init_boxed(r, model, tx, example_tokens), jax.random.PRNGKey(0))
  shardings = sharding.tree_shardings(boxed, mesh, rules)
  return nn.meta.unbox(boxed), shardings


def create_state(seed: int, model, tx, example_tokens, shardings: TrainState) -> TrainState:
  """Initializes the state directly into its shardings."""
  init = jax.jit(lambda r: nn.meta.unbox(_init_boxed(r, model, tx, example_tokens)), out_shardings=shardings)
  return init(jax.random.PRNGKey(seed))
