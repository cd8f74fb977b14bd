"""The train step: donation, remat policies, scanned layers, mixed precision, accumulation and z-loss."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import ApplyTask
from configs import tiny
from parallel import sharding
from trainer.models import llama
from trainer.run import job as job_lib
from trainer.training import optimizer
from trainer.training import step as step_lib

CFG = llama.LlamaConfig(num_layers=2, d_model=32, num_heads=2, mlp_dim=64, vocab_size=256)


def _batch(batch_size=4, seq_len=16, seed=0):
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch_size, seq_len + 1), 0, 256, jnp.int32)
  return {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}


def _params(cfg=CFG, seed=1):
  model = llama.Llama(cfg)
  return nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(seed), _batch()['inputs'])['params'])


def _abstract_params(cfg=CFG):
  model = llama.Llama(cfg)
  return nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), _batch()['inputs'])['params'])


def _loss_and_grads(cfg, params, batch, options=step_lib.StepOptions()):
  task = ApplyTask(llama.Llama(cfg).apply)
  grads, metrics = jax.jit(lambda p, b: step_lib.grads_and_metrics(p, b, task, options))(params, batch)
  return float(metrics['loss']), grads


def _unstack(params, num_layers):
  """Scanned parameters ('layers' with a leading axis) -> the unrolled model's block_0..block_{n-1}."""
  out = {k: v for k, v in params.items() if k != 'layers'}
  for i in range(num_layers):
    out[f'block_{i}'] = jax.tree.map(lambda x: x[i], params['layers'])
  return out


def _assert_trees_close(a, b, rtol, atol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# ---- donation ------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def variants():
  """Loss, gradients and temporary bytes of one fwd+bwd per remat policy (scanned), and unrolled: one compile each."""
  cfg = dataclasses.replace(CFG, num_layers=4, d_model=64, mlp_dim=256)
  params, batch = _params(cfg), _batch(batch_size=8, seq_len=64)
  unrolled_params = _unstack(params, cfg.num_layers)
  out = {'params': params}
  for name, variant, p in [(policy, dataclasses.replace(cfg, remat_policy=policy), params)
                           for policy in ('none',) + tuple(llama.REMAT_POLICIES)] + [
                               ('unrolled_full', dataclasses.replace(cfg, scan_layers=False, remat_policy='full'),
                                unrolled_params)]:
    task = ApplyTask(llama.Llama(variant).apply)
    compiled = jax.jit(lambda p, b: step_lib.grads_and_metrics(p, b, task)).lower(p, batch).compile()
    grads, metrics = compiled(p, batch)
    out[name] = (float(metrics['loss']), grads, compiled.memory_analysis().temp_size_in_bytes)
  return out


def test_scanned_layers_stack_parameters_on_a_leading_axis_and_match_the_unrolled_model(variants):
  params = variants['params']
  assert params['layers']['mlp']['up']['kernel'].shape == (4, 64, 256)
  assert not any(k.startswith('block_') for k in params)
  loss_scan, grads_scan, _ = variants['none']
  loss, grads, _ = variants['unrolled_full']  # Unrolled, and rematerialized the unrolled way.
  assert loss == pytest.approx(loss_scan, rel=1e-5)
  _assert_trees_close(grads, _unstack(grads_scan, 4), rtol=1e-4, atol=1e-6)


def test_every_remat_policy_gives_the_loss_and_gradients_of_none(variants):
  loss_none, grads_none, _ = variants['none']
  for policy in llama.REMAT_POLICIES:
    loss, grads, _ = variants[policy]
    assert loss == pytest.approx(loss_none, rel=1e-6), policy
    _assert_trees_close(grads, grads_none, rtol=1e-4, atol=1e-6)


def test_remat_trades_temporary_memory_as_its_policy_says(variants):
  temp = {name: v[2] for name, v in variants.items() if name != 'params'}
  assert temp['full'] < 0.6 * temp['none'], temp
  assert temp['full'] <= temp['save_qkv_proj'] < temp['none'], temp
  assert temp['full'] <= temp['dots_saveable'] <= temp['none'], temp


# ---- mixed precision -----------------------------------------------------------------------------


def _train_losses(cfg, steps, mu_dtype='float32'):
  model = llama.Llama(cfg)
  params = _params(cfg)
  train = tiny.get_config().train
  train.adam_mu_dtype = mu_dtype
  tx, schedule = optimizer.build_optimizer(train)
  from trainer.training.state import TrainState
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=jax.random.PRNGKey(0))
  step = jax.jit(lambda s, b: step_lib.train_step(s, b, task=ApplyTask(model.apply), tx=tx, schedule=schedule))
  losses = []
  for i in range(steps):
    state, metrics = step(state, _batch(seed=i % 2))  # Two batches in turn: the loss must fall.
    losses.append(float(metrics['loss']))
  return np.array(losses), state


