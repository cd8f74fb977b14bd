"""Plan mode: the compiled step's memory and FLOPs without training, the memory budget, and TPU and GPU topologies."""

import dataclasses
import importlib.util
import logging
import re

import jax
import pytest

from configs import tiny
from parallel import sharding
from trainer import attention
from trainer.attention import choice
from trainer.base.errors import UserError
from trainer.memory import footprint, gpu_targets
from trainer.observe import flops, traced_flops
from trainer.run import job as job_lib
from trainer.run import plan

TINY = '--config=configs/tiny.py'
FAKE = plan.Plan(mesh_shape={'data': 8, 'fsdp': 1, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1}, device_kind='cpu', params_bytes=0, opt_state_bytes=0,
                 argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=0, code_bytes=0,
                 flops=flops.StepFlops(1.0, 1.0, 1))


def _fake_compiles(monkeypatch, make_plan):
  """Plan mode measures every Job it builds (its fixes too) through trainer/memory/measure.py: the fake sees each."""
  from trainer.memory import measure
  monkeypatch.setattr(measure, 'plan_of', lambda job: make_plan(job.config))


def test_plan_reports_mesh_memory_and_flops_of_the_compiled_step():
  config = tiny.get_config()
  config.mesh.fsdp = 2
  lines = []
  result = plan.run(config, print_fn=lines.append)
  text = '\n'.join(lines)
  assert result.mesh_shape == {'data': 4, 'fsdp': 2, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1}
  assert "mesh {'data': 4, 'fsdp': 2, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1} over 8 x cpu" in text
  assert "Attention: attention kernel xla (model.attention='auto': " in text
  job = job_lib.build_job(config)
  _, totals = sharding.sharding_table(job.abstract, job.shardings)
  assert result.params_bytes == totals['params_bytes_per_device']
  assert result.opt_state_bytes == totals['opt_state_bytes_per_device']
  # The state is donated: its buffers are the outputs' buffers.
  assert result.params_bytes + result.opt_state_bytes <= result.alias_bytes
  assert result.temp_bytes > 0
  assert result.total_bytes == (result.argument_bytes + result.output_bytes - result.alias_bytes
                                + result.temp_bytes + result.code_bytes)
  expected = flops.step_flops(config.model, config.train.batch_size, config.data.seq_len)
  assert result.flops == expected
  assert f'{expected.matmul:.4g}' in text and f'{expected.six_n:.4g}' in text
  traced = flops.job_step_flops(job)
  assert result.traced == traced and traced.flops > expected.matmul  # Causal attention in full.
  assert f'FLOPs per step: {traced.flops:.4g} (every matmul and convolution of the traced' in text
  assert 'v5p' in text and 'at 100% MFU' in text
  assert 'Fits' not in text  # No budget given: nothing to judge.


def test_plan_over_budget_fails_naming_the_changes_that_fit(monkeypatch):
  """The search over fixes, with a stand-in for the compile: memory falls with fsdp, remat and accumulation."""
  compiled_configs = []

  def fake_make_plan(config, devices=None):
    job_lib.build_job(config)  # The real validation: impossible candidates raise UserError here.
    compiled_configs.append(config)
    t = config.train
    gib = (8 / config.mesh.fsdp) * (0.5 if t.remat_policy == 'full' else 1) / t.grad_accum_steps * t.batch_size / 8
    return dataclasses.replace(FAKE, argument_bytes=int(gib * plan.GIB))

  _fake_compiles(monkeypatch, fake_make_plan)
  config = tiny.get_config()
  config.train.batch_size = 16  # 2 sequences per device: accumulation over 2 microbatches is possible.
  lines = []
  with pytest.raises(UserError) as e:
    plan.run(config, memory_gb=5, print_fn=lines.append)
  message = str(e.value)
  assert message.startswith('the plan needs 16.00 GiB per device, over the budget of 5.00 GiB (--plan_memory_gb=5).')
  # Alone, each fix halves the 16 GiB (8 GiB: no fit); all the layout changes together reach 2 GiB.
  assert message.endswith('Changes that fit: --config.train.remat_policy=full --config.mesh.fsdp=2 '
                          '--config.mesh.data=-1 --config.train.grad_accum_steps=2 (2.00 GiB).')
  text = '\n'.join(lines)
  assert 'Does not fit: 16.00 GiB per device' in text
  assert '  --config.train.batch_size=8: 8.00 GiB per device' in text
  assert config.train.remat_policy == 'none'  # Candidates are copies; the user's config is untouched.
  assert '  --config.mesh.pipeline=2 --config.mesh.data=-1: 16.00 GiB per device' in text  # Proposed, alone.
  assert len(compiled_configs) == 7  # The plan itself, five single changes, and the layout changes together.


