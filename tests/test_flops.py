"""FLOPs counted from the traced step for any model, the Llama's analytic conventions, the peak table, and MFU
only where the peak is known. Everything here traces (jax.make_jaxpr) and never compiles."""

import types

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from configs import default, llama_1b, tiny, vit_tiny
from trainer.models import llama
from trainer.observe import flops, traced_flops
from trainer.run import job as job_lib
from trainer.training import step as step_lib

S = jax.ShapeDtypeStruct
F32 = jnp.float32


def _model(layers=12, d=768, heads=12, mlp=3072, vocab=50304):
  return types.SimpleNamespace(num_layers=layers, d_model=d, num_heads=heads, mlp_dim=mlp, vocab_size=vocab,
                               num_kv_heads=0)


def test_matmul_convention_counts_every_matmul_with_causal_attention_halved():
  m = _model()
  b, t = 8, 1024
  per_layer_fwd = 2 * b * t * (4 * 768 * 768 + 3 * 768 * 3072) + 2 * b * t * t * 768  # (4*T*d)/2 per token
  expected = 3 * (12 * per_layer_fwd + 2 * b * t * 768 * 50304)
  assert flops.step_flops(m, b, t).matmul == pytest.approx(expected, rel=1e-12)
  unmasked = expected + 3 * 12 * 2 * b * t * t * 768  # The scores and the weighted sum in full.
  assert flops.step_flops(m, b, t).matmul_unmasked == pytest.approx(unmasked, rel=1e-12)


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


def test_moe_parameters_counted_whole_and_active_per_token():
  config = tiny.get_config()
  config.model.update(num_experts=8, experts_per_token=2, expert_mlp_dim=48, shared_expert=True)
  model = llama.build(config)
  params = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))['params'])
  counts = flops.step_flops(config.model, 1, 8)
  assert counts.non_embedding_params == sum(x.size for x in jax.tree.leaves(params)) - params['embed']['embedding'].size
  experts = params['layers']['moe']
  unused = sum(experts[k].size for k in ('gate', 'up', 'down')) * 6 // 8  # 6 of every 8 experts' weights.
  assert counts.inactive_params == unused
  assert counts.six_n_params == counts.non_embedding_params - unused


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
  config.data.source = 'synthetic'
  cpu = flops.Throughput.for_job(job_lib.build_job(config, jax.devices()[:4]))
  assert (cpu.num_devices, cpu.peak_flops_per_device) == (4, None)
  metrics = cpu.metrics(0.5)
  assert set(metrics) == {'tflops_per_device'}
  assert metrics['tflops_per_device'] == pytest.approx(cpu.step_flops / 0.5 / 4 / 1e12)
  h100 = flops.Throughput(cpu.step_flops, 4, flops.PEAK_FLOPS['h100'], six_n=cpu.six_n)
  m = h100.metrics(0.5)
  assert m['mfu'] == pytest.approx(cpu.step_flops / 0.5 / 4 / 989e12)
  assert m['mfu_6n'] == pytest.approx(flops.step_flops(config.model, 8, 32).six_n / 0.5 / 4 / 989e12)
  assert set(flops.Throughput(1e12, 4, 989e12).metrics(0.5)) == {'tflops_per_device', 'mfu'}  # No 6N but Llama's.


# The walk over a jaxpr, on functions whose FLOPs are counted by hand.

def test_a_matmul_is_2mnk_per_batch_and_its_gradient_two_more():
  x, w = S((3, 4, 5), F32), S((3, 5, 6), F32)
  matmul = lambda x, w: jnp.einsum('bij,bjk->bik', x, w).sum()
  assert traced_flops.count(matmul, x, w) == traced_flops.Count(2 * 3 * 4 * 5 * 6)
  assert traced_flops.count(jax.grad(matmul, argnums=(0, 1)), x, w).flops == 3 * 720  # Forward, dx, dw.
  assert traced_flops.count(jax.grad(matmul, argnums=1), x, w).flops == 2 * 720  # No dx wanted: not computed.


