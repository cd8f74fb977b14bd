"""The MoE layer against a dense reference: outputs, gradients, capacity drops, and the router's health terms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.models import moe

E, K, D, F = 4, 2, 12, 16
T_SHAPE = (2, 12)  # (batch, length): 24 tokens.


def _layer(capacity_factor=None):
  cfg = moe.MoeConfig(num_experts=E, experts_per_token=K, expert_mlp_dim=F, capacity_factor=capacity_factor,
                      aux_loss_weight=0.01, z_loss_weight=0.001)
  return moe.MoeMlp(cfg)


@pytest.fixture(scope='module')
def setup():
  x = jax.random.normal(jax.random.key(0), T_SHAPE + (D,))
  params = jax.tree.map(lambda b: b.value, _layer().init(jax.random.key(1), x)['params'],
                        is_leaf=lambda b: hasattr(b, 'value'))
  return x, params


def dense_reference(params, x_BLD, kept_TK=None):
  """Every expert on every token, then each token's top-k experts' outputs weighted, zero for the rest.

  Written without sorting or top_k: the top-k come from a descending argsort of the router probabilities.
  """
  x_TD = x_BLD.reshape(-1, D)
  probs_TE = jax.nn.softmax(x_TD @ params['router'], axis=-1)
  top_TK = jnp.argsort(-probs_TE, axis=-1)[:, :K]
  picked_TE = jnp.zeros_like(probs_TE).at[jnp.arange(len(x_TD))[:, None], top_TK].set(
      1.0 if kept_TK is None else kept_TK.astype(jnp.float32))
  combine_TE = probs_TE * (jnp.zeros_like(probs_TE).at[jnp.arange(len(x_TD))[:, None], top_TK].set(1.0))
  combine_TE = combine_TE / jnp.sum(combine_TE, axis=-1, keepdims=True) * picked_TE
  every_ETD = jnp.stack([(jax.nn.silu(x_TD @ params['gate'][e]) * (x_TD @ params['up'][e])) @ params['down'][e]
                         for e in range(E)])
  return jnp.einsum('etd,te->td', every_ETD, combine_TE).reshape(x_BLD.shape)


def _apply(layer, params, x):
  return layer.apply({'params': params}, x, mutable=['aux_loss', 'aux_metrics'])


def test_dropless_output_and_gradients_equal_the_dense_reference(setup):
  x, params = setup
  layer = _layer()
  # Each side jitted whole: run op by op, this test compiled 212 programs (30 s of the suite's CPU).
  out, _ = jax.jit(lambda p, x: _apply(layer, p, x))(params, x)
  np.testing.assert_allclose(out, jax.jit(dense_reference)(params, x), atol=1e-5)
  # Gradients of the routed output (the router's through the top-k weights) against the reference's.
  loss = lambda f: lambda p, x: jnp.sum(jnp.sin(f(p, x)))
  grads = jax.jit(jax.grad(loss(lambda p, x: _apply(layer, p, x)[0]), argnums=(0, 1)))(params, x)
  ref_grads = jax.jit(jax.grad(loss(dense_reference), argnums=(0, 1)))(params, x)
  for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(got, want, atol=1e-5)
  assert float(jnp.max(jnp.abs(grads[0]['router']))) > 1e-4  # The router does learn through the weights.


def test_capacity_mode_equals_dropless_when_nothing_drops(setup):
  x, params = setup
  out, sown = _apply(_layer(capacity_factor=E / K), params, x)  # Capacity = every token: nothing can drop.
  np.testing.assert_allclose(out, _apply(_layer(), params, x)[0], atol=1e-5)
  assert float(sown['aux_metrics']['dropped_fraction'][0]) == 0.0


def _kept_by_loop(experts_TK, capacity):
  """First choices of all tokens, then second choices, in token order; an expert past capacity drops the rest."""
  taken, kept = [0] * E, np.zeros(experts_TK.shape, bool)
  for j in range(experts_TK.shape[1]):
    for t in range(experts_TK.shape[0]):
      e = int(experts_TK[t, j])
      kept[t, j] = taken[e] < capacity
      taken[e] += 1
  return kept


def test_capacity_mode_drops_exactly_the_assignments_over_capacity(setup):
  x, params = setup
  factor = 0.5
  layer = _layer(capacity_factor=factor)
  capacity = layer.cfg.capacity(x.shape[0] * x.shape[1])
  assert capacity == 6  # ceil(0.5 * 24 tokens * 2 choices / 4 experts)
  _, _, experts_TK = moe.route(x.reshape(-1, D), params['router'], K)
  kept = _kept_by_loop(np.asarray(experts_TK), capacity)
  assert 0 < (~kept).sum() < kept.size  # Some, not all, dropped.
  out, sown = _apply(layer, params, x)
  # The reference's dense experts, with the dropped (token, choice) weights zeroed (no renormalization).
  np.testing.assert_allclose(out, dense_reference(params, x, kept_TK=jnp.asarray(kept)), atol=1e-5)
  np.testing.assert_allclose(sown['aux_metrics']['dropped_fraction'][0], (~kept).mean(), rtol=1e-6)


def test_load_metrics_and_balancing_loss_react_to_unbalanced_inputs(setup):
  x, params = setup
  layer = _layer()
  _, spread = _apply(layer, params, x)
  same = jnp.broadcast_to(x[:1, :1], x.shape)  # Every token the same: every token picks the same two experts.
  _, piled = _apply(layer, params, same)
  metric = lambda s, name: float(s['aux_metrics'][name][0])
  assert metric(piled, 'load_max') == pytest.approx(E / K)  # Two experts take all: each E/K times its share.
  assert metric(piled, 'load_min') == 0.0
  assert metric(spread, 'load_max') < E / K and metric(spread, 'load_min') > 0
  assert metric(piled, 'load_cv') > 2 * metric(spread, 'load_cv')
  assert metric(piled, 'balance_loss') > 1.2 * metric(spread, 'balance_loss')
  np.testing.assert_allclose(piled['aux_loss']['moe_balance_loss'][0], 0.01 * metric(piled, 'balance_loss'),
                             rtol=1e-6)
  np.testing.assert_allclose(np.sum(spread['aux_metrics']['load_per_expert'][0]), E, rtol=1e-6)
