"""The typed train state, and how it is created already sharded.

Parameters and optimizer state are never materialized whole on one host:
`jax.eval_shape` gives the abstract state with its logical axes, the rules turn
those into NamedShardings, and one jitted init writes every shard in place.
Parameters come from the task's model (trainer/models/adapters.py) as a plain
nested dict, whether Flax NNX or Linen built them.
"""

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from parallel import sharding
from trainer.base.errors import UserError
from trainer.models import lora
from trainer.models.adapters import AdaptedModel
from trainer.training import optimizer

PARAMS_CHOICES = ('raw', 'ema')


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken.
  params: Any  # The model's parameter tree (plain arrays, no metadata boxes).
  opt_state: optax.OptState
  rng: jax.Array  # uint32[2] key for any randomness in the step (e.g. dropout).
  # train.ema_decay > 0: a float32 exponential moving average of the parameters,
  # sharded like them (mapped over their boxes) and checkpointed with the state.
  ema_params: Any = None
  ema_decay: float = flax.struct.field(pytree_node=False, default=0.0)
  # train.objective='dpo': the starting parameters, frozen (never updated, no optimizer state), sharded like the
  # parameters and checkpointed with the state, so a resume compares with the same reference (docs/dpo.md).
  reference_params: Any = None


def _init_boxed(seed: jax.Array, model: AdaptedModel, tx: optax.GradientTransformation,
                ema_decay: float = 0.0, params=None, reference: bool = False) -> TrainState:
  """The initial state with Flax's logical-axis boxes still on the parameter leaves.

  The parameters come from `jax.random.key(seed)` itself (see adapters.py), so a
  user's own loop reproduces them, unless `params` are given (imported weights);
  the step's key is folded off it.
  """
  key = jax.random.key(seed)
  if params is not None and lora.has_adapters(model.abstract_params) and not lora.has_adapters(params):
    # Imported base weights: the adapters start from their init (b = 0); under jit the unused base init is dropped.
    params = lora.fill_adapters(params, model.init(key))
  params = model.box(model.init(key) if params is None else params)
  # optax maps over the boxes, so Adam's moments inherit the parameters' logical axes.
  ema = jax.tree.map(lambda p: p.astype(jnp.float32), params) if ema_decay else None
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                    rng=jax.random.key_data(jax.random.fold_in(key, 1)), ema_params=ema, ema_decay=ema_decay,
                    reference_params=jax.tree.map(jnp.copy, params) if reference else None)


def abstract_state(model: AdaptedModel, tx, mesh: Mesh, rules, ema_decay: float = 0.0,
                   reference: bool = False) -> tuple[TrainState, TrainState]:
  """(abstract state, its NamedShardings), both as TrainState trees; nothing is allocated."""
  # From the adapter's abstract parameters: tracing the model's init again here cost a launch of the tiny model 0.15 s.
  boxed = jax.eval_shape(lambda s, p: _init_boxed(s, model, tx, ema_decay, p, reference), jnp.zeros((), jnp.uint32),
                         model.abstract_params)
  boxed = boxed.replace(opt_state=optimizer.fit_state_axes(boxed.opt_state))
  shardings = sharding.tree_shardings(boxed, mesh, rules)
  return nn.meta.unbox(boxed), shardings


def create_state(seed: int, model: AdaptedModel, tx, shardings: TrainState, ema_decay: float = 0.0,
                 params=None, reference: bool = False) -> TrainState:
  """Initializes the state directly into its shardings; `params` (already in shardings.params, e.g. a published
  model's weights from trainer/hf/) replace the random init and are donated to the state."""
  seed = jnp.asarray(seed, jnp.uint32)
  if params is None:
    return jax.jit(lambda s: nn.meta.unbox(_init_boxed(s, model, tx, ema_decay, reference=reference)),
                   out_shardings=shardings)(seed)
  init = jax.jit(lambda s, p: nn.meta.unbox(_init_boxed(s, model, tx, ema_decay, p, reference)), out_shardings=shardings,
                 donate_argnums=1)
  return init(seed, params)


def params_of(state: TrainState, which: str = 'raw') -> Any:
  """The parameters as trained ('raw'), or ('ema') their average cast to the parameters' dtypes: what eval,
  scripts/sample.py and the exports use."""
  if which not in PARAMS_CHOICES:
    raise UserError(f'--params={which!r}: give one of {", ".join(PARAMS_CHOICES)}.')
  if which == 'raw':
    return state.params
  if state.ema_params is None:
    raise UserError("--params=ema: this run kept no parameter average (it was trained with train.ema_decay=0); "
                    "use --params=raw, or train with --config.train.ema_decay=0.999.")
  return jax.tree.map(lambda e, p: e.astype(p.dtype), state.ema_params, state.params)
