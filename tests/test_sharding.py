"""Logical-axis rules to shardings: the table a user sees, and that nothing is held whole per device."""

import flax.linen as nn
import pytest
from ml_collections import config_dict

from configs import tiny
from parallel import mesh as mesh_lib
from parallel import sharding
from trainer.base.errors import UserError
from trainer.training import optimizer
from trainer.training import state as state_lib
from trainer.training import task as task_lib


def _abstract(mesh_shape):
  config = tiny.get_config()
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh_shape
  mesh = mesh_lib.build_mesh(config.mesh)
  rules = sharding.rules_from_config(config.parallel)
  tx, _ = optimizer.build_optimizer(config.train)
  model = task_lib.build_task(config, mesh, rules).model
  return config, mesh, *state_lib.abstract_state(model, tx, mesh, rules)


def test_table_on_2x2x2_shards_embed_over_fsdp_and_heads_mlp_over_tensor():
  _, _, abstract, shardings = _abstract((2, 2, 2))
  table, totals = sharding.sharding_table(abstract, shardings)
  rows = {line.split()[0]: line for line in table.splitlines()}
  # Scanned blocks: a leading 'layers' axis, never split.
  assert "(None, 'fsdp', 'tensor', None)" in rows['layers/attention/query/kernel']  # layers, embed, heads, head_dim
  assert "(None, 'tensor', 'fsdp')" in rows['layers/mlp/down/kernel']  # layers, mlp, embed
  assert "(None, 'fsdp', 'tensor')" in rows['layers/mlp/gate/kernel']  # layers, embed, mlp
  assert "('tensor', 'fsdp')" in rows['embed/embedding']  # vocab, embed
  ratio = totals['params_bytes_per_device'] / totals['params_bytes_total']
  assert 0.25 <= ratio < 0.26, ratio  # Only the tiny norm scales are replicated.
  assert 0.25 <= totals['opt_state_bytes_per_device'] / totals['opt_state_bytes_total'] < 0.26
  assert 'params per device' in table and 'opt_state per device' in table


def test_pure_data_parallel_replicates_everything():
  _, _, abstract, shardings = _abstract((8, 1, 1))
  _, totals = sharding.sharding_table(abstract, shardings)
  assert totals['params_bytes_per_device'] == totals['params_bytes_total']


def test_created_state_lands_in_its_shardings_without_a_whole_copy_per_device():
  config, mesh, abstract, shardings = _abstract((1, 8, 1))
  model = task_lib.build_task(config, mesh, sharding.rules_from_config(config.parallel)).model
  tx, _ = optimizer.build_optimizer(config.train)
  state = state_lib.create_state(0, model, tx, shardings)
  kernel = state.params['layers']['mlp']['up']['kernel']
  assert kernel.sharding == shardings.params['layers']['mlp']['up']['kernel']
  assert {s.data.shape for s in kernel.addressable_shards} == {
      (config.model.num_layers, config.model.d_model // 8, config.model.mlp_dim)}


def test_rules_from_config_are_hashable_tuples_extra_rules_first_mesh_axes_last():
  parallel = config_dict.ConfigDict({'logical_axis_rules': [['batch', ['data', 'fsdp']], ['embed', 'fsdp']],
                                     'extra_axis_rules': [['embed', None], ['tensor', 'fsdp']]})
  rules = sharding.rules_from_config(parallel)
  assert rules[:4] == (('embed', None), ('tensor', 'fsdp'), ('batch', ('data', 'fsdp')), ('embed', 'fsdp'))
  assert rules[-5:] == (('data', 'data'), ('fsdp', 'fsdp'), ('pipeline', 'pipeline'), ('expert', 'expert'),
                        ('context', 'context'))  # 'tensor' is a rule's name already: no identity rule.
  assert ('joined_kv', 'tensor') in rules[4:-5]  # Between them, public Flax code's names (parallel/vocabularies.py).
  # Flax takes the first rule naming an axis: the extra rule overrides the default one.
  assert tuple(nn.logical_to_mesh_axes(('embed', 'batch'), rules)) == (None, ('data', 'fsdp'))


@pytest.mark.parametrize('rule', [('model',), ('model', 'tp'), (3, 'tensor')])
def test_a_malformed_rule_is_one_line_naming_the_key(rule):
  parallel = config_dict.ConfigDict({'logical_axis_rules': [], 'extra_axis_rules': [rule]})
  with pytest.raises(UserError, match=r"parallel.extra_axis_rules: .* is not a rule; each is \(name, mesh axis\)"):
    sharding.rules_from_config(parallel)