def test_plan_candidates_that_the_mesh_cannot_take_are_reported_not_raised(monkeypatch):
  _fake_compiles(monkeypatch, lambda config, devices=None: (
      job_lib.build_job(config), dataclasses.replace(FAKE, argument_bytes=plan.GIB))[1])
  lines = []
  with pytest.raises(UserError, match='None of remat, a chunked loss, more fsdp, accumulation or a smaller batch fits'):
    plan.run(tiny.get_config(), memory_gb=0.5, print_fn=lines.append)  # tiny: 1 sequence per device.
  assert any('--config.train.batch_size=4: not possible here (train.batch_size=4 does not divide' in l for l in lines)
  assert not any('grad_accum_steps' in l for l in lines)  # Never offered: it cannot split 1 sequence.


def test_a_chunked_loss_is_proposed_where_the_logits_weigh_on_the_budget():
  config = tiny.get_config()  # 8 rows x 32 positions x 256 vocab: 256 KiB of float32 logits, 1 row per device.
  flags = lambda budget, mesh=(8, 1, 1): [f for f, _ in plan._candidates(config, dict(zip(('data', 'fsdp', 'tensor'),
                                                                                         mesh)), budget)]
  assert '--config.train.loss_chunks=8' in flags(budget=32 * 2**10 * 20)  # 32 KiB per device, at 5% of 640 KiB.
  assert not any('loss_chunks' in f for f in flags(budget=32 * 2**10 * 21))
  assert not any('loss_chunks' in f for f in flags(budget=32 * 2**10 * 20, mesh=(8, 1, 2)))  # Half the vocab each.
  assert not any('loss_chunks' in f for f in flags(budget=None))
  config.data.seq_len = 31  # A prime: no way to cut it.
  assert not any('loss_chunks' in f for f in flags(budget=1))


def test_a_larger_expert_axis_is_proposed_for_a_mixture_of_experts():
  config = tiny.get_config()
  shape = lambda data, expert: {'data': data, 'fsdp': 1, 'pipeline': 1, 'expert': expert, 'tensor': 1}
  flags = lambda shape: [f for f, _ in plan._candidates(config, shape, None)]
  assert not any('mesh.expert' in f for f in flags(shape(8, 1)))  # A dense model has no experts to split.
  config.model.num_experts = 8
  assert '--config.mesh.expert=2 --config.mesh.data=-1' in flags(shape(8, 1))
  config.mesh.expert = 8
  assert not any('mesh.expert' in f for f in flags(shape(1, 8)))  # Every expert on its own device already.


