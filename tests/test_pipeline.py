"""Pipeline parallelism (mesh.pipeline, trainer/pipeline/): the numbers of the unpipelined model, and refusals.

In-process `trainer.run.loop.run` on the 8 fake CPU devices, float32, an 8-layer tiny Llama (grouped-query attention,
packed rows, as tests/test_context_training.py), so positions and document masks travel with the stages.
"""

import contextlib
import re
import shutil
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from conftest import read_metrics
from test_context_training import _assert_same, _config as _context_config

from parallel import sharding
from trainer import pipeline
from trainer.base.errors import UserError
from trainer.models import llama
from trainer.observe import flops
from trainer.run import job as job_lib
from trainer.run import loop, plan

LAYERS = 8


def _config(pipe=1, data=8, fsdp=1, repeats=1, micro=0, steps=10, tensor=1):
  c = _context_config(data=data, fsdp=fsdp, tensor=tensor, steps=steps)
  c.model.num_layers = LAYERS
  c.mesh.pipeline = pipe
  c.train.pipeline_repeats, c.train.pipeline_microbatches = repeats, micro
  return c


def _train(workdir, config) -> list[dict]:
  loop.run(config, str(workdir), devices=jax.devices()[:8])
  return read_metrics(workdir)


@pytest.fixture(scope='module')
def unpipelined_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('unpipelined')
  return workdir, _train(workdir, _config())


@pytest.fixture(scope='module')
def pipe4_run(tmp_path_factory):
  """pipeline=4 x data=2, two repeats of one layer per stage over 4 microbatches; checkpoints at 4 and 8."""
  workdir = tmp_path_factory.mktemp('pipe4')
  return workdir, _train(workdir, _config(pipe=4, data=2, repeats=2, micro=4))


def test_pipeline_of_four_with_repeats_trains_the_unpipelined_numbers(pipe4_run, unpipelined_run):
  _assert_same(pipe4_run[1], unpipelined_run[1])


# (pipeline, data, fsdp, repeats, microbatches): 2 and 4 stages, 1 and 2 repeats, with data and fsdp.
@pytest.mark.parametrize('shape', [(2, 2, 2, 1, 0), (2, 4, 1, 2, 2), (4, 1, 2, 1, 4)],
                         ids=lambda s: 'pipe{}_data{}_fsdp{}_repeats{}_micro{}'.format(*s))
def test_pipelines_train_the_unpipelined_numbers(shape, unpipelined_run, tmp_path):
  _assert_same(_train(tmp_path, _config(*shape)), unpipelined_run[1])


def test_remat_per_stage_grad_accum_and_tensor_train_the_same_numbers(unpipelined_run, tmp_path):
  config = _config(pipe=2, data=2, tensor=2, repeats=2)
  config.train.remat_policy = 'full'
  config.train.grad_accum_steps = 2
  _assert_same(_train(tmp_path, config), unpipelined_run[1])


def test_checkpoint_from_pipeline_four_resumes_at_pipeline_one(pipe4_run, unpipelined_run, tmp_path):
  """Step 8 saved at pipeline=4 resumes at pipeline=1 (data=8): steps 9 and 10 are the unpipelined run's."""
  workdir = tmp_path / 'resumed'
  shutil.copytree(pipe4_run[0], workdir)
  shutil.rmtree(workdir / 'checkpoints' / '10')
  records = _train(workdir, _config())
  _assert_same(records[10:], unpipelined_run[1], steps=range(9, 11))


def _mesh(pipe, data):
  return jax.make_mesh((data, pipe), ('data', 'pipeline'), axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:data * pipe])


@pytest.mark.parametrize('schedule', [(2, 2, 1), (4, 4, 2), (4, 8, 1), (2, 4, 4), (4, 4, 2, 'no mesh')], ids=str)
def test_one_steps_gradients_equal_a_plain_layer_stack(schedule):
  """float32 Llama blocks: the pipelined stack's output and gradients against a Python loop over the layers
  (without a mesh the stages run as a vmap on one device)."""
  stages, micro, repeats = schedule[:3]
  cfg = llama.LlamaConfig(num_layers=LAYERS, d_model=16, num_heads=2, mlp_dim=32, vocab_size=64, num_kv_heads=1)
  block = llama.Block(cfg, parent=None)
  rows, length = 8, 8
  x = jax.random.normal(jax.random.key(1), (rows, length, 16))
  positions = jnp.broadcast_to(jnp.arange(length), (rows, length))
  keys = jax.random.split(jax.random.key(0), LAYERS)
  stacked = jax.jit(jax.vmap(lambda k: block.init(k, x[:1], positions[:1])['params']))(keys)

  @jax.jit  # One compile; run eagerly, the loop compiled each of its ~300 operations on its own (36 s of CPU).
  def plain(params):
    y = x
    for i in range(LAYERS):
      y = block.apply({'params': jax.tree.map(lambda p: p[i], params)}, y, positions)[0]
    return jnp.mean(jnp.sin(y) * y)

  mesh = None if len(schedule) > 3 else _mesh(stages, 8 // stages)
  layer = lambda p, y, pos, seg: block.apply({'params': p}, y, pos, seg)[0]

  @jax.jit
  def piped(params):
    y = pipeline.run(layer, params, x, (positions, None), pipeline.Schedule(stages, micro, repeats), mesh,
                     batch_axes='data')
    return jnp.mean(jnp.sin(y) * y)

  np.testing.assert_allclose(piped(stacked), plain(stacked), rtol=1e-5)
  got, want = jax.jit(jax.grad(piped))(stacked), jax.jit(jax.grad(plain))(stacked)
  # atol: float32 noise. The unpipelined stack in one jitted lax.scan differed from this loop, run eagerly, by up to
  # 1.16x an atol of 1e-6 x the largest gradient (measured, 2026-11-26); a wrong layer or microbatch is O(1) off.
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=4e-6 * np.abs(w).max())