def test_a_convolution_is_2_times_outputs_times_taps_and_groups_divide():
  x = S((2, 3, 8, 8), F32)  # NCHW; 3x3 VALID: 6x6 outputs.
  conv = lambda x, w, groups=1: jax.lax.conv_general_dilated(x, w, (1, 1), 'VALID', feature_group_count=groups).sum()
  assert traced_flops.count(conv, x, S((4, 3, 3, 3), F32)).flops == 2 * (2 * 4 * 6 * 6) * (3 * 3 * 3)
  depthwise = lambda x, w: conv(x, w, groups=3)  # Each output feature sees one input channel.
  assert traced_flops.count(depthwise, x, S((6, 1, 3, 3), F32)).flops == 2 * (2 * 6 * 6 * 6) * (3 * 3)
  # The kernel's gradient is a convolution over the batch: as many multiply-adds as the forward, which runs too.
  assert traced_flops.count(jax.grad(conv, argnums=1), x, S((4, 3, 3, 3), F32)).flops == 2 * (2 * 2 * 4 * 36 * 27)
  # A strided convolution's input gradient dilates its input with zeros; those taps are not counted.
  strided = lambda x, w: jax.lax.conv_general_dilated(x, w, (2, 2), 'VALID').sum()
  forward = traced_flops.count(strided, S((1, 1, 8, 8), F32), S((1, 1, 2, 2), F32)).flops
  both = traced_flops.count(jax.grad(strided, argnums=(0, 1)), S((1, 1, 8, 8), F32), S((1, 1, 2, 2), F32)).flops
  assert (forward, both) == (2 * 16 * 4, 3 * 2 * 16 * 4)


def _layers(ws, x, remat=None):
  """tanh(x @ w) for each of the stacked ws, in a scan; rematerialized with `remat` (a policy, or True)."""
  layer = lambda x, w: (jnp.tanh(x @ w), None)
  if remat is not None:
    layer = jax.checkpoint(layer, policy=None if remat is True else remat)
  return jax.lax.scan(layer, x, ws)[0].sum()


def test_a_scan_body_counts_times_its_length_and_rematerialization_is_not_counted():
  ws, x = S((5, 8, 8), F32), S((2, 8), F32)
  assert traced_flops.count(_layers, ws, x).flops == 5 * 2 * 2 * 8 * 8
  plain = traced_flops.count(jax.grad(_layers), ws, x)
  assert plain.flops == 5 * 3 * 2 * 2 * 8 * 8
  for policy in (True, jax.checkpoint_policies.dots_saveable):
    rematted = jax.grad(lambda ws, x: _layers(ws, x, policy))
    assert traced_flops.count(rematted, ws, x) == plain
  # Not vacuous: with nothing saved the gradient's program does hold the recomputed matmul.
  dots = lambda f: str(jax.make_jaxpr(f)(ws, x)).count('dot_general')
  assert dots(jax.grad(lambda ws, x: _layers(ws, x, True))) > dots(jax.grad(_layers))


def test_cond_counts_its_costliest_branch_while_once_and_says_so_shard_map_per_device():
  x, w = S((4, 8), F32), S((8, 8), F32)
  one = 2 * 4 * 8 * 8
  branches = lambda x, w: jax.lax.cond(x.sum() > 0, lambda: x @ w @ w, lambda: x)
  assert traced_flops.count(branches, x, w) == traced_flops.Count(2 * one)
  loop = lambda x, w: jax.lax.while_loop(lambda x: x.sum() < 1, lambda x: x @ w, x)
  counted = traced_flops.count(loop, x, w)
  assert counted == traced_flops.Count(one, unbounded_loops=1)
  assert 'while loop(s) counted for one iteration' in flops.describe_gaps(counted)
  mesh = jax.make_mesh((4, 2), ('a', 'b'), devices=jax.devices())
  sharded = jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P('a'), P()), out_specs=P('a'), axis_names={'a'})
  assert traced_flops.count(sharded, x, w).flops == one  # 4 devices, each a quarter of the rows.


