"""Expert parallelism's token exchange: the MoE layer split over `expert` (and `tensor`) computes the one-device
layer's numbers, and the compiled train step really exchanges tokens all-to-all.

8 fake CPU devices, float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from configs import tiny
from parallel import mesh as mesh_lib
from trainer.models import moe
from trainer.observe import flops
from trainer.run import job as job_lib

E, K, D, F = 8, 2, 12, 16
B, L = 8, 6
GROUPS = 4  # The expert axis: the batch is split into 4 groups of B/4 rows, one per device.


def _mesh():
  """data=1, fsdp=1, pipeline=1, expert=4, context=1, tensor=2: experts over 4 devices, each expert's hidden width
  over 2."""
  return jax.make_mesh((1, 1, 1, GROUPS, 1, 2), mesh_lib.AXES, axis_types=(AxisType.Auto,) * len(mesh_lib.AXES))


def _config(capacity_factor):
  return moe.MoeConfig(num_experts=E, experts_per_token=K, expert_mlp_dim=F, capacity_factor=capacity_factor)


@pytest.fixture(scope='module')
def setup():
  x = jax.random.normal(jax.random.key(0), (B, L, D))
  boxed = jax.jit(moe.MoeMlp(_config(None)).init)(jax.random.key(1), x)['params']
  return x, jax.tree.map(lambda b: b.value, boxed, is_leaf=lambda b: hasattr(b, 'value'))


def _output_and_grads(layer, params, x):
  """(output, dropped fraction or None, d sum(sin(output)) / d (params, x)), in one compiled call."""
  def loss(p, x):
    out, sown = layer.apply({'params': p}, x, mutable=['aux_metrics'])
    return jnp.sum(jnp.sin(out)), (out, sown['aux_metrics'].get('dropped_fraction', (None,))[0])
  (_, (out, dropped)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return out, dropped, grads


def _assert_trees_close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('capacity_factor', [None, float(E)], ids=['dropless', 'capacity_without_drops'])
def test_exchange_equals_the_one_device_layer(setup, capacity_factor):
  x, params = setup
  want = _output_and_grads(moe.MoeMlp(_config(capacity_factor)), params, x)
  got = _output_and_grads(moe.MoeMlp(_config(capacity_factor), mesh=_mesh()), params, x)
  _assert_trees_close(got, want)
  if capacity_factor:
    assert float(got[1]) == 0.0


def test_capacity_drops_per_device_group(setup):
  """Under the exchange each device's tokens compete for capacity among themselves: the one-device layer run on
  each device's rows separately is the reference, drops included."""
  x, params = setup
  factor = 0.5  # C = ceil(0.5 * 12 tokens * 2 / 8) = 2 slots per expert and group: some assignments drop.
  got_out, got_dropped, _ = _output_and_grads(moe.MoeMlp(_config(factor), mesh=_mesh()), params, x)
  parts = [_output_and_grads(moe.MoeMlp(_config(factor)), params, rows)[:2] for rows in jnp.split(x, GROUPS)]
  np.testing.assert_allclose(got_out, jnp.concatenate([out for out, _ in parts]), rtol=1e-5, atol=1e-5)
  want_dropped = np.mean([float(d) for _, d in parts])
  assert want_dropped > 0.1
  np.testing.assert_allclose(float(got_dropped), want_dropped, rtol=1e-6)


def _moe_job(data, fsdp, expert):
  c = tiny.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.expert = data, fsdp, expert
  c.train.compute_dtype = 'float32'
  c.model.num_experts, c.model.experts_per_token = 8, 2
  return job_lib.build_job(c)


def test_traced_flops_do_not_count_the_exchange_buffers():
  """The dropless exchange's receive buffers have room for 4x the routed rows; the FLOPs (and MFU) must not grow."""
  count = lambda job: flops.traced_step_flops(job.task, job.abstract.params, job.task.batch_shapes()).flops
  assert count(_moe_job(1, 2, 4)) == count(_moe_job(4, 2, 1))


def test_compiled_train_step_exchanges_tokens_all_to_all():
  hlo = _moe_job(1, 2, 4).compile_train_step().as_text()
  # Scanned layers: one loop body forward with the dropless exchange's 3 all-to-alls (rows, their experts, results
  # back), one backward with the transposes of the 2 float ones (the expert ids have no gradient). GSPMD alone: 0.
  assert hlo.count(' all-to-all(') == 5