def test_launcher_plan_needs_no_workdir_and_topology_needs_plan(launcher):
  result = launcher(TINY, '--plan', '--config.model.num_layers=1')
  assert result.returncode == 0, result.stderr[-2000:]
  assert "Plan: mesh {'data': 8, 'fsdp': 1, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1}" in result.stdout
  assert 'temporaries' in result.stdout and 'FLOPs per step' in result.stdout
  result = launcher(TINY, '--workdir=/tmp/unused', '--topology=v5p:2x2x2')
  assert result.returncode == 2
  assert result.stderr.strip() == 'launch.py: error: --plan_memory_gb and --topology only apply with --plan.'


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                    reason='needs the optional TPU compiler: pip install -r requirements-tpu-plan.txt')
def test_topology_compiles_the_real_step_for_a_tpu_slice():
  config = tiny.get_config()
  lines = []
  result = plan.run(config, topology='v5p:2x2x2', print_fn=lines.append)
  text = '\n'.join(lines)
  assert result.device_kind == 'TPU v5' and result.mesh_shape == {'data': 8, 'fsdp': 1, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1}
  assert 'compute dtype bfloat16' in text  # 'auto' means bfloat16 on the TPU, not float32 as on this CPU.
  assert result.temp_bytes > 0 and result.alias_bytes >= result.params_bytes + result.opt_state_bytes
  assert 'Fits:' in text and 'of 95.00 GiB per device' in text  # Judged against one v5p chip's HBM.


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                    reason='needs the optional TPU compiler: pip install -r requirements-tpu-plan.txt')
def test_a_tpu_plan_prints_no_libtpu_complaints_about_the_missing_tpu(launcher):
  result = launcher(TINY, '--plan', '--topology=v5p:2x2x1')
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'Fits:' in result.stdout
  assert not [line for line in result.stderr.splitlines() if line.startswith(('E0000', 'WARNING', 'Failed'))], \
      result.stderr


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is not None, reason='libtpu is installed here')
def test_topology_without_libtpu_names_the_optional_requirements_file(launcher):
  result = launcher(TINY, '--plan', '--topology=v5p:2x2x2')
  assert result.returncode == 2
  assert "--topology='v5p:2x2x2' needs the TPU compiler" in result.stderr
  assert 'pip install -r requirements-tpu-plan.txt' in result.stderr


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                    reason='needs the optional TPU compiler: pip install -r requirements-tpu-plan.txt')
def test_topology_plan_runs_splash_attention_in_far_less_memory_than_xla(caplog):
  """The real train step for v5p, long rows: 'auto' picks splash (the mesh's devices are TPUs, not this CPU)."""
  choice._LOGGED.clear()  # pylint: disable=protected-access  (the kernel is logged once per process)
  config = tiny.get_config()
  config.data.seq_len, config.train.batch_size = 2048, 8
  config.model.update(num_layers=1, d_model=256, num_heads=2, mlp_dim=512)  # Heads of 128, as on TPU pods.
  temp_bytes, printed = {}, {'auto': [], 'xla': []}
  for setting in ('auto', 'xla'):
    config.model.attention = setting
    with caplog.at_level(logging.INFO):
      temp_bytes[setting] = plan.run(config, topology='v5p:2x2x1', print_fn=printed[setting].append).temp_bytes
  logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith('Attention kernel')]
  assert logged == ["Attention kernel splash (model.attention='auto': the fastest kernel on tpu)",
                    "Attention kernel xla (model.attention='xla': named in the config)"]
  # XLA keeps the (2 rows, 2 heads, 2048, 2048) float32 scores per chip for the backward pass (64 MiB); splash
  # streams blocks through VMEM and keeps only (rows, heads, length) softmax statistics.
  assert temp_bytes['xla'] > 64 * 2**20
  assert temp_bytes['auto'] < temp_bytes['xla'] / 4
  assert "Attention: attention kernel splash (model.attention='auto': the fastest kernel on tpu)" in '\n'.join(
      printed['auto'])


