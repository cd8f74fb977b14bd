"""Routing balanced without a loss term: DeepSeek-V3's per-expert bias on the router's scores, moved by each step.

Each MoE layer keeps a float32 bias b (E,) that is added to the router's
probabilities to choose each token's top-k experts, and only to choose them:
the gating weights stay the unbiased probabilities, so the bias steers load
without entering the output or the gradient. After every step it moves by
`rate * sign(mean_load - load_e)`: an expert over its share becomes less likely
to be chosen, one under it more (DeepSeek-V3, arXiv 2412.19437, section 2.1.2,
where rate is the bias update speed gamma, 0.001 for most of its training).
`model.router_bias_rate` sets the rate; 0 (the default) keeps no bias.

Where the bias lives: in the parameters (`.../mlp/router_bias`, replicated,
read behind stop_gradient), so every reader of the parameters (eval, sampling,
the checkpoint, a resume) routes exactly as training does. It is not trained
by gradients: the layer computes its next value from the step's load and sows
it into the NEXT collection; the train step (trainer/training/step.py) writes
that value over whatever the optimizer made of the leaf. Gradient accumulation
and the per-device strategies average the sown value like a metric, so the
rate applies to the mean of the microbatches' (devices') signs.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

PARAM = 'router_bias'
NEXT = 'router_bias_next'  # The sown collection of next values; trainer/models/sown.py hands it to the step.


def choose(probs_TE, bias_E, k: int):
  """(top-k weights (T, K) renormalized, top-k experts (T, K)): experts chosen on probs + bias, weighted by probs."""
  _, experts_TK = jax.lax.top_k(probs_TE + bias_E, k)
  weights_TK = jnp.take_along_axis(probs_TE, experts_TK, axis=-1)
  return weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True), experts_TK


def declare(module: nn.Module, num_experts: int):
  """The layer's bias (E,), float32, zeros at init, replicated (a logical name no rule maps), not differentiated."""
  init = nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,))
  return jax.lax.stop_gradient(module.param(PARAM, init, (num_experts,), jnp.float32))


def sow_next(module: nn.Module, bias_E, load_E, rate: float) -> None:
  """Sows the bias after this step: each expert's bias moves by `rate` toward its share (mean load)."""
  module.sow(NEXT, PARAM, jax.lax.stop_gradient(bias_E + rate * jnp.sign(jnp.mean(load_E) - load_E)))


def next_values(sown: dict) -> dict:
  """{parameter path (tuple): next value} of every layer's sown bias (sow's tuple index dropped)."""
  flat = traverse_util.flatten_dict(sown.get(NEXT, {}))
  return {path: value[0] if isinstance(value, tuple) else value for path, value in flat.items()}


def apply_next(params, next_by_path: dict):
  """`params` with each router bias replaced by its next value (a no-op when there is none)."""
  if not next_by_path:
    return params
  flat = traverse_util.flatten_dict(params)
  for path, value in next_by_path.items():
    flat[path] = value.astype(flat[path].dtype)
  return traverse_util.unflatten_dict(flat)