def test_bfloat16_compute_tracks_float32_and_keeps_float32_state():
  losses32, _ = _train_losses(CFG, 5)
  losses16, state16 = _train_losses(dataclasses.replace(CFG, dtype=jnp.bfloat16), 5)
  assert losses32[-1] < losses32[0] - 0.1  # It learns, so the comparison means something.
  # bfloat16 keeps 8 bits of mantissa: the losses agree to about 1% over the run.
  np.testing.assert_allclose(losses16, losses32, rtol=0.01)
  assert {x.dtype for x in jax.tree.leaves(state16.params)} == {jnp.dtype(jnp.float32)}
  adam = state16.opt_state[1][0]
  assert {x.dtype for x in jax.tree.leaves((adam.mu, adam.nu))} == {jnp.dtype(jnp.float32)}


def test_logits_are_float32_under_bfloat16_compute():
  cfg = dataclasses.replace(CFG, dtype=jnp.bfloat16)
  logits = jax.eval_shape(llama.Llama(cfg).apply, {'params': _abstract_params(cfg)}, _batch()['inputs'])
  assert logits.dtype == jnp.float32


def test_bfloat16_first_moment_option():
  train = tiny.get_config().train
  train.adam_mu_dtype = 'bfloat16'
  tx, _ = optimizer.build_optimizer(train)
  adam = jax.eval_shape(tx.init, _abstract_params())[1][0]
  assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
  assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {jnp.dtype(jnp.float32)}


# ---- accumulation and z-loss ---------------------------------------------------------------------


def _bigram_apply(variables, tokens, segment_ids=None, positions=None):
  """A stand-in model (logits = embedding @ head): the loss math does not depend on the model."""
  p = variables['params']
  return jnp.tanh(p['embed'][tokens]) @ p['head']


def _bigram_params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(3))
  return {'embed': jax.random.normal(k1, (256, 16)), 'head': jax.random.normal(k2, (16, 256))}


def test_accumulated_gradients_equal_the_large_batch_step():
  params, batch = _bigram_params(), _batch(batch_size=8)
  run = lambda n: jax.jit(lambda p, b: step_lib.grads_and_metrics(
      p, b, ApplyTask(_bigram_apply, z_loss_weight=1e-3), step_lib.StepOptions(grad_accum_steps=n)))(params, batch)
  grads1, metrics1 = run(1)
  grads4, metrics4 = run(4)
  loss1, loss4 = float(metrics1['loss']), float(metrics4['loss'])
  assert float(metrics4['z_loss']) == pytest.approx(float(metrics1['z_loss']), rel=1e-5)
  assert loss4 == pytest.approx(loss1, rel=1e-5)
  _assert_trees_close(grads4, grads1, rtol=1e-4, atol=1e-7)


def test_grad_accum_that_does_not_split_the_per_device_batch_is_refused_before_compiling():
  from trainer.base.errors import UserError
  config = tiny.get_config()  # batch 8 over 8 devices: one sequence each.
  config.train.grad_accum_steps = 2
  with pytest.raises(UserError, match=r'train.grad_accum_steps=2 does not divide the per-device batch of 1'):
    job_lib.build_job(config)


