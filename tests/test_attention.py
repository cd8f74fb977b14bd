"""trainer/attention: the kernel choice per platform, its errors, log and manifest entry, and every kernel that runs
on CPU (XLA; splash in Pallas interpret mode) against a float32 reference, packed rows included.

cuDNN cannot run without a GPU: here its choice rules and the conversion of segment ids to its packed layout are
tested, tests/test_cuda_lowering.py lowers the whole train step to its calls, and its numerics need a GPU
(benchmarks/bench_attention.py).
"""

import inspect
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from parallel import mesh as mesh_lib
from parallel import sharding
from trainer import attention
from trainer.attention import choice as choice_lib
from trainer.attention import cudnn
from trainer.base.errors import UserError
from trainer.models import llama
from trainer.run import job as job_lib
from trainer.training import checkpoint
from trainer.training import manifest as manifests

B, L, H, G, K = 2, 128, 2, 1, 16  # Small: splash in interpret mode runs its grid in Python.
# Row 0: three documents; row 1: one document then a padding run of zeros (its own segment).
SEGMENTS = np.array([[1] * 50 + [2] * 60 + [3] * 18, [1] * 100 + [0] * 28], np.int32)
F32_TOL = dict(atol=2e-5, rtol=2e-5)  # Summation order only: the kernels accumulate in float32.
BF16_TOL = dict(atol=3e-2, rtol=3e-2)  # bfloat16 keeps 8 mantissa bits (relative step 2**-8 = 0.4%); ~8 roundings.
CPU_KERNELS = ('xla', 'splash')


def call(platform='gpu', dtype='bfloat16', seq_len=1024, head_dim=64, packed=False, capability=9.0):
  return attention.Call(platform, dtype, (8, seq_len, 16, head_dim), (8, seq_len, 4, head_dim), causal=True,
                        packed=packed, gpu_capability=capability)


@pytest.mark.parametrize('the_call, kernel, reason', [
    (call('cpu', 'float32'), 'xla', 'no fused kernel on cpu'),
    (call(), 'cudnn', 'the fastest kernel on gpu'),
    (call(packed=True), 'cudnn', 'the fastest kernel on gpu'),
    (call(dtype='float32'), 'xla', 'fell back: cuDNN takes bfloat16 or float16 compute, not float32'),
    (call(head_dim=160, capability=8.0), 'xla', 'fell back: cuDNN takes a head dim that is a multiple of 8 and at '
                                                'most 128, not 160'),
    (call(head_dim=160), 'cudnn', 'the fastest kernel on gpu'),  # Hopper takes head dims up to 256.
    (call(packed=True, capability=8.0), 'xla', 'fell back: cuDNN takes packed rows (segment ids) only on Hopper'),
    (call('tpu', 'float32'), 'splash', 'the fastest kernel on tpu'),
    (call('tpu', packed=True), 'splash', 'the fastest kernel on tpu'),
    (call('tpu', seq_len=1000), 'xla', 'fell back: splash attention takes a sequence length that is a multiple of '
                                       '128, not 1000'),
    (call('tpu', head_dim=32), 'xla', 'fell back: splash attention on TPU takes a head dim that is a multiple of 64'),
])
def test_auto_picks_the_fastest_kernel_that_fits_and_says_why(the_call, kernel, reason):
  chosen = attention.choose(the_call, 'auto')
  assert chosen.kernel == kernel and chosen.setting == 'auto'
  assert chosen.reason.startswith(reason)