def test_compiler_refusal_is_the_same_verdict_with_fixes(monkeypatch):
  """XLA TPU's CompileTimeHbmOom (a JaxRuntimeError at compile) becomes a Refused plan and a one-line verdict."""
  text = ('RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. CompileTimeHbmOom: the total memory required for '
          'HLO temporaries (124.35G) exceeds available HBM (95.73G).')

  class RefusingJob:
    def compile_train_step(self):
      raise jax.errors.JaxRuntimeError(text)

  with pytest.raises(footprint.CompilerRefused) as e:
    footprint.compile_step(RefusingJob())
  assert (e.value.needed_bytes, e.value.available_bytes) == (int(124.35 * 2**30), int(95.73 * 2**30))

  def fake_make_plan(config, devices=None):
    job_lib.build_job(config)
    if config.train.batch_size == 16:
      raise plan.Refused(footprint.CompilerRefused(int(124.35 * 2**30), int(95.73 * 2**30), text),
                         {'data': 8, 'fsdp': 1, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1})
    return dataclasses.replace(FAKE, argument_bytes=int(63.1 * plan.GIB) if config.train.batch_size == 8 else 2**40)

  _fake_compiles(monkeypatch, fake_make_plan)
  config = tiny.get_config()
  config.train.batch_size, config.train.remat_policy = 16, 'full'
  lines = []
  with pytest.raises(UserError) as e:
    plan.run(config, memory_gb=95, print_fn=lines.append)
  assert str(e.value) == ("the plan needs more than 124.35 GiB (the compiler's figure for temporaries alone) per "
                          'device, over the budget of 95.00 GiB '
                          '(--plan_memory_gb=95). Changes that fit: --config.train.batch_size=8 (63.10 GiB).')
  assert any(l.startswith('The compiler refused the step: RESOURCE_EXHAUSTED') for l in lines)
  assert 'Does not fit: more than 124.35 GiB per device, over the 95.00 GiB available (--plan_memory_gb=95).' in lines


def test_one_chip_is_singular_and_the_tied_table_is_not_counted():
  config = tiny.get_config()
  config.model.tie_embeddings = True
  one = dataclasses.replace(FAKE, mesh_shape={'data': 1, 'fsdp': 1, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1},
                            flops=flops.step_flops(config.model, 8, 32))
  text = plan.report(one, config)
  assert 'on 1 chip of each kind' in text
  m = config.model
  untied = flops.step_flops(plan.with_overrides(config, {'model.tie_embeddings': False}).model, 8, 32)
  # 6N's N names what it counts: tied, the head's matmul is still done, so N is what the untied model counts.
  head = m.d_model * m.vocab_size
  assert (f'N = {untied.non_embedding_params:,} parameters used ({untied.non_embedding_params - head:,} '
          f"non-embedding and the tied output head's {head:,}") in text
  assert 'N = ' + f'{untied.non_embedding_params:,} non-embedding' in plan.report(
      dataclasses.replace(one, flops=untied), config)


def test_any_model_gets_its_traced_flops_and_the_step_times_they_imply():
  config = tiny.get_config()
  config.model.name = 'tests.custom_models:MlpLM'
  counted = dataclasses.replace(FAKE, flops=None, traced=traced_flops.Count(8e12, unbounded_loops=1))
  text = plan.report(counted, config)
  assert 'FLOPs per step: 8e+12 (every matmul and convolution of the traced forward and backward' in text
  assert '1 while loop(s) counted for one iteration' in text and 'Analytic' not in text
  # 8e12 FLOPs over 8 chips of 459 TFLOP/s.
  assert f'v5p     459 TFLOP/s bf16:   {8e12 / 8 / 459e12 * 1e3:.3f} ms at 100% MFU' in text
  assert "Attention: the model's own (not a built-in model)" in text
  uncounted = plan.report(dataclasses.replace(FAKE, flops=None), config)
  assert "FLOPs per step: not counted for model.name='tests.custom_models:MlpLM'" in uncounted


CUDA_PLUGIN = gpu_targets.cuda_plugin_installed()