@pytest.mark.parametrize('repeats', [1, 2])
def test_stages_pass_activations_by_collective_permute(repeats):
  """pipeline=4 x data=2: one stage's microbatch activations (1 row per device x 32 positions x 32 channels) move
  between stages point to point, and nothing is all-gathered (neither activations nor layers; with 2 repeats the
  layers regroup to the circular stages by collective-permute)."""
  job = job_lib.build_job(_config(pipe=4, data=2, micro=4, repeats=repeats), jax.devices()[:8])
  hlo = job.compile_train_step().as_text()
  assert re.search(r'= f32\[1,32,32\]\S* collective-permute(-start)?\(', hlo)
  assert 'all-gather' not in hlo
  assert job.shardings.params['layers']['attention']['query']['kernel'].spec[0] == 'pipeline'


def test_describe_names_stages_layers_and_bubble():
  line = pipeline.describe(pipeline.Schedule(4, 4, 2), LAYERS)
  assert line.startswith('pipeline: 4 stages x 2 repeat(s) of 1 layer(s), 4 microbatches, 11 iterations a step, '
                         'bubble 27.3% = (S-1)/(repeats x microbatches + S-1)')
  assert 'stage 0: 0-0, 4-4; stage 1: 1-1, 5-5' in line


@pytest.mark.parametrize('change, message', [
    (dict(pipe=4, repeats=3), r'model.num_layers=8 does not split into mesh.pipeline=4 stages x '
                              r'train.pipeline_repeats=3'),
    (dict(pipe=4, micro=2), r'train.pipeline_microbatches=2 is fewer than the mesh.pipeline=4 stages'),
    (dict(pipe=2, micro=3), r'= 8 rows a pass do not split into train.pipeline_microbatches=3'),
    (dict(pipe=2, repeats=0), r'train.pipeline_repeats=0 must be an integer >= 1'),
])
def test_settings_that_cannot_pipeline_are_refused_in_one_line(change, message, tmp_path):
  config = _config(data=2, **change)
  with pytest.raises(UserError, match=message):
    loop.run(config, str(tmp_path))
  assert not (tmp_path / 'checkpoints').exists()


def test_per_device_rows_that_cannot_split_are_refused():
  config = _config(pipe=2, data=4, micro=4)  # 8 rows over 4 devices: 2 each, not 4 microbatches.
  with pytest.raises(UserError, match=r'do not split into train.pipeline_microbatches=4 on every device; use a batch '
                                      r'of rows divisible by 16'):
    job_lib.build_job(config, jax.devices()[:8])


@pytest.mark.parametrize('setting, message', [
    ({'parallel.strategy': 'shard_map'}, r"parallel.strategy='shard_map' cannot pipeline \(mesh.pipeline=2\)"),
    ({'model.name': 'tests.custom_models:own_attention_lm'},
     r"cannot be pipelined \(mesh.pipeline=2\): the launcher cannot see a brought model's layers; to be pipelined "
     r"its builder takes a pipeline= keyword"),
    ({'model.name': 'vit', 'model.task': 'classifier'}, r"model.name='vit' cannot be pipelined \(mesh.pipeline=2\): "
                                                        r"it has no layer stack to split"),
    ({'model.scan_layers': False}, r"model.scan_layers=False unrolls these 8 layers"),
    ({'model.num_experts': 4}, r'does not pipeline mixture-of-experts layers'),
])
def test_strategies_and_models_that_cannot_pipeline_are_refused(setting, message, tmp_path):
  config = _config(pipe=2, data=4)
  for key, value in setting.items():
    section, name = key.split('.')
    config[section][name] = value
  with pytest.raises(UserError, match=message):
    loop.run(config, str(tmp_path))


