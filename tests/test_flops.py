"""Analytic FLOPs under both conventions, the peak table, and MFU only where the peak is known."""

import types

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn

from configs import default, tiny
from trainer import flops
from trainer.models import llama


def _model(layers=12, d=768, heads=12, mlp=3072, vocab=50304):
  return types.SimpleNamespace(num_layers=layers, d_model=d, num_heads=heads, mlp_dim=mlp, vocab_size=vocab,
                               num_kv_heads=0)


def test_matmul_convention_counts_every_matmul_with_causal_attention_halved():
  m = _model()
  b, t = 8, 1024
  per_layer_fwd = 2 * b * t * (4 * 768 * 768 + 3 * 768 * 3072) + 2 * b * t * t * 768  # (4*T*d)/2 per token
  expected = 3 * (12 * per_layer_fwd + 2 * b * t * 768 * 50304)
  assert flops.step_flops(m, b, t).matmul == pytest.approx(expected, rel=1e-12)


def test_6n_convention_is_nanogpt_and_differs_from_matmul_by_unmasked_attention_and_norms():
  m = _model()
  b, t = 8, 1024
  f = flops.step_flops(m, b, t)
  n = f.non_embedding_params
  assert f.six_n == pytest.approx(b * t * (6 * n + 12 * 12 * 768 * t), rel=1e-12)
  norm_params = 12 * 2 * 768 + 768
  # 6N counts attention unmasked (12*L*d*T vs the halved 6*L*d*T) and the norm scales as matmul weights.
  assert f.six_n - f.matmul == pytest.approx(b * t * (6 * 12 * 768 * t + 6 * norm_params), rel=1e-9)


def test_non_embedding_parameter_count_matches_the_model():
  config = default.get_config()
  model = llama.build(config)
  params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))['params'])
  total = sum(x.size for x in jax.tree.leaves(params))
  embedding = params['embed']['embedding'].size
  assert flops.step_flops(config.model, 1, 8).non_embedding_params == total - embedding


def test_tied_head_is_not_a_non_embedding_parameter_but_its_matmul_is_counted():
  untied, tied = _model(), _model()
  tied.tie_embeddings = True
  a, b = flops.step_flops(untied, 8, 1024), flops.step_flops(tied, 8, 1024)
  assert a.non_embedding_params - b.non_embedding_params == 768 * 50304
  assert (a.matmul, a.six_n) == (b.matmul, b.six_n)  # The logits are computed either way.


@pytest.mark.parametrize('kind,name', [
    ('NVIDIA H100 80GB HBM3', 'h100'), ('NVIDIA H200', 'h200'), ('TPU v4', 'v4'), ('TPU v5 lite', 'v5e'),
    ('TPU v5', 'v5p'), ('TPU v5p', 'v5p'), ('TPU v6 lite', 'v6e'),
    ('NVIDIA H100 PCIe', None), ('NVIDIA A100-SXM4-80GB', None), ('cpu', None)])
def test_device_kinds_map_to_the_peak_table(kind, name):
  device = types.SimpleNamespace(device_kind=kind)
  assert flops.accelerator_name(device) == name
  assert flops.peak_flops(device) == (flops.PEAK_FLOPS[name] if name else None)


def test_peak_table_is_the_dense_bf16_figures():
  assert {k: v / 1e12 for k, v in flops.PEAK_FLOPS.items()} == {
      'h100': 989, 'h200': 989, 'v4': 275, 'v5e': 197, 'v5p': 459, 'v6e': 918}


def test_throughput_reports_mfu_only_for_known_peaks():
  config = tiny.get_config()
  cpu = flops.Throughput.for_run(config, jax.devices()[:4])
  assert cpu.peak_flops_per_device is None
  metrics = cpu.metrics(0.5)
  assert set(metrics) == {'tflops_per_device'}
  assert metrics['tflops_per_device'] == pytest.approx(cpu.flops.matmul / 0.5 / 4 / 1e12)
  h100 = flops.Throughput(cpu.flops, 4, flops.PEAK_FLOPS['h100'])
  m = h100.metrics(0.5)
  assert m['mfu'] == pytest.approx(cpu.flops.matmul / 0.5 / 4 / 989e12)
  assert m['mfu_6n'] == pytest.approx(cpu.flops.six_n / 0.5 / 4 / 989e12)