@pytest.mark.skipif(not CUDA_PLUGIN, reason="needs jax's CUDA plugin: pip install -r requirements-gpu-plan.txt")
@pytest.mark.parametrize('topology, flags, mesh', [
    ('h100:2', (), "{'data': 2, 'fsdp': 1, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1}"),
    ('h100:8', ('--config.mesh.data=2', '--config.mesh.fsdp=2', '--config.mesh.tensor=2'),
     "{'data': 2, 'fsdp': 2, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 2}"),  # cuDNN's attention partitioned over heads and rows.
])
def test_gpu_topology_compiles_the_real_step_for_h100s_with_cudnn_attention(launcher, topology, flags, mesh):
  result = launcher(TINY, '--plan', f'--topology={topology}', '--config.model.num_layers=1', *flags)
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"mesh {mesh} over {topology[5:]} x NVIDIA H100 80GB HBM3" in result.stdout
  assert 'compute dtype bfloat16' in result.stdout  # 'auto' read for the GPU, not for this CPU.
  assert "Attention: attention kernel cudnn (model.attention='auto': the fastest kernel on gpu)" in result.stdout
  assert "of 71.20 GiB per device" in result.stdout  # Judged against what a run allocates of one H100.
  assert "90% (XLA_CLIENT_MEM_FRACTION) of one NVIDIA H100 80GB HBM3's 79.11 GiB)" in result.stdout


@pytest.mark.skipif(CUDA_PLUGIN, reason="jax's CUDA plugin is installed here")
def test_gpu_topology_without_the_cuda_plugin_names_the_optional_requirements_file(launcher):
  result = launcher(TINY, '--plan', '--topology=h100:8')
  assert result.returncode == 2
  assert "--topology='h100:8' needs jax's CUDA plugin" in result.stderr
  assert 'pip install -r requirements-gpu-plan.txt' in result.stderr


@pytest.mark.parametrize('topology, is_gpu', [('h100', True), ('h100:8', True), ('H100:2x8', True),
                                              ('v5p:2x2x1', False), ('h100:8x', False), ('a100:8', False)])
def test_gpu_topologies_are_told_from_tpu_slices(topology, is_gpu):
  assert gpu_targets.is_gpu_topology(topology) is is_gpu


def test_a_gpu_topology_of_no_gpus_is_refused_before_jax_is_asked():
  with pytest.raises(UserError, match="--topology='h100:0' names no GPU; write e.g. h100, h100:8"):
    gpu_targets.devices('h100:0')


def test_a_gpu_plan_is_judged_against_the_share_of_memory_a_run_allocates(monkeypatch):
  h100 = type('CompileOnlyDevice', (), {'device_kind': 'NVIDIA H100 80GB HBM3'})()
  monkeypatch.delenv('XLA_CLIENT_MEM_FRACTION', raising=False)
  monkeypatch.delenv('XLA_PYTHON_CLIENT_MEM_FRACTION', raising=False)
  assert gpu_targets.memory_limit(h100).bytes == int(0.90 * 84942979072)
  monkeypatch.setenv('XLA_CLIENT_MEM_FRACTION', '0.5')
  limit = gpu_targets.memory_limit(h100)
  assert limit.bytes == 84942979072 // 2
  assert limit.source == "50% (XLA_CLIENT_MEM_FRACTION) of one NVIDIA H100 80GB HBM3's 79.11 GiB"


@pytest.mark.parametrize('packed, head_dim, refused', [
    (False, 64, None),
    (True, 64, 'cannot trace cuDNN attention over packed rows on this host'),
    (False, 256, 'cannot trace cuDNN attention with head dim 256 on this host'),
])
def test_a_gpu_plan_off_a_gpu_refuses_what_jax_will_not_trace_before_compiling(packed, head_dim, refused):
  """jax's cuDNN checks read this (CPU) host's architecture, so packed rows and head dims over 128 fail there."""
  call = attention.Call('gpu', 'bfloat16', (8, 1024, 16, head_dim), (8, 1024, 4, head_dim), causal=True,
                        packed=packed, gpu_capability=9.0)
  if refused is None:
    gpu_targets.check_traceable(call)
  else:
    with pytest.raises(UserError, match=refused):
      gpu_targets.check_traceable(call)


def test_plan_says_remat_auto_and_the_flops_once(caplog):
  """remat 'auto' compiles several candidates: the choice and the FLOPs count are still said once each."""
  caplog.set_level(logging.INFO)
  config = tiny.get_config()
  config.train.remat_policy = 'auto'
  lines = []
  plan.run(config, memory_gb=1, print_fn=lines.append)
  said = lines + [r.getMessage() for r in caplog.records]
  assert sum("remat 'auto': 'none'" in s for s in said) == 1, said
  assert sum('FLOPs per step' in s for s in said) == 1, said


