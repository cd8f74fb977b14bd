"""Attention across the `context` axis (trainer/attention/context.py) and the balanced row order
(parallel/context.py): exact against attention on the whole row, causal or not, grouped-query, packed.

The reference is written independently: plain einsum softmax attention over the whole row in its original order.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import config_dict

from parallel import context as context_lib
from parallel import mesh as mesh_lib
from parallel import sharding
from configs import base
from trainer import attention
from trainer.attention import context as scheme_lib
from trainer.attention import splash
from trainer.base.errors import UserError

B, L, H, G, K = 2, 64, 4, 2, 8
# Row 0: three documents; row 1: one document, then padding (id 0, its own segment).
SEGMENTS = np.array([[1] * 20 + [2] * 30 + [3] * 14, [1] * 50 + [0] * 14], np.int32)


def reference(q, k, v, causal, ids):
  """Softmax attention over the whole row, key/value heads repeated for their query heads."""
  (B, L, H, K), G = q.shape, k.shape[2]
  k, v = jnp.repeat(k, H // G, axis=2), jnp.repeat(v, H // G, axis=2)
  scores = jnp.einsum('bqhk,bshk->bhqs', q, k) / np.sqrt(K)
  allowed = np.ones((B, 1, L, L), bool)
  if causal:
    allowed = allowed & np.tril(np.ones((L, L), bool))
  if ids is not None:
    allowed = allowed & (ids[:, None, :, None] == ids[:, None, None, :])
  scores = jnp.where(allowed, scores, -1e30)
  return jnp.einsum('bhqs,bshk->bqhk', jax.nn.softmax(scores, axis=-1), v)


def _mesh(context, data=1, fsdp=1, tensor=1):
  cfg = config_dict.ConfigDict({'data': data, 'fsdp': fsdp, 'context': context, 'tensor': tensor,
                                'dcn_data': 1, 'dcn_fsdp': 1})
  return mesh_lib.build_mesh(cfg, jax.devices()[:data * fsdp * context * tensor])


def _inputs(seed=0, rows=B, length=L, heads=H, kv_heads=G):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (rows, length, heads, K)), jax.random.normal(kk, (rows, length, kv_heads, K)),
          jax.random.normal(kv, (rows, length, kv_heads, K)))


def _split_call(mesh, causal, ids, kernel='auto', scheme='auto'):
  """The launcher's call on rows put in the balanced order, brought back to the original order for comparison."""
  rules = sharding.rules_from_config(base.get_config().parallel)
  parts = mesh.shape['context']

  def fn(q, k, v):
    where = context_lib.order(q.shape[1], parts)
    back = np.argsort(where)
    ids_ = None if ids is None else jnp.asarray(ids)[:, where]
    out = jax.jit(lambda q, k, v: attention.dot_product_attention(
        q, k, v, causal=causal, segment_ids_BL=ids_, mesh=mesh, rules=rules, kernel=kernel,
        context_scheme=scheme))(
            q[:, where], k[:, where], v[:, where])
    return out[:, back]
  return fn


@pytest.mark.parametrize('scheme', ['all-gather', 'ring'])
@pytest.mark.parametrize('parts, causal, packed', [(2, True, True), (4, True, False), (4, False, True),
                                                   (8, True, True), (8, False, False)])
def test_outputs_and_gradients_match_whole_row_attention(parts, causal, packed, scheme):
  """Grouped heads (4 over 2). Packed causal rows under the ring hold blocks where some queries see no key (another
  document's, or later): those must add nothing, not NaN."""
  q, k, v = _inputs()
  ids = SEGMENTS if packed else None
  fn = _split_call(_mesh(parts), causal, ids, scheme=scheme)
  np.testing.assert_allclose(fn(q, k, v), jax.jit(reference, static_argnums=3)(q, k, v, causal, ids), atol=1e-5,
                             rtol=1e-5)
  cotangent = jax.random.normal(jax.random.key(9), (B, L, H, K))
  loss = lambda f: lambda *a: jnp.sum(f(*a) * cotangent)
  got = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(lambda *a: reference(*a, causal, ids)), argnums=(0, 1, 2)))(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5)


def test_splash_per_chunk_matches_whole_row_attention_in_interpret_mode():
  """The TPU path: splash once per chunk with offset causal masks (a lax.switch per device), in Pallas interpret
  mode (slow: one row, grouped heads 2 to 1); rows of 512 over 2 devices give chunks of 128, splash's smallest block."""
  causal = True
  q, k, v = _inputs(3, rows=1, length=512, heads=2, kv_heads=1)
  ids = np.repeat(np.array([[1, 2, 3, 0]], np.int32), 128, axis=1)
  ids[0, 100:300] = 2  # Documents that straddle chunk borders; padding (0) at the end.
  fn = _split_call(_mesh(2), causal, ids, kernel='splash')
  np.testing.assert_allclose(fn(q, k, v), reference(q, k, v, causal, ids), atol=2e-5, rtol=2e-5)
  cotangent = jax.random.normal(jax.random.key(9), q.shape)
  loss = lambda f: lambda *a: jnp.sum(f(*a) * cotangent)
  got = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(lambda *a: reference(*a, causal, ids)), argnums=(0, 1, 2)))(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5)