def test_z_loss_adds_the_weighted_mean_square_log_partition_and_keeps_loss_the_cross_entropy():
  params, batch = _bigram_params(), _batch()
  apply_fn = _bigram_apply
  plain, plain_metrics = jax.jit(ApplyTask(apply_fn).loss)(params, batch)
  total, metrics = jax.jit(ApplyTask(apply_fn, z_loss_weight=1e-2).loss)(params, batch)
  logits = apply_fn({'params': params}, batch['inputs'])
  expected_z = 1e-2 * np.mean(np.square(jax.nn.logsumexp(np.asarray(logits), axis=-1)))
  assert float(metrics['loss']) == pytest.approx(float(plain), rel=1e-6)
  assert float(metrics['z_loss']) == pytest.approx(float(expected_z), rel=1e-5)
  assert float(total) == pytest.approx(float(plain) + float(expected_z), rel=1e-6)
  assert 'z_loss' not in plain_metrics
  # Its gradient pulls the log-partition towards 0.
  grad_norm = jax.jit(lambda p, b, w: optax.tree.norm(step_lib.grads_and_metrics(
      p, b, ApplyTask(apply_fn, z_loss_weight=w))[0]), static_argnums=2)
  assert grad_norm(params, batch, 1.0) > grad_norm(params, batch, 0.0)


@pytest.mark.parametrize('scan_layers,remat_policy', [(True, 'none'), (True, 'full'), (False, 'full')])
def test_per_token_arrays_reach_every_block_through_scan_and_remat(scan_layers, remat_policy, monkeypatch):
  """Packed sequences pass segment ids and positions into every layer (broadcast through nn.scan)."""
  seen = []
  original = llama.Block.__call__

  def spy(self, x_BLD, positions_BL, segment_ids_BL=None):
    seen.append((positions_BL.shape, None if segment_ids_BL is None else segment_ids_BL.shape))
    return original(self, x_BLD, positions_BL, segment_ids_BL)

  monkeypatch.setattr(llama.Block, '__call__', spy)
  cfg = dataclasses.replace(CFG, scan_layers=scan_layers, remat_policy=remat_policy)
  tokens = _batch()['inputs']
  segments = jnp.ones_like(tokens)
  model = llama.Llama(cfg)
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens, segments, tokens)
  seen.clear()
  logits = jax.eval_shape(model.apply, params, tokens, segments, tokens)
  assert logits.shape == tokens.shape + (256,)
  assert seen and all(s == (tokens.shape, tokens.shape) for s in seen)


@pytest.mark.parametrize('strategy,mesh_shape', [('jit', (2, 2, 2)), ('shard_map', (4, 2, 1)), ('pmap', (8, 1, 1))])
def test_state_is_donated_and_its_buffers_reused(strategy, mesh_shape):
  config = tiny.get_config()
  config.parallel.strategy = strategy
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
  job = job_lib.build_job(config)
  compiled = job.compile_train_step()
  _, totals = sharding.sharding_table(job.abstract, job.shardings)
  state_bytes = totals['params_bytes_per_device'] + totals['opt_state_bytes_per_device']
  alias = compiled.memory_analysis().alias_size_in_bytes
  # Every state buffer (params, both Adam moments, the counters) is written in place.
  assert state_bytes <= alias <= state_bytes + 1024, (alias, state_bytes)

  state = job.init_state(0)
  batch = {k: jax.device_put(np.zeros(v.shape, np.int32), v.sharding) for k, v in job.abstract_batch.items()}
  old_leaves = jax.tree.leaves(state)
  new_state, metrics = compiled(state, batch)
  assert np.isfinite(float(metrics['loss']))
  kept = [x for x in old_leaves if not x.is_deleted()]
  # Every array is reused in place; XLA may keep a scalar flag (optax.apply_if_finite's `last_finite`, 1 byte).
  assert all(x.ndim == 0 for x in kept) and sum(x.nbytes for x in kept) <= 8, [(x.shape, x.dtype) for x in kept]
  assert not any(x.is_deleted() for x in jax.tree.leaves(new_state))


# ---- scanned layers and remat --------------------------------------------------------------------