def test_without_a_pipeline_the_model_has_no_schedule():
  job = job_lib.build_job(_config(steps=1), jax.devices()[:8])
  assert job.task.model is not None and job.mesh.shape['pipeline'] == 1
  assert pipeline.from_config(job.config.train, job.mesh) is None
  assert job.shardings.params['layers']['attention']['query']['kernel'].spec[0] is None


def test_plan_states_the_stages_and_the_smaller_per_device_parameters():
  """--plan's report at pipeline=4 names the stages and bubble; each device holds a quarter of the layers."""
  lines = []
  piped = plan.run(_config(pipe=4, data=2, repeats=2, micro=4, steps=1), print_fn=lines.append)
  text = '\n'.join(lines)
  assert ('pipeline: 4 stages x 2 repeat(s) of 1 layer(s), 4 microbatches, 11 iterations a step, bubble 27.3%'
          in text)
  assert 'parameters' in text and piped.mesh_shape['pipeline'] == 4
  whole = plan.run(_config(steps=1), print_fn=lambda line: None)
  job = job_lib.build_job(_config(steps=1), jax.devices()[:8])
  layers = sum(x.size * 4 for x in jax.tree.leaves(job.abstract.params['layers']))  # float32 bytes, every layer.
  assert whole.params_bytes - piped.params_bytes == pytest.approx(layers * 3 / 4, rel=1e-6)


def test_launcher_refuses_in_one_line_with_exit_code_2(launcher, tmp_path):
  result = launcher('--config=configs/tiny.py', f'--workdir={tmp_path}', '--config.model.num_layers=8',
                    '--config.mesh.pipeline=4', '--config.mesh.data=2', '--config.train.pipeline_microbatches=2')
  assert result.returncode == 2, result.stderr[-2000:]
  errors = [line for line in result.stderr.splitlines() if 'train.pipeline_microbatches=2 is fewer' in line]
  assert len(errors) == 1 and 'use at least 4 (0 picks 4)' in errors[0]
  assert not (tmp_path / 'checkpoints').exists()


def test_a_brought_model_meeting_the_contract_trains_the_same_pipelined(tmp_path):
  """tests/pipelined_models.py runs its own stack through trainer.pipeline.run when its builder is given a schedule."""
  def brought(pipe, data):
    c = _config(pipe=pipe, data=data, steps=4)
    c.data.packing, c.model.check_alignment = False, False
    c.model.name = 'tests.pipelined_models:stack_lm'
    return c
  reference = _train(tmp_path / 'whole', brought(1, 8))
  _assert_same(_train(tmp_path / 'piped', brought(4, 2)), reference, steps=range(1, 5))
  job = job_lib.build_job(brought(4, 2), jax.devices()[:8])  # It did run the schedule: stages permute activations.
  assert job.shardings.params['w'].spec[0] == 'pipeline'
  assert 'collective-permute' in job.compile_train_step().as_text()


def test_the_counted_flops_are_the_unpipelined_models_not_the_bubbles():
  """MFU counts the model's work: the schedule runs every stage in every iteration (the bubble's on discarded
  zeros), so a count of its jaxpr would be (R*M + S - 1)/(R*M) of the stack's, 1.75x at S=M=4 (R=1)."""
  plain = flops.job_step_flops(job_lib.build_job(_config(), jax.devices()[:8]), log=False).flops
  piped_job = job_lib.build_job(_config(pipe=4, data=2, micro=4), jax.devices()[:8])
  assert flops.job_step_flops(piped_job, log=False).flops == pytest.approx(plain, rel=1e-6)
  piped_job.traced.clear()  # A Job keeps its count: count afresh.
  with pytest.raises(AssertionError):  # The count without the fallback: the bubble included, so this can fail.
    with mock.patch.object(pipeline, 'unpipelined_for_counting', contextlib.nullcontext):
      assert flops.job_step_flops(piped_job, log=False).flops == pytest.approx(plain, rel=0.05)


def test_remat_full_keeps_only_each_layers_inputs():
  """train.remat_policy='full' inside the stages: the step keeps no layer's MLP hidden activations, neither across
  the schedule's iterations (with 'none' it keeps them all: 3 iterations x 4 layers x 4 rows x 32 positions x 64)
  nor a stage's 4 layers at once while its backward recomputes them (what a remat of the whole stage kept)."""
  def stacked_hidden(policy):
    config = _config(pipe=2, data=4, micro=2, steps=1)
    config.train.remat_policy = policy
    job = job_lib.build_job(config, jax.devices()[:8])
    text = job.train_step.lower(sharding.with_shardings(job.abstract, job.shardings), job.abstract_batch).as_text()
    return (re.findall(r'tensor<3x4x\d+x32x64xf32>', text),  # (iterations, layers of a stage, rows, L, mlp_dim)
            re.findall(r'tensor<4x\d+x32x64xf32>', text))  # (layers of a stage, rows, L, mlp_dim)
  across, within = stacked_hidden('none')
  assert across and within
  assert stacked_hidden('full') == ([], [])
