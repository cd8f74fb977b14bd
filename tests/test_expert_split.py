"""The MoE layer split over every device of the mesh: each batch shard routes and runs its own tokens (over `expert`
exchanged all-to-all), and trains the numbers of one device.

8 fake CPU devices, float32. Each layout x dispatch trains the layer 10 SGD steps; the reference is a dense einsum
over all experts (every expert on every token, weighted by the top-k router weights, written without sorting,
grouping or capacity buffers) on one device.
"""

import re
import sys

import jax
import ml_collections
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from conftest import REPO, run_python
from parallel import mesh as mesh_lib
from trainer.memory import gpu_targets
from trainer.models import moe

E, K, D, F = 8, 2, 12, 16
B, L = 8, 6
STEPS, LR = 10, 0.005
CAPACITY = float(E // K)  # C = ceil(4 * 6 tokens * 2 / 8) = 6 slots per expert and device: a device's 6 tokens fit.
LAYOUTS = {'data8': (8, 1, 1), 'fsdp8': (1, 8, 1), 'expert8': (1, 1, 8), 'data2_expert4': (2, 1, 4)}


def _mesh(data, fsdp, expert):
  sizes = {'data': data, 'fsdp': fsdp, 'expert': expert}
  return jax.make_mesh(tuple(sizes.get(a, 1) for a in mesh_lib.AXES), mesh_lib.AXES,
                       axis_types=(AxisType.Auto,) * len(mesh_lib.AXES))


def _dense_reference(params, x_BLD):
  """Every expert on every token; each token's output the router-weighted sum of its top-k experts' outputs."""
  x = x_BLD.reshape(-1, D)
  probs = jax.nn.softmax(x @ params['router'], axis=-1)
  top, chosen = jax.lax.top_k(probs, K)
  combine_TE = jnp.einsum('tk,tke->te', top / top.sum(-1, keepdims=True), jax.nn.one_hot(chosen, E))
  hidden_TEF = jax.nn.silu(jnp.einsum('td,edf->tef', x, params['gate'])) * jnp.einsum('td,edf->tef', x, params['up'])
  return jnp.einsum('te,tef,efd->td', combine_TE, hidden_TEF, params['down']).reshape(x_BLD.shape), None


def _train(forward, params, x):
  """(losses, final params, dropped fractions) of STEPS SGD steps on sum(sin(output))."""
  def loss(p):
    out, dropped = forward(p, x)
    return jnp.sum(jnp.sin(out)), dropped

  step = jax.jit(lambda p: (jax.value_and_grad(loss, has_aux=True)(p)))
  losses, drops = [], []
  for _ in range(STEPS):
    (value, dropped), grads = step(params)
    losses.append(float(value))
    drops.append(dropped)
    params = jax.tree.map(lambda w, g: w - LR * g, params, grads)
  return np.array(losses), params, drops


def _layer(capacity_factor, mesh, exchange='padded', buffer_factor=None):
  layer = moe.MoeMlp(moe.MoeConfig(num_experts=E, experts_per_token=K, expert_mlp_dim=F,
                                   capacity_factor=capacity_factor, exchange=exchange, buffer_factor=buffer_factor),
                     mesh=mesh)

  def forward(p, x):
    out, sown = layer.apply({'params': p}, x, mutable=['aux_metrics', 'aux_loss'])
    return out, sown['aux_metrics'].get('dropped_fraction', (None,))[0]
  return forward


@pytest.fixture(scope='module')
def setup():
  x = jax.random.normal(jax.random.key(0), (B, L, D))
  boxed = jax.jit(moe.MoeMlp(moe.MoeConfig(num_experts=E, experts_per_token=K, expert_mlp_dim=F)).init)(
      jax.random.key(1), x)['params']
  params = jax.tree.map(lambda b: b.value, boxed, is_leaf=lambda b: hasattr(b, 'value'))
  params['router'] = params['router'] * 4  # A peaked router: loads far from even, so routing errors would show.
  return x, params, _train(_dense_reference, params, x)


def _assert_trains_the_reference(setup, got):
  x, params, (want_losses, want_params, _) = setup
  losses, final, _ = got
  assert np.max(np.abs(losses - want_losses) / np.abs(want_losses)) <= 1e-5
  assert abs(losses[-1] - losses[0]) > 1e-2 * abs(losses[0])  # The steps moved the numbers compared.
  for g, w in zip(jax.tree.leaves(final), jax.tree.leaves(want_params), strict=True):
    assert np.linalg.norm(g - w) <= 1e-5 * np.linalg.norm(w)  # Each weight array, relative to its norm.


@pytest.mark.parametrize('layout', LAYOUTS)
def test_dropless_split_trains_one_devices_numbers(setup, layout):
  x, params, _ = setup
  _assert_trains_the_reference(setup, _train(_layer(None, _mesh(*LAYOUTS[layout])), params, x))


@pytest.mark.parametrize('layout', LAYOUTS)
def test_capacity_split_trains_one_devices_numbers(setup, layout):
  x, params, _ = setup
  got = _train(_layer(CAPACITY, _mesh(*LAYOUTS[layout])), params, x)
  assert all(float(d) == 0.0 for d in got[2])  # Per-device groups with room for all: none dropped, so exact.
  _assert_trains_the_reference(setup, got)


@pytest.mark.parametrize('layout', ['expert8', 'data2_expert4'])
def test_ragged_exchange_trains_one_devices_numbers(setup, layout):
  """The ragged exchange's offsets, over the emulation CPUs run (XLA:CPU has no ragged-all-to-all)."""
  x, params, _ = setup
  _assert_trains_the_reference(setup, _train(_layer(None, _mesh(*LAYOUTS[layout]), 'emulated'), params, x))



OVER_EXPERT = [('expert8', 'padded'), ('expert8', 'emulated'), ('data2_expert4', 'padded'),
               ('data2_expert4', 'emulated')]


@pytest.mark.parametrize('layout,exchange', OVER_EXPERT)
def test_buffer_with_room_for_all_trains_one_devices_numbers(setup, layout, exchange):
  """model.expert_buffer_factor = N (the devices on `expert`): room for every assignment, so exact, 0 dropped."""
  x, params, _ = setup
  sizes = LAYOUTS[layout]
  got = _train(_layer(None, _mesh(*sizes), exchange, buffer_factor=float(sizes[2])), params, x)
  assert all(float(d) == 0.0 for d in got[2])
  _assert_trains_the_reference(setup, got)


def _dropped_by_rule(chosen_BLK, layout, exchange, factor):
  """(B, L, K) bools: the assignments the buffer factor drops, by the rule read from the docs, in plain Python.
  Batch row b is one device's tokens (8 rows, 8 devices); it is source b % N of its group of N on `expert`.
  padded: each (source, target device) keeps its first ceil(f*A/N) assignments in token order. ragged: each target
  keeps ceil(f*A) rows, taking sources in order and each source's rows by expert, then token."""
  n = LAYOUTS[layout][2]
  local, a = E // n, L * K
  drop = np.zeros(chosen_BLK.shape, bool)
  if exchange == 'padded':
    places = -(-factor * a // n)
    for b in range(B):
      taken = [0] * n
      for t in range(L):
        for k in range(K):
          j = chosen_BLK[b, t, k] // local
          drop[b, t, k] = taken[j] >= places
          taken[j] += 1
    return drop
  room = -(-factor * a // 1)
  for group in range(B // n):
    for j in range(n):
      taken = 0
      for b in range(group * n, group * n + n):
        rows = sorted((chosen_BLK[b, t, k], t, k) for t in range(L) for k in range(K)
                      if chosen_BLK[b, t, k] // local == j)
        for _, t, k in rows:
          drop[b, t, k] = taken >= room
          taken += 1
  return drop


@pytest.mark.parametrize('layout,exchange', OVER_EXPERT)
def test_balanced_buffer_drops_the_overflow(setup, layout, exchange):
  """Factor 1.0 under the peaked router: some device overflows; the layer's output and gradients are the dense
  one-device computation's without exactly the dropped assignments, and its dropped fraction is their count."""
  x, params, _ = setup
  _, chosen = jax.lax.top_k(jax.nn.softmax(x @ params['router'], axis=-1), K)
  drop_BLK = _dropped_by_rule(np.asarray(chosen), layout, exchange, 1.0)
  assert 0 < drop_BLK.sum() < drop_BLK.size / 2  # Some, not most: the test tells kept from dropped rows.

  def reference(p):
    top, _ = jax.lax.top_k(jax.nn.softmax(x @ p['router'], axis=-1), K)
    weights = jnp.where(drop_BLK, 0.0, top / top.sum(-1, keepdims=True))
    combine_BLE = jnp.einsum('blk,blke->ble', weights, jax.nn.one_hot(chosen, E))
    hidden_BLEF = jax.nn.silu(jnp.einsum('bld,edf->blef', x, p['gate'])) * jnp.einsum('bld,edf->blef', x, p['up'])
    return jnp.einsum('ble,blef,efd->bld', combine_BLE, hidden_BLEF, p['down'])

  layer = _layer(None, _mesh(*LAYOUTS[layout]), exchange, buffer_factor=1.0)
  loss = lambda p: jnp.sum(jnp.sin(layer(p, x)[0]))
  (out, dropped), grads = jax.jit(lambda p: (layer(p, x), jax.grad(loss)(p)))(params)
  want = reference(params)
  assert float(dropped) == pytest.approx(drop_BLK.mean(), abs=1e-6)
  np.testing.assert_allclose(out, want, atol=1e-5 * float(jnp.max(jnp.abs(want))), rtol=0)
  want_grads = jax.grad(lambda p: jnp.sum(jnp.sin(reference(p))))(params)
  for name in params:
    assert np.linalg.norm(grads[name] - want_grads[name]) <= 1e-5 * np.linalg.norm(want_grads[name]), name


def test_buffer_factor_is_checked_and_logged():
  """A bad model.expert_buffer_factor is one line naming it; a good one is named in the MoE log line."""
  m = {'num_experts': E, 'experts_per_token': K, 'moe_layers': 'all', 'num_layers': 2, 'expert_capacity_factor': None}
  for bad in (-1.0, 'big', True):
    with pytest.raises(moe.UserError, match=r'^model\.expert_buffer_factor=.* must be > 0 .* or None'):
      moe.check_config(ml_collections.ConfigDict({**m, 'expert_buffer_factor': bad}), scanned=False)
  moe.check_config(ml_collections.ConfigDict({**m, 'expert_buffer_factor': 1.25}), scanned=False)
  note = moe.dispatch_note(moe.MoeConfig(E, K, F, exchange='padded', buffer_factor=1.25), 'gpu')
  assert 'receive buffers of 1.25x the balanced load' in note and 'overflow is dropped' in note
  assert 'buffer' not in moe.dispatch_note(moe.MoeConfig(E, K, F, exchange='padded'), 'gpu')
  # The note's way back to exact, as a command line gives it (a float flag cannot say None): 0 is room for all.
  assert '--config.model.expert_buffer_factor=0 keeps it exact' in note
  moe.check_config(ml_collections.ConfigDict({**m, 'expert_buffer_factor': 0}), scanned=False)
  model = {**m, 'expert_mlp_dim': F, 'mlp_dim': F, 'router_aux_loss_weight': 0.0, 'router_z_loss_weight': 0.0}
  assert moe.from_model_config(ml_collections.ConfigDict({**model, 'expert_buffer_factor': 0})).buffer_factor is None
  assert moe.from_model_config(ml_collections.ConfigDict({**model, 'expert_buffer_factor': 1.25})).buffer_factor == 1.25


@pytest.mark.skipif(not gpu_targets.cuda_plugin_installed(),
                    reason="needs jax's CUDA plugin: pip install -r requirements-gpu-plan.txt")
@pytest.mark.parametrize('layout,capacity,buffer', [('data=8', None, None), ('expert=8', 1.0, None),
                                                    ('expert=8', None, 1.0)],
                         ids=['data8_dropless', 'expert8_capacity', 'expert8_dropless_buffer1'])
def test_moe_1b_compiled_for_8_h100s_splits_its_matmuls(layout, capacity, buffer):
  """Per-device matmul FLOPs of the compiled step at most 1.15x one eighth of the step's active FLOPs (before the
  split, data=8 ran 4.77x: every device every token's experts). Dropless over `expert` with the worst-case receive
  buffer (N times the rows routed) ran 4.76x: model.expert_buffer_factor=1.0 sizes it for the balanced load."""
  argv = [sys.executable, str(REPO / 'benchmarks' / 'bench_expert_split.py'), f'--layout={layout}']
  argv += [f'--capacity_factor={capacity}'] if capacity else []
  run = run_python(argv + ([f'--buffer_factor={buffer}'] if buffer else []), timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  ratio = float(re.search(rf'^\| {layout} \| .* \| ([\d.]+)x \|$', run.stdout, re.M).group(1))
  assert ratio <= 1.15, run.stdout
