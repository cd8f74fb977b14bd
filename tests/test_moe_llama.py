"""The MoE Llama: which layers are MoE, its loss terms and per-layer metrics, and the idle-expert warning."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import configs.tiny
from trainer.base.errors import UserError
from trainer.models import llama
from trainer.observe import expert_load
from trainer.training import task as task_lib


def _config(**model):
  c = configs.tiny.get_config()
  c.model.num_experts, c.model.experts_per_token = 4, 2
  c.model.router_aux_loss_weight, c.model.router_z_loss_weight = 0.1, 0.01
  for key, value in model.items():
    c.model[key] = value
  return c


def _abstract_params(config):
  tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  return nn.unbox(jax.eval_shape(llama.build(config).init, jax.random.key(0), tokens))['params']


def test_the_loss_adds_the_mean_router_terms_and_logs_them_per_layer():
  config = _config()
  task = task_lib.build_task(config)
  params = jax.jit(task.model.init)(jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 256, (8, 32)), jnp.int32)
  loss, metrics = jax.jit(task.loss)(params, {'inputs': tokens, 'targets': tokens})
  layers = [f'layers_{i}/moe' for i in range(config.model.num_layers)]
  balance = np.mean([metrics[f'{layer}/balance_loss'] for layer in layers])
  z = np.mean([metrics[f'{layer}/router_z_loss'] for layer in layers])
  np.testing.assert_allclose(metrics['moe_balance_loss'], 0.1 * balance, rtol=1e-5)
  np.testing.assert_allclose(metrics['moe_router_z_loss'], 0.01 * z, rtol=1e-5)
  np.testing.assert_allclose(loss, metrics['loss'] + 0.1 * balance + 0.01 * z, rtol=1e-6)
  assert metrics[f'{layers[1]}/load_per_expert'].shape == (4,)
  assert 'layers_0/moe/dropped_fraction' not in metrics  # Dropless: nothing to count.


def test_every_second_layer_scanned_in_groups_or_unrolled():
  scanned = _abstract_params(_config(num_layers=4, moe_layers=2, shared_expert=True, expert_mlp_dim=48))
  assert set(scanned['layers']) == {'block_0', 'block_1'}  # Two groups of (dense, MoE) scanned.
  assert 'mlp' in scanned['layers']['block_0'] and 'moe' in scanned['layers']['block_1']
  assert scanned['layers']['block_1']['moe']['gate'].shape == (2, 4, 32, 48)  # (groups, E, D, F)
  assert scanned['layers']['block_1']['shared_expert']['up']['kernel'].shape == (2, 32, 48)
  unrolled = _abstract_params(_config(num_layers=3, moe_layers=2, scan_layers=False))
  assert [('moe' in unrolled[f'block_{i}']) for i in range(3)] == [False, True, False]


@pytest.mark.parametrize('model,message', [
    ({'experts_per_token': 5}, r'model.experts_per_token=5 must be between 1 and model.num_experts=4'),
    ({'moe_layers': 'some'}, r"model.moe_layers='some': use 'all', or k"),
    ({'num_layers': 3, 'moe_layers': 2}, r'model.moe_layers=2 must divide model.num_layers=3 when layers are scanned'),
    ({'expert_capacity_factor': -1.0}, r'model.expert_capacity_factor=-1.0 must be > 0'),
])
def test_bad_moe_settings_are_one_line_naming_the_key(model, message):
  with pytest.raises(UserError, match=message):
    llama.build(_config(**model))


def test_an_expert_idle_for_the_limit_is_warned_once_by_layer_and_index():
  watch = expert_load.IdleExperts(steps=3)
  busy, idle = np.ones(4), np.array([2.0, 2.0, 0.0, 0.0])
  key = 'layers_1/moe/load_per_expert'
  said = [watch.step_done(s, {key: load, 'loss': 1.0}) for s, load in enumerate([busy, idle, idle, idle, idle], 1)]
  assert said[:3] == [[], [], []]
  assert [w[:80] for w in said[3]] == [
      f'step 4: MoE layer layers_1/moe: expert {e} has received no tokens for 3 steps in a row'[:80] for e in (2, 3)]
  assert said[4] == []  # Once, not every step it stays idle.
  assert expert_load.IdleExperts(steps=0).step_done(1, {key: idle}) == []


def test_the_log_says_which_dispatch_runs(caplog):
  with caplog.at_level('INFO'):
    llama.build(_config())
    llama.build(_config(expert_capacity_factor=1.25))
  assert ('MoE: 4 experts, top-2, dropless on jax.lax.ragged_dot (grouped matmuls); over mesh.expert tokens travel by '
          'padded all_to_all; on cpu XLA pads') in caplog.text
  assert '--config.model.expert_capacity_factor=1.25 runs near 1.3x' in caplog.text
  assert 'MoE: 4 experts, top-2, capacity mode (factor 1.25: (experts, capacity, d_model) buffers' in caplog.text


def test_a_brought_models_expert_named_weights_get_the_expert_axis():
  """Any model naming a dimension 'expert' (and 'expert_mlp') is split by the default rules like the Llama's experts."""
  from parallel import mesh as mesh_lib
  from parallel import sharding
  config = configs.tiny.get_config()
  config.mesh.data, config.mesh.expert, config.mesh.tensor = 2, 2, 2
  mesh = mesh_lib.build_mesh(config.mesh)
  boxed = {'experts': nn.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 16, 32), jnp.float32),
                                              ('expert', 'embed', 'expert_mlp'))}
  spec = sharding.tree_shardings(boxed, mesh, sharding.rules_from_config(config.parallel))['experts'].spec
  assert tuple(spec) == ('expert', 'fsdp', 'tensor')


