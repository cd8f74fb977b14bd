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