@pytest.mark.parametrize('the_call, setting, message', [
    (call('cpu', 'float32'), 'cudnn', "model.attention='cudnn' cannot run this model: cuDNN needs an NVIDIA GPU, "
                                      "and the devices are cpu."),
    (call(dtype='float32'), 'cudnn', 'cuDNN takes bfloat16 or float16 compute, not float32 (train.compute_dtype).'),
    (call('tpu', seq_len=1000), 'splash', 'splash attention takes a sequence length that is a multiple of 128, '
                                          'not 1000.'),
    (call('gpu'), 'splash', 'splash attention is a TPU kernel, and the devices are gpu.'),
    (call(), 'flash', "model.attention='flash' is not a kernel; choose one of ('auto', 'xla', 'cudnn', 'splash')."),
])
def test_a_named_kernel_that_cannot_run_the_call_is_one_user_error(the_call, setting, message):
  with pytest.raises(UserError) as e:
    attention.choose(the_call, setting)
  assert message in str(e.value) and '\n' not in str(e.value)


def test_named_kernel_fails_in_the_model_builder_and_the_manifest_records_the_choice():
  config = tiny.get_config()
  config.model.attention = 'cudnn'
  with pytest.raises(UserError, match="model.attention='cudnn' cannot run this model: cuDNN needs an NVIDIA GPU"):
    job_lib.build_job(config)
  config.model.attention = 'auto'
  job = job_lib.build_job(config)
  entry = manifests.run_manifest(config, job.abstract, job.mesh)['attention']
  assert entry == {'setting': 'auto', 'kernel': 'xla', 'reason': 'no fused kernel on cpu'}


def test_vit_checks_its_kernel_too():
  from configs import vit_tiny  # pylint: disable=import-outside-toplevel
  config = vit_tiny.get_config()
  config.model.attention = 'splash'  # 64 patches: not a multiple of splash's 128-token blocks.
  with pytest.raises(UserError, match='splash attention takes a sequence length that is a multiple of 128, not '):
    job_lib.build_job(config)


def test_the_log_says_once_which_kernel_runs(caplog):
  choice_lib._LOGGED.clear()  # pylint: disable=protected-access
  q, kv = jnp.zeros((1, 8, 2, 4)), jnp.zeros((1, 8, 1, 4))
  with caplog.at_level(logging.INFO):
    for _ in range(3):
      jax.jit(lambda q, kv: attention.dot_product_attention(q, kv, kv, causal=True))(q, kv)
  lines = [r.getMessage() for r in caplog.records if 'ttention kernel' in r.getMessage()]
  assert lines == ["Attention kernel xla (model.attention='auto': no fused kernel on cpu)"]


def packed_reference(segment_ids, max_segments):
  """seqlens (B, M) and offsets (B, M + 1) of cuDNN's packed layout, by a Python loop over runs."""
  seqlens = np.full((len(segment_ids), max_segments), -1)
  offsets = np.full((len(segment_ids), max_segments + 1), -1)
  for b, row in enumerate(segment_ids):
    starts = [i for i in range(len(row)) if i == 0 or row[i] != row[i - 1]]
    for m, (start, end) in enumerate(zip(starts, starts[1:] + [len(row)])):
      seqlens[b, m], offsets[b, m] = end - start, start
  return seqlens, offsets