def test_plan_names_the_optimizer_and_counts_the_parameter_average():
  config = tiny.get_config()
  config.train.optimizer, config.train.ema_decay = 'adafactor', 0.99
  result = plan.make_plan(config)
  text = plan.report(result, config)
  assert f'optimizer state     {plan.footprint.gib(result.opt_state_bytes)} (adafactor)' in text
  # The float32 average, sharded like the (float32) parameters: as many bytes per device.
  assert result.ema_bytes == result.params_bytes > 0
  assert 'parameter average' in text
  assert result.params_bytes + result.opt_state_bytes + result.ema_bytes <= result.alias_bytes


def test_the_header_names_the_topologys_chips_where_the_device_kind_is_vaguer():
  config = tiny.get_config()
  header = lambda kind, topology: plan.report(dataclasses.replace(FAKE, device_kind=kind), config,
                                              topology).splitlines()[0]
  assert ' over 8 x v5p (TPU v5); ' in header('TPU v5', 'v5p:2x2x2')  # libtpu's device kind for a v5p chip.
  assert ' over 8 x TPU v4; ' in header('TPU v4', 'v4:2x2x2')
  assert ' over 8 x NVIDIA H100 80GB HBM3; ' in header('NVIDIA H100 80GB HBM3', 'h100:8')
  assert ' over 8 x cpu; ' in header('cpu', None)


def test_a_plan_says_its_attention_kernel_once(launcher):
  result = launcher(TINY, '--plan')
  assert result.returncode == 0, result.stderr[-3000:]
  said = [l for l in (result.stdout + result.stderr).splitlines() if 'ttention kernel xla' in l]
  assert said == ["Attention: attention kernel xla (model.attention='auto': no fused kernel on cpu)"], said


@pytest.mark.parametrize('topology, expected', [('2xv5p:2x2x2', (2, 'v5p:2x2x2')), ('v5p:4x4x4', (1, 'v5p:4x4x4')),
                                                ('16xv5e:16x16', (16, 'v5e:16x16')), ('h100:2x8', (1, 'h100:2x8'))])
def test_a_topology_names_its_slices_with_a_count_in_front(topology, expected):
  assert plan.split_slices(topology) == expected


