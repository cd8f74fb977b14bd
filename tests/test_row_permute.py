"""The experts' rows move by gathers alone (trainer/models/row_permute.py): forward and gradients equal plain jnp
indexing's autodiff (whose transposes scatter), no scatter is left in the dropless layer's gradient, and compiled for
an H100 the MoE layers' row movement holds no scatter."""

import functools
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, run_python
from trainer.memory import gpu_targets
from trainer.models import expert_math, grouped_matmul, row_permute

N, D, F, K = 24, 16, 32, 2
TOLERANCE = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2}


def _injective(rng, n_in: int, n_out: int):
  """(src (n_out,), dst (n_in,)): a random layout of n_in rows into n_out places, some rows dropped, the empty places
  n_in and the dropped rows n_out, as jnp's indexing with mode='fill' reads them."""
  place = rng.permutation(n_out)[:n_in]
  place[rng.random(n_in) < 0.2] = n_out  # Dropped: read back as zero, their gradient zero.
  src = np.full(n_out, n_in)
  kept = place < n_out
  src[place[kept]] = np.arange(n_in)[kept]
  return jnp.asarray(src, jnp.int32), jnp.asarray(place, jnp.int32)


def _check(moved, reference, dtype, inputs_shape):
  """Forward and gradients w.r.t. the rows and a weight before the move equal the reference's."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=inputs_shape), dtype)
  w = jnp.asarray(rng.normal(size=(D, F)) / 4, dtype)

  def loss(fn):
    def f(x, w):
      y = fn(jnp.dot(x, w))
      c = jnp.asarray(np.random.default_rng(2).normal(size=y.shape), y.dtype)
      return jnp.sum((y * c).astype(jnp.float32)), y
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, w)

  (got_loss, got_y), got_grads = loss(moved)
  (want_loss, want_y), want_grads = loss(reference)
  tol = TOLERANCE[dtype]
  np.testing.assert_allclose(np.float32(got_y), np.float32(want_y), rtol=tol, atol=tol)
  np.testing.assert_allclose(got_loss, want_loss, rtol=tol)
  for got, want in zip(got_grads, want_grads):
    assert got.dtype == want.dtype == dtype
    np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=tol, atol=tol)
  assert np.abs(np.float32(got_grads[0])).max() > 0


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_a_padding_layout_and_its_undoing_equal_jnp_indexing(dtype):
  src, dst = _injective(np.random.default_rng(0), N, N + 13)
  # Padding (more places than rows, some empty) by take; the reference scatters, as grouped_matmul did.
  _check(lambda y: row_permute.take(y, src, dst),
         lambda y: jnp.zeros((N + 13, F), y.dtype).at[dst].set(y, mode='drop'), dtype, (N, D))
  # Unpadding: the reference gathers, and its gradient scatter-adds.
  _check(lambda y: row_permute.take(y, dst, src), lambda y: y.at[dst].get(mode='fill', fill_value=0), dtype,
         (N + 13, D))


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_the_k_fold_sort_and_unsort_equal_jnp_indexing(dtype):
  order = jnp.asarray(np.random.default_rng(3).permutation(N * K), jnp.int32)
  inverse = row_permute.inverse(order)
  _check(lambda y: row_permute.sort(row_permute.repeat(y, K), order, inverse), lambda y: y[order // K], dtype, (N, D))
  _check(lambda y: row_permute.unsort(y, order, inverse), lambda y: y[jnp.argsort(order)], dtype, (N * K, D))


def _scatters(fn, *args) -> list[str]:
  return re.findall(r'\bscatter[\w-]*', str(jax.make_jaxpr(fn)(*args)))


def test_no_scatter_moves_the_dropless_layers_rows_forward_or_backward(monkeypatch):
  rng = np.random.default_rng(4)
  E, T = 4, 16
  x = jnp.asarray(rng.normal(size=(T, D)), jnp.float32)
  experts = jnp.asarray(rng.integers(0, E, size=(T, K)), jnp.int32)
  weights = jnp.asarray(rng.random(size=(T, K)), jnp.float32)
  gate, up = (jnp.asarray(rng.normal(size=(E, D, F)), jnp.float32) for _ in range(2))
  down = jnp.asarray(rng.normal(size=(E, F, D)), jnp.float32)
  # The Pallas kernels in interpret mode, traced only, never run.
  monkeypatch.setattr(grouped_matmul, 'ragged_dot',
                      functools.partial(grouped_matmul.ragged_dot, interpret=True, tile_rows=16))
  for kernel in ('ragged_dot', 'triton'):
    def loss(x, gate, up, down, kernel=kernel):
      return jnp.sum(expert_math.dropless(x, experts, weights, gate, up, down, kernel))
    assert _scatters(jax.grad(loss, argnums=(0, 1, 2, 3)), x, gate, up, down) == [], kernel


@pytest.mark.skipif(not gpu_targets.cuda_plugin_installed(),
                    reason="needs jax's CUDA plugin: pip install -r requirements-gpu-plan.txt")
def test_compiled_for_an_h100_the_moe_layers_move_rows_without_scatter():
  run = run_python([sys.executable, str(REPO / 'benchmarks' / 'bench_moe_scatter.py'), '--batch_size=1',
                    '--override=model.num_layers=2'], timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  assert re.search(r'^MoE row-movement scatters: 0 ', run.stdout, re.M), run.stdout
  # The count sees scatters: the embedding's gradient stays one (a scatter-add into the (vocab, d_model) table).
  assert re.search(r'^\| f32 \| \[50304,1024\] \| \S*/embed/', run.stdout, re.M), run.stdout