def test_segment_ids_to_cudnn_packed_layout():
  rows = np.array([[1, 1, 1, 2, 2, 3, 3, 3],  # Three documents.
                   [1, 1, 1, 1, 1, 1, 0, 0],  # A document, then padding (a segment of its own).
                   [5, 5, 5, 5, 5, 5, 5, 5],  # A single document.
                   [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)  # The most segments a row can hold: one per token.
  seqlens, offsets = jax.jit(cudnn.segments_to_packed, static_argnums=1)(rows, 8)
  want_seqlens, want_offsets = packed_reference(rows, 8)
  np.testing.assert_array_equal(seqlens, want_seqlens)
  np.testing.assert_array_equal(offsets, want_offsets)
  assert offsets.dtype == seqlens.dtype == jnp.int32
  np.testing.assert_array_equal(offsets[0], [0, 3, 5, -1, -1, -1, -1, -1, -1])


def test_cudnn_packed_call_gets_the_layout_and_repeated_kv_heads_on_the_pinned_jax(monkeypatch):
  """cuDNN cannot run here: a stand-in for jax's packed kernel attends by the layout it is given, checked against
  the float32 reference, and records that GQA keys/values reach it with H heads while the pinned jax scales kv
  offsets by the query's stride."""
  buggy = 'kv_offsets = kv_offsets * N * H' in inspect.getsource(cudnn.cudnn_lib._fix_seqlen_offsets)
  assert cudnn._GQA_OFFSETS_FIXED is not buggy  # pylint: disable=protected-access
  seen = {}

  def packed_kernel(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type, qkv_layout):
    seen.update(kv_heads=k.shape[2], layout=qkv_layout, same=(q_seqlen is kv_seqlen and q_offsets is kv_offsets))
    position = jnp.arange(q.shape[1])
    inside = ((position >= q_offsets[:, :-1, None]) & (position < q_offsets[:, :-1, None] + q_seqlen[..., None])
              & (q_seqlen[..., None] > 0))  # (B, M, L): which tokens each segment holds.
    segment = jnp.argmax(inside, axis=1)  # Each token's segment index.
    assert scale == q.shape[-1] ** -0.5
    return reference(q, k, v, mask_type == cudnn.cudnn_lib.MaskType.PADDING_CAUSAL, segment)

  monkeypatch.setattr(cudnn.cudnn_lib, 'dot_product_attention', packed_kernel)
  q, k, v = inputs()
  for causal in (True, False):
    out = cudnn.attention(q, k, v, causal=causal, segment_ids_BL=jnp.asarray(SEGMENTS))
    np.testing.assert_allclose(out, reference(q, k, v, causal, jnp.asarray(SEGMENTS)), **F32_TOL)
  assert seen == {'kv_heads': H if buggy else G, 'layout': 'BTNH', 'same': True}


def reference(q, k, v, causal, segment_ids):
  """float32 softmax attention with an explicit mask, k/v heads repeated for GQA."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
  logits = jnp.einsum('blhk,bmhk->bhlm', q, k) / np.sqrt(q.shape[-1])
  mask = jnp.ones((q.shape[1], q.shape[1]), bool)[None, None]
  if causal:
    mask = mask & jnp.tril(mask)
  if segment_ids is not None:
    mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
  probs = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
  return jnp.einsum('bhlm,bmhk->blhk', probs, v)


def inputs(dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=shape), dtype) for shape in ((B, L, H, K), (B, L, G, K), (B, L, G, K)))


def loss_and_grads(fn, q, k, v, cotangent):
  """The output and the gradients of <output, cotangent> with respect to q, k and v, in one compiled call."""
  def loss(q, k, v):
    out = fn(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


@pytest.mark.parametrize('kernel', CPU_KERNELS)
@pytest.mark.parametrize('causal, packed', [(True, True), (False, True), (True, False), (False, False)])
def test_kernel_matches_float32_reference_in_outputs_and_gradients(kernel, causal, packed):
  q, k, v = inputs()
  segment_ids = jnp.asarray(SEGMENTS) if packed else None
  cotangent = jnp.asarray(np.random.default_rng(1).normal(size=(B, L, H, K)), jnp.float32)
  out, grads = loss_and_grads(lambda q, k, v: attention.dot_product_attention(
      q, k, v, causal=causal, segment_ids_BL=segment_ids, kernel=kernel), q, k, v, cotangent)
  want, want_grads = loss_and_grads(lambda q, k, v: reference(q, k, v, causal, segment_ids), q, k, v, cotangent)
  np.testing.assert_allclose(out, want, **F32_TOL)
  for got, expected in zip(grads, want_grads):
    np.testing.assert_allclose(got, expected, **F32_TOL)


@pytest.mark.parametrize('kernel', CPU_KERNELS)
def test_bfloat16_within_bfloat16_tolerance(kernel):
  q, k, v = inputs(jnp.bfloat16)
  segment_ids = jnp.asarray(SEGMENTS)
  out = jax.jit(lambda q, k, v: attention.dot_product_attention(
      q, k, v, causal=True, segment_ids_BL=segment_ids, kernel=kernel))(q, k, v)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32), reference(q, k, v, True, segment_ids), **BF16_TOL)


@pytest.mark.parametrize('kernel', CPU_KERNELS)
def test_a_token_never_sees_another_document_of_its_row(kernel):
  """Changing document 2's (and 3's) queries, keys and values leaves document 1's outputs and gradients as they were."""
  q, k, v = inputs()
  segment_ids = jnp.asarray(SEGMENTS)
  other_docs = (segment_ids != 1)[:, :, None, None]
  q2, k2, v2 = (jnp.where(other_docs, x * -3.0 + 1.0, x) for x in (q, k, v))
  cotangent = jnp.where(other_docs, 0.0, 1.0) * jnp.ones((B, L, H, K))  # Gradients of document 1's outputs only.
  fn = lambda q, k, v: attention.dot_product_attention(q, k, v, causal=True, segment_ids_BL=segment_ids,
                                                       kernel=kernel)
  out, grads = loss_and_grads(fn, q, k, v, cotangent)
  out2, grads2 = loss_and_grads(fn, q2, k2, v2, cotangent)
  doc1 = np.asarray(segment_ids == 1)
  np.testing.assert_array_equal(np.asarray(out)[doc1], np.asarray(out2)[doc1])
  for g, g2 in zip(grads, grads2):
    np.testing.assert_array_equal(np.asarray(g)[doc1], np.asarray(g2)[doc1])
    np.testing.assert_array_equal(np.asarray(g2)[~doc1], 0.0)  # Nothing flows into the other documents.
  assert not np.allclose(np.asarray(out)[~doc1], np.asarray(out2)[~doc1])  # The change was real.


@pytest.mark.parametrize('policy, kernel_calls', [
    (jax.checkpoint_policies.dots_saveable, 4),  # Forward, the forward again in the backward, dq, dk/dv.
    (attention.dots_saveable, 3),  # The forward's output and statistics kept: no second forward.
])
def test_dots_saveable_keeps_the_splash_forward(policy, kernel_calls):
  q, k, v = inputs()
  attend = lambda q: attention.dot_product_attention(q, k, v, causal=True, kernel='splash').sum()
  jaxpr = str(jax.make_jaxpr(jax.grad(jax.checkpoint(attend, policy=policy)))(q))
  assert jaxpr.count('pallas_call') == kernel_calls


def test_llama_on_splash_matches_xla_under_jit_on_a_2x2x2_mesh():
  """Splash is wrapped in shard_map over the batch ('data', 'fsdp') and head ('tensor') axes under GSPMD."""
  config = tiny.get_config()
  with config.unlocked():
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
    config.model.update(num_layers=1, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=128)
    config.data.seq_len = L
    config.train.compute_dtype = 'float32'
  mesh = mesh_lib.build_mesh(config.mesh)
  rules = sharding.rules_from_config(config.parallel)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(4, L)), jnp.int32)
  segment_ids = jnp.asarray(np.repeat(SEGMENTS, 2, axis=0))
  logits, params = {}, None
  for kernel in ('xla', 'splash'):
    config.model.attention = kernel
    model = llama.build(config, mesh, rules)
    params = params or jax.jit(model.init)(jax.random.key(0), tokens)  # The same parameters for both kernels.
    lowered = jax.jit(model.apply).lower(params, tokens, segment_ids)
    logits[kernel] = lowered.compile()(params, tokens, segment_ids)
  assert 'sdy.manual_computation' in lowered.as_text()  # Splash runs inside shard_map: per device, by hand.
  np.testing.assert_allclose(logits['splash'], logits['xla'], atol=1e-4, rtol=1e-4)
