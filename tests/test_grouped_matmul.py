"""The Pallas Triton grouped matmul for experts (trainer/models/grouped_matmul.py), run in Pallas interpret mode on
CPU: forward and gradients equal a dense reference written differently (a masked product per expert), in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.models import grouped_matmul

A, D, F, E = 96, 32, 48, 4


def _dense_reference(x_AD, w_EDF, sizes):
  """Every expert on every row, each row keeping its own expert's product: the definition, not the kernel's path."""
  owner = np.repeat(np.arange(len(sizes)), sizes)
  owner = np.concatenate([owner, np.full(x_AD.shape[0] - len(owner), -1)])  # Rows past the groups: none.
  everything = jnp.einsum('ad,edf->eaf', x_AD, w_EDF, precision=jax.lax.Precision.HIGHEST)
  mask = (np.arange(w_EDF.shape[0])[:, None] == owner[None, :]).astype(np.float32)
  return jnp.sum(everything * mask[:, :, None], axis=0)


@pytest.mark.parametrize('sizes', [
    [40, 7, 33, 16],  # Uneven, none a multiple of the row tile.
    [0, 50, 0, 46],  # Empty groups, first and inner.
    [96, 0, 0, 0],  # One group holds every row.
    [0, 0, 0, 96],  # ...the last one.
    [20, 30, 0, 10],  # Fewer rows in groups than rows: the rest read back as zeros.
])
def test_forward_and_gradients_equal_the_dense_reference(sizes):
  rng = np.random.default_rng(sum(sizes) + len(sizes))
  x = jnp.asarray(rng.normal(size=(A, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(E, D, F)) / np.sqrt(D), jnp.float32)
  cotangent = jnp.asarray(rng.normal(size=(A, F)), jnp.float32)
  sizes_E = jnp.asarray(sizes, jnp.int32)

  def kernel_loss(x, w):
    return jnp.sum(grouped_matmul.ragged_dot(x, w, sizes_E, interpret=True, tile_rows=16) * cotangent)

  def reference_loss(x, w):
    return jnp.sum(_dense_reference(x, w, sizes) * cotangent)

  out = grouped_matmul.ragged_dot(x, w, sizes_E, interpret=True, tile_rows=16)
  np.testing.assert_allclose(out, _dense_reference(x, w, sizes), atol=1e-5, rtol=1e-5)
  grads = jax.grad(kernel_loss, argnums=(0, 1))(x, w)
  expected = jax.grad(reference_loss, argnums=(0, 1))(x, w)
  for got, want in zip(grads, expected):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  if 0 in sizes:  # An empty group's weights get exactly zero gradient.
    assert not np.any(np.asarray(grads[1])[np.asarray(sizes) == 0])


def test_the_same_as_jax_ragged_dot_under_jit_with_traced_sizes():
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.normal(size=(A, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(E, D, F)), jnp.float32)
  run = jax.jit(lambda x, w, s: grouped_matmul.ragged_dot(x, w, s, interpret=True, tile_rows=32))
  for sizes in ([24, 24, 24, 24], [1, 2, 3, 90]):
    s = jnp.asarray(sizes, jnp.int32)
    np.testing.assert_allclose(run(x, w, s), jax.lax.ragged_dot(x, w, s, precision=jax.lax.Precision.HIGHEST),
                               atol=1e-4, rtol=1e-5)


def test_its_flops_are_the_active_experts_as_ragged_dots_are():
  from trainer.observe import traced_flops
  x, w, s = jax.ShapeDtypeStruct((A, D), jnp.float32), jax.ShapeDtypeStruct((E, D, F), jnp.float32), jnp.asarray(
      [40, 7, 33, 16], jnp.int32)

  def step(kernel):
    return lambda x, w: jax.grad(lambda x, w: jnp.sum(kernel(x, w)), argnums=(0, 1))(x, w)

  ours = traced_flops.count(step(lambda x, w: grouped_matmul.ragged_dot(x, w, s, interpret=True, tile_rows=16)), x, w)
  upstream = traced_flops.count(step(lambda x, w: jax.lax.ragged_dot(x, w, s)), x, w)
  assert ours.flops == upstream.flops == 3 * 2 * A * D * F and not ours.opaque


def test_each_platform_gets_its_kernel_and_the_log_names_it():
  from trainer.models import moe
  cfg = moe.MoeConfig(num_experts=8, experts_per_token=2, expert_mlp_dim=64)
  assert moe.for_platform(cfg, 'gpu').kernel == 'triton'
  assert moe.for_platform(cfg, 'tpu').kernel == moe.for_platform(cfg, 'cpu').kernel == 'ragged_dot'
  assert 'dropless on Pallas Triton grouped matmul (trainer/models/grouped_matmul.py)' in moe.dispatch_note(
      moe.for_platform(cfg, 'gpu'), 'gpu')
  assert 'dropless on jax.lax.ragged_dot' in moe.dispatch_note(moe.for_platform(cfg, 'tpu'), 'tpu')


@pytest.mark.skipif(not __import__('trainer.memory.gpu_targets', fromlist=['gpu_targets']).cuda_plugin_installed(),
                    reason="needs jax's CUDA plugin: pip install -r requirements-gpu-plan.txt")
def test_compiled_for_an_h100_the_kernel_runs_the_active_flops_and_the_guard_fires_on_ragged_dot():
  import subprocess
  import sys
  from conftest import REPO
  done = subprocess.run(
      [sys.executable, str(REPO / 'benchmarks' / 'bench_expert_kernel.py'), '--config=configs/tiny.py',
       '--override=model.num_experts=4', '--override=model.experts_per_token=2', '--override=model.expert_mlp_dim=64',
       '--override=model.num_layers=1'], capture_output=True, text=True, timeout=900, cwd=REPO,
      env={k: v for k, v in __import__('os').environ.items() if k not in ('JAX_PLATFORMS', 'XLA_FLAGS')})
  assert done.returncode == 0, done.stderr[-3000:]
  table = {line.split('|')[1].strip(): line.split('|') for line in done.stdout.splitlines()
           if line.startswith('| ragged_dot') or line.startswith('| triton')}
  ratio = lambda kernel, column: float(table[kernel][column].strip().rstrip('x'))
  assert ratio('ragged_dot', 4) > 1.3 and ratio('triton', 4) < 1.3 and ratio('triton', 5) < 1.3
  assert 'ragged_dot: The compiled step runs' in done.stdout and 'triton: guard silent' in done.stdout