def test_custom_kernels_count_nothing_and_are_named():
  from jax.experimental import pallas as pl

  def double(x_ref, o_ref):
    o_ref[...] = x_ref[...] @ x_ref[...]

  kernel = lambda x: pl.pallas_call(double, out_shape=S((8, 8), F32), interpret=True)(x)
  counted = traced_flops.count(kernel, S((8, 8), F32))
  assert counted == traced_flops.Count(0, opaque=('pallas_call',))
  assert 'pallas_call' in flops.describe_gaps(counted)


def test_attention_kernels_are_counted_as_the_xla_kernels_matmuls():
  from trainer import attention
  q = S((1, 256, 2, 128), jnp.bfloat16)  # A shape splash runs (on CPU in interpret mode).
  loss = lambda q, k, v: attention.dot_product_attention(q, k, v, causal=True, kernel='splash').sum()
  grads = lambda: jax.grad(loss, argnums=(0, 1, 2))  # A new function each time: jax caches traces per function.
  assert 'pallas_call' in traced_flops.count(grads(), q, q, q).opaque
  with attention.xla_for_counting():
    # Scores and weighted sum, forward and two gradients each; the causal mask's half included.
    assert traced_flops.count(grads(), q, q, q) == traced_flops.Count(3 * 2 * (2 * 256 * 256 * 2 * 128))


# The train step of real models.

def _config(module, **model):
  config = module.get_config()
  config.data.source = 'synthetic'
  config.train.compute_dtype = 'float32'
  for key, value in model.items():
    section, name = key.split('__') if '__' in key else ('model', key)
    config[section][name] = value
  return config


def _traced(config) -> float:
  """The step's traced FLOPs, on one device (the count is the same on any mesh; one device builds fastest)."""
  counted = flops.job_step_flops(job_lib.build_job(config, jax.devices()[:1]))
  assert (counted.unbounded_loops, counted.opaque) == (0, ())  # Nothing left out: the count is whole.
  return counted.flops


@pytest.mark.parametrize('module,settings', [
    (tiny, {}),  # Scanned layers, multi-head attention.
    (tiny, {'scan_layers': False, 'num_heads': 4, 'num_kv_heads': 2}),  # Unrolled, grouped-query.
    (tiny, {'scan_layers': False, 'train__remat_policy': 'dots_with_no_batch_dims_saveable'}),
    (tiny, {'train__remat_policy': 'full', 'train__grad_accum_steps': 2, 'tie_embeddings': True}),
    (llama_1b, {'train__remat_policy': 'save_qkv_proj', 'train__grad_accum_steps': 4}),
    # MoE: only the experts_per_token experts a token runs count, in the grouped matmuls and the analytic count.
    (tiny, {'num_experts': 8, 'experts_per_token': 2}),
    (tiny, {'num_experts': 4, 'experts_per_token': 1, 'num_layers': 4, 'moe_layers': 2, 'shared_expert': True,
            'expert_mlp_dim': 48, 'train__remat_policy': 'full'}),
])
def test_the_llama_traced_count_is_the_analytic_matmul_count_with_attention_unhalved(module, settings):
  config = _config(module, **settings)
  traced = _traced(config)
  analytic = flops.step_flops(config.model, config.train.batch_size, config.data.seq_len)
  assert traced == pytest.approx(analytic.matmul_unmasked, rel=0.02)
  # MaxText's convention halves causal attention: the traced count is above it by that half.
  assert traced > analytic.matmul


@pytest.mark.parametrize('remat', ['none', 'full'])
def test_the_vit_traced_count_is_its_matmuls_by_hand(remat):
  config = _config(vit_tiny, num_layers=2, train__remat_policy=remat)
  m, b = config.model, config.train.batch_size
  height, width, channels = config.data.image_shape
  patches, pixels = height * width // m.patch_size ** 2, m.patch_size ** 2 * channels
  d, f = m.d_model, m.mlp_dim
  block = 2 * patches * (4 * d * d + 2 * d * f + 2 * patches * d)  # q, k, v, out; up, down; scores and sum, unmasked.
  # Forward, and two matmuls back for each; the patch embedding only its kernel's gradient (images need none).
  expected = b * (3 * (m.num_layers * block + 2 * d * m.num_classes) + 2 * 2 * patches * pixels * d)
  assert _traced(config) == pytest.approx(expected, rel=1e-9)