def _skewed_params(task, skew: float = 3.0):
  """The tiny MoE's initial parameters with every layer's router leaning to experts 0 and 1: all embeddings share a
  direction c (so every layer's input does) and those experts' router columns point along it."""
  params = jax.jit(task.model.init)(jax.random.key(0))
  c = jax.random.normal(jax.random.key(1), (params['embed']['embedding'].shape[-1],))
  c = c / jnp.linalg.norm(c)
  params['embed']['embedding'] = params['embed']['embedding'] + 2.0 * c
  params['layers']['moe']['router'] = params['layers']['moe']['router'].at[:, :, :2].add(skew * c[None, :, None])
  return params


def _arithmetic_rows(steps: int, rows: int = 16, length: int = 32):
  """(steps, rows, length + 1) tokens, each row start + k * stride (mod 64): a pattern the tiny model learns."""
  rng = np.random.default_rng(0)
  start, stride = rng.integers(0, 64, (2, steps, rows, 1))
  return jnp.asarray((start + (stride % 3 + 1) * np.arange(length + 1)) % 64, jnp.int32)


def train_skewed(bias_rate: float, steps: int = 200) -> tuple[np.ndarray, np.ndarray, dict]:
  """(loss per step, max/mean expert load per step, final params) of the tiny MoE (8 experts, top-2, float32, Adam,
  balancing loss 0.01) trained from a skewed router; the steps run in one jitted scan of the pure train step."""
  import optax
  from trainer.training import step as step_lib
  from trainer.training.state import TrainState
  config = _config(num_experts=8, router_aux_loss_weight=0.01, router_z_loss_weight=0.001, router_bias_rate=bias_rate)
  task = task_lib.build_task(config)
  params = _skewed_params(task)
  tx = optax.adam(3e-3)
  state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                     rng=jnp.zeros(2, jnp.uint32))

  def one(state, rows):
    state, metrics = step_lib.train_step(state, {'inputs': rows[:, :-1], 'targets': rows[:, 1:]}, task=task, tx=tx,
                                         schedule=optax.constant_schedule(3e-3))
    return state, (metrics['loss'], metrics['moe_load_max'])
  state, (loss, load_max) = jax.jit(lambda s, r: jax.lax.scan(one, s, r))(state, _arithmetic_rows(steps))
  return np.asarray(loss), np.asarray(load_max), jax.device_get(state.params)


def test_the_router_bias_balances_a_skewed_router_better_than_the_loss_alone():
  """model.router_bias_rate (DeepSeek-V3's bias) beside the balancing loss: after 200 steps from a skewed router the
  busiest expert's load over its share is lower, and the task loss no worse than 1%."""
  loss_alone, load_alone, _ = train_skewed(0.0)
  loss_bias, load_bias, params = train_skewed(0.01)
  assert load_alone[0] > 3 and load_bias[0] > 3  # Both start skewed: the busiest expert takes > 3x its share.
  last = slice(-50, None)  # The last 50 steps: 20 left the loss at the mercy of a few batches (+-2% between rates).
  print(f'max/mean load, last 50 steps: {load_alone[last].mean():.3f} loss alone, {load_bias[last].mean():.3f} '
        f'with the bias; loss {loss_alone[last].mean():.4f} / {loss_bias[last].mean():.4f}')
  assert load_bias[last].mean() < 0.85 * load_alone[last].mean()
  assert loss_bias[last].mean() <= 1.01 * loss_alone[last].mean()
  bias = params['layers']['moe']['router_bias']
  assert bias.shape == (2, 8) and bias.dtype == np.float32
  # Moved only by the rule (+-rate a step, never by the optimizer): every step moved each bias by exactly 0.01.
  np.testing.assert_allclose(np.abs(np.round(bias / 0.01)) * 0.01, np.abs(bias), atol=1e-4)
  assert np.abs(bias).max() <= 200 * 0.01 + 1e-5 and np.abs(bias).max() > 0.05


def _bias_run_config(steps: int):
  from test_strategies import TEXT_DIR
  c = _config(router_bias_rate=0.01)
  c.train.steps, c.train.compute_dtype, c.data.text_dir = steps, 'float32', str(TEXT_DIR)
  return c


def _saved_bias(workdir, step):
  from parallel import sharding
  from trainer.run import job as job_lib
  from trainer.training import checkpoint
  job = job_lib.build_job(_bias_run_config(step))
  ckpt = checkpoint.Checkpointer(str(workdir), job.config.ckpt)
  restored = ckpt.restore_state(step, sharding.with_shardings(job.abstract, job.shardings))
  ckpt.close()
  assert set(job.shardings.params['layers']['moe']['router_bias'].spec) <= {None}  # Replicated.
  return np.asarray(jax.device_get(restored.params['layers']['moe']['router_bias']))


def test_the_router_bias_is_checkpointed_and_resumes_bit_exactly(tmp_path):
  from trainer.run import loop
  straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
  loop.run(_bias_run_config(4), str(straight))  # Checkpoints at step 4 (ckpt.every_steps=4).
  loop.run(_bias_run_config(2), str(resumed))  # Stops (and saves) at step 2 ...
  loop.run(_bias_run_config(4), str(resumed))  # ... and goes on to 4 from that checkpoint.
  bias = _saved_bias(straight, 4)
  assert bias.shape == (2, 4) and np.abs(bias).max() > 0  # It moved (by +-0.01 a step) ...
  np.testing.assert_array_equal(bias, _saved_bias(resumed, 4))  # ... and the resumed run moved it identically.