def test_each_splash_mask_is_processed_once_however_often_the_step_is_traced(monkeypatch):
  """A launch traces the step several times; splash's host-side mask processing (block maps for the forward pass,
  dq and dkv) runs once per distinct mask, not once per trace. Rows of 1024 over 4 devices: 8 chunk masks (two a
  device)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mask_info
  splash.kernel.cache_clear()  # Kernels an earlier test made would hide the first trace's processing.
  calls = []
  for name in ('process_mask', 'process_mask_dkv'):
    original = getattr(mask_info, name)
    monkeypatch.setattr(mask_info, name, lambda mask, *a, _f=original, _n=name, **kw: calls.append((_n, mask)) or
                        _f(mask, *a, **kw))
  q, k, v = _inputs(5, rows=1, length=1024, heads=2, kv_heads=1)
  per_trace = []
  for seed in range(3):  # Three traces of a new function each time, as shapes, FLOPs and compile each trace one.
    fn = _split_call(_mesh(4), True, None, kernel='splash')
    jax.make_jaxpr(jax.grad(lambda q, k, v, s=seed: jnp.sum(fn(q, k, v)) * s, argnums=(0, 1, 2)))(q, k, v)
    per_trace.append(len(calls) - sum(per_trace))
  # The first trace: 8 masks x (forward, dq, dkv); the later ones reuse the kernels.
  assert per_trace == [24, 0, 0], per_trace
  assert len({id(mask) for _, mask in calls}) == 8


def test_named_kernels_that_cannot_run_across_the_split_are_refused():
  q, k, v = _inputs()
  with pytest.raises(UserError, match=r"model.attention='cudnn' cannot run across mesh.context=2"):
    _split_call(_mesh(2), True, None, kernel='cudnn')(q, k, v)
  with pytest.raises(UserError, match=r"model.attention='splash' cannot run across mesh.context=2: splash needs "
                                      r"chunks \(data.seq_len / 2 / mesh.context = 16\)"):
    _split_call(_mesh(2), True, None, kernel='splash')(q, k, v)


def test_auto_takes_the_all_gather_where_splash_runs_the_blocks_and_the_ring_elsewhere():
  # The rule is a pure function of the platform and shapes.
  assert scheme_lib.scheme_for('auto', 'auto', 'tpu', 16_384, 4, 64)[:2] == ('all-gather', 'splash')
  assert scheme_lib.scheme_for('auto', 'auto', 'tpu', 1024, 8, 64)[:2] == ('ring', 'xla')  # Chunks of 64: no splash.
  assert scheme_lib.scheme_for('auto', 'xla', 'tpu', 16_384, 4, 64)[:2] == ('ring', 'xla')
  assert scheme_lib.scheme_for('auto', 'auto', 'gpu', 16_384, 4, 64)[:2] == ('ring', 'xla')
  assert scheme_lib.scheme_for('auto', 'auto', 'cpu', 64, 4, 8)[:2] == ('ring', 'xla')
  assert scheme_lib.scheme_for('all-gather', 'auto', 'cpu', 64, 4, 8)[:2] == ('all-gather', 'xla')


def test_ring_with_a_named_fused_kernel_and_unknown_schemes_are_refused():
  q, k, v = _inputs()
  with pytest.raises(UserError, match=r"model.context_scheme='ring' computes its own blocks and cannot run "
                                      r"model.attention='splash': set model.attention to 'auto' or 'xla'"):
    _split_call(_mesh(2), True, None, kernel='splash', scheme='ring')(q, k, v)
  with pytest.raises(UserError, match=r"model.context_scheme='rings' is not a scheme; choose one of \('auto', "
                                      r"'all-gather', 'ring'\)"):
    _split_call(_mesh(2), True, None, scheme='rings')(q, k, v)


@pytest.mark.parametrize('scheme', ['all-gather', 'ring'])
def test_with_data_and_tensor_axes_too(scheme):
  q, k, v = _inputs(1)
  fn = _split_call(_mesh(2, data=2, tensor=2), True, SEGMENTS, scheme=scheme)
  np.testing.assert_allclose(fn(q, k, v), reference(q, k, v, True, SEGMENTS), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize('scheme', ['all-gather', 'ring'])
def test_another_documents_tokens_never_change_a_tokens_output(scheme):
  """Row 0 split over 4 devices: changing document 2's keys/values leaves documents 1 and 3 exactly as they were."""
  q, k, v = _inputs(2)
  fn = _split_call(_mesh(4), True, SEGMENTS, scheme=scheme)
  doc2 = np.zeros((B, L, 1, 1), bool)
  doc2[0, 20:50] = True
  before = fn(q, k, v)
  after = fn(q, jnp.where(doc2, k * 3 + 1, k), jnp.where(doc2, -v, v))
  others = np.ones((B, L), bool)
  others[0, 20:50] = False
  np.testing.assert_array_equal(np.asarray(before)[others], np.asarray(after)[others])
  assert not np.allclose(np.asarray(before)[0, 20:50], np.asarray(after)[0, 20:50])


def test_balanced_order_evens_out_causal_work():
  """Plain order gives device 3 of 4 seven times device 0's causal work; the zig-zag order gives each the same."""
  plain = context_lib.causal_work(64, 4, balanced=False)
  balanced = context_lib.causal_work(64, 4)
  assert sum(plain) == sum(balanced) == 64 * 65 // 2
  assert max(plain) / min(plain) == pytest.approx(7, rel=0.1)
  assert max(balanced) == min(balanced)
  assert sorted(context_lib.order(16, 2)) == list(range(16))
  assert list(context_lib.order(8, 2)) == [0, 1, 6, 7, 2, 3, 4, 5]


def test_seq_len_that_cannot_be_cut_names_the_multiple():
  with pytest.raises(UserError, match=r'data.seq_len=100 must be a multiple of 8 \(2 x mesh.context=4'):
    context_lib.check_seq_len(100, 4)