def test_a_brought_model_is_counted_too():
  config = _config(tiny, name='tests.custom_models:MlpLM')
  m, tokens = config.model, config.train.batch_size * config.data.seq_len
  assert _traced(config) == 3 * tokens * 2 * (m.d_model * m.mlp_dim + m.mlp_dim * m.vocab_size)


def test_a_step_that_only_traces_under_its_strategy_gets_no_throughput_and_one_warning(caplog):
  class CollectiveLoss:  # Means over the 'batch' axis: only bound under shard_map or pmap.
    def loss(self, params, batch):
      loss = jax.lax.pmean(jnp.mean(batch['inputs'] @ params['w']), 'batch')
      return loss, {'loss': loss}

    def weight(self, batch):
      return jnp.float32(batch['inputs'].shape[0])

    def batch_shapes(self):
      return {'inputs': S((8, 4), F32)}

  config = tiny.get_config()
  config.model.name = 'tests.custom_models:Collective'
  job = types.SimpleNamespace(config=config, task=CollectiveLoss(), abstract=types.SimpleNamespace(
      params={'w': S((4, 4), F32)}), mesh=None, traced={})  # The mesh is only read once the count succeeded.
  with caplog.at_level('WARNING'):
    assert flops.Throughput.for_job(job) is None
  assert ("FLOPs not counted, so no TFLOP/s or MFU: the train step of model.name='tests.custom_models:Collective' "
          'does not trace without a mesh (NameError: Found an unbound axis name: batch') in caplog.text


@pytest.mark.parametrize('strategy,mesh', [('jit', (2, 2, 2)), ('shard_map', (8, 1, 1)), ('pmap', (8, 1, 1))])
def test_the_count_is_the_same_under_every_strategy_and_mesh(strategy, mesh):
  config = _config(tiny, parallel__strategy=strategy, mesh__data=mesh[0], mesh__fsdp=mesh[1], mesh__tensor=mesh[2])
  counted = flops.job_step_flops(job_lib.build_job(config))
  assert counted == flops.job_step_flops(job_lib.build_job(_config(tiny), jax.devices()[:1]))


@pytest.mark.parametrize('settings,from_the_step', [
    ({'mesh__data': 2, 'mesh__fsdp': 2, 'mesh__tensor': 2}, True),
    ({'num_experts': 4, 'experts_per_token': 2, 'train__remat_policy': 'full', 'train__grad_accum_steps': 2,
      'train__batch_size': 16}, True),
    ({'name': 'tests.custom_models:MlpLM'}, True),
    ({'num_experts': 4, 'experts_per_token': 2, 'mesh__data': 4, 'mesh__expert': 2}, False),
    ({'mesh__data': 4, 'mesh__context': 2}, False),
    ({'mesh__data': 4, 'mesh__pipeline': 2, 'train__pipeline_microbatches': 2}, False),
    ({'parallel__strategy': 'shard_map'}, False),
])
def test_a_compiled_steps_own_jaxpr_gives_the_count_of_a_trace_of_its_own(settings, from_the_step):
  """Once the step is compiled, its jaxpr (kept by Job.compile_train_step) is counted instead of tracing the model
  again, where the counting contexts would change nothing; the count is the same either way, and is made once."""
  config = _config(tiny, **settings)
  job = job_lib.build_job(config)
  expected = flops.traced_step_flops(job.task, job.abstract.params, job.task.batch_shapes(),
                                     step_lib.StepOptions.from_config(config.train))
  job.compile_train_step()
  assert (flops._from_the_step(job) is not None) == from_the_step
  assert flops.job_step_flops(job) == expected
  assert flops.job_step_flops(job) is job.traced['flops']  # Counted once.