def test_two_slices_split_on_data_are_offered_fsdp_or_a_pipeline_across_the_slices():
  """mesh.data=1 inside each slice, dcn_data=2 between two: twice the fsdp or pipeline within a slice cannot be
  built (each slice's chips are taken), across the slices it can; within one slice the proposals stay there."""
  config = plan.with_overrides(tiny.get_config(), {'mesh.dcn_data': 2, 'mesh.data': 1, 'mesh.fsdp': 4})
  shape = {'data': 2, 'fsdp': 4, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1}
  flags = [f for f, _ in plan._candidates(config, shape, None)]
  assert '--config.mesh.dcn_fsdp=2 --config.mesh.dcn_data=1' in flags
  assert '--config.mesh.dcn_pipeline=2 --config.mesh.dcn_data=1' in flags
  assert not any(f.startswith(('--config.mesh.fsdp=', '--config.mesh.pipeline=')) for f in flags)
  config = plan.with_overrides(config, {'mesh.dcn_data': 1, 'mesh.data': 2})  # One slice: data=2 within it.
  flags = [f for f, _ in plan._candidates(config, shape, None)]
  assert '--config.mesh.fsdp=8 --config.mesh.data=-1' in flags
  assert '--config.mesh.pipeline=2 --config.mesh.data=-1' in flags
  assert not any('dcn_' in f for f in flags)


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                    reason='needs the optional TPU compiler: pip install -r requirements-tpu-plan.txt')
def test_a_model_refused_over_two_slices_on_data_fits_with_the_pipeline_the_plan_proposes():
  """Weights decide the fit (8 layers of d_model 512, 8 rows of 32): over two v5p 2x2x1 slices with the data axis
  across them, each chip holds a quarter of the parameters and the plan refuses; it proposes the pipeline across
  the slices (each chip a quarter of half the layers), and that advice, followed, fits. Per chip, measured with
  libtpu 0.0.51: 174 MiB on data, 121 MiB pipelined, 132 MiB with fsdp across the slices; the budget is 143 MiB."""
  config = plan.with_overrides(tiny.get_config(), {
      'model.num_layers': 8, 'model.d_model': 512, 'model.mlp_dim': 2048, 'model.num_heads': 8,
      'model.num_kv_heads': 8, 'mesh.dcn_data': 2, 'mesh.data': 1, 'mesh.fsdp': 4, 'train.batch_size': 8})
  with pytest.raises(UserError) as e:
    plan.run(config, memory_gb=0.14, topology='2xv5p:2x2x1', print_fn=lambda line: None)
  advice = re.search(r'(--config\.mesh\.dcn_pipeline=2 --config\.mesh\.dcn_data=1) \(([\d.]+) MiB\)', str(e.value))
  assert advice, str(e.value)
  followed = plan.with_overrides(config, dict(
      (key, int(value)) for key, value in (flag.removeprefix('--config.').split('=') for flag in advice.group(1).split())))
  lines = []
  result = plan.run(followed, memory_gb=0.14, topology='2xv5p:2x2x1', print_fn=lines.append)
  assert result.mesh_shape['pipeline'] == 2 and result.mesh_shape['data'] == 1
  assert result.total_bytes / 2**20 == pytest.approx(float(advice.group(2)), abs=0.01)
  assert any(line.startswith('Fits: ') for line in lines)


@pytest.mark.skipif(importlib.util.find_spec('libtpu') is None,
                    reason='needs the optional TPU compiler: pip install -r requirements-tpu-plan.txt')
def test_a_pipeline_across_two_tpu_slices_compiles_with_point_to_point_stage_transfers():
  """Two v5p 2x2x1 slices, the pipeline axis across them (mesh.dcn_pipeline=2), FSDP inside each: the plan
  compiles, states the stages, and the stages hand one microbatch's activations on point to point (between
  slices libtpu lowers the collective-permute to a one-to-one DCN send/recv), never all-gathered."""
  config = plan.with_overrides(tiny.get_config(), {
      'model.num_layers': 4, 'mesh.dcn_pipeline': 2, 'mesh.data': 1, 'mesh.fsdp': 4, 'train.batch_size': 8,
      'train.pipeline_microbatches': 2})
  lines = []
  result = plan.run(config, topology='2xv5p:2x2x1', print_fn=lines.append)
  text = '\n'.join(lines)
  assert result.mesh_shape == {'data': 1, 'fsdp': 4, 'pipeline': 2, 'expert': 1, 'context': 1, 'tensor': 1}
  assert 'pipeline: 2 stages' in text and 'bubble 33.3%' in text
  devices = plan.topology_devices('2xv5p:2x2x1')
  assert sorted({d.slice_index for d in devices}) == [0, 1]
  config = plan.with_overrides(config, {"train.compute_dtype": "bfloat16"})
  hlo = job_lib.build_job(config, devices).compile_train_step().as_text()
  d_model, seq = config.model.d_model, config.data.seq_len
  activations = rf'\[[\d,]*{seq},{d_model}\]'
  # The rows of one microbatch on one device: batch 8 / 2 microbatches / fsdp 4 = 1 row of (seq, d_model).
  one_microbatch = rf'bf16\[1,{seq},{d_model}\]'
  send = re.compile(r'= \(' + one_microbatch + r'\S*, u32\[\]\S*, token\[\]\) send\(')
  sends = [line for line in hlo.splitlines() if send.search(line)]
  assert sends and all('_xla_megascale_transfer_type="ONE_TO_ONE"' in line for line in sends)
  assert not re.search(activations + r'\S* all-gather(-start)?\(', hlo)
