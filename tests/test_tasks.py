"""Bring your own model: NNX and Linen models from outside trainer/ train through the launcher by import path.

Each launcher run is checked against a minimal hand-written loop over the same
model, initial parameters (from train.seed) and batches: the launcher adds
sharding over 8 devices, donation and guardrails, and must not change the numbers.
"""

import pathlib
import re

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from flax import nnx

import custom_models
from conftest import REPO, read_metrics
from configs import tiny
from trainer import data
from trainer.base.errors import UserError
from trainer.observe import flops
from trainer.run import job
from trainer.training import task as task_lib

STEPS = 5


def _config(name: str):
  c = tiny.get_config()
  c.model.name = name
  c.data.source = 'synthetic'  # Random tokens: no corpus to read, the loss still falls (unigram statistics).
  c.train.steps = STEPS
  c.train.warmup_steps = 0
  c.train.end_learning_rate_ratio = 1.0  # A constant learning rate, as in the hand-written loop.
  c.train.grad_clip_norm = 0.0
  c.train.compute_dtype = 'float32'
  c.train.eval_batches = 0
  c.log.every_steps = 1
  c.ckpt.every_steps = 100
  return c


def _overrides(config) -> list[str]:
  keys = ('model.name', 'data.source', 'train.steps', 'train.warmup_steps', 'train.end_learning_rate_ratio',
          'train.grad_clip_norm', 'train.compute_dtype', 'train.eval_batches', 'log.every_steps', 'ckpt.every_steps')
  return [f'--config.{k}={config[k.split(".")[0]][k.split(".")[1]]}' for k in keys]


def _batches(config):
  it = data.train_iterator_for(config)
  return [next(it) for _ in range(STEPS)]


def _adamw(config):
  t = config.train
  return optax.adamw(t.learning_rate, b1=t.adam_b1, b2=t.adam_b2, weight_decay=t.weight_decay)


def _hand_written_nnx_losses(config) -> list[float]:
  with nnx.use_eager_sharding(False):  # One device, no mesh: the logical names stay metadata.
    model = custom_models.MlpLM(config, rngs=nnx.Rngs(config.train.seed))
  optimizer = nnx.Optimizer(model, _adamw(config), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, batch):
    def loss_fn(model):
      return optax.softmax_cross_entropy_with_integer_labels(model(batch['inputs']), batch['targets']).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  return [float(step(model, optimizer, batch)) for batch in _batches(config)]


def _hand_written_linen_losses(config) -> list[float]:
  module = custom_models.linen_mlp_lm(config)
  batches = _batches(config)
  params = nn.meta.unbox(module.init(jax.random.key(config.train.seed), batches[0]['inputs'])['params'])
  tx = _adamw(config)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    def loss_fn(params):
      logits = module.apply({'params': params}, batch['inputs'])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets']).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for batch in batches:
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  return losses


@pytest.mark.parametrize('name,hand_written', [
    ('tests.custom_models:MlpLM', _hand_written_nnx_losses),
    ('tests.custom_models:linen_mlp_lm', _hand_written_linen_losses),
])
def test_own_model_trains_through_the_launcher_like_a_hand_written_loop(name, hand_written, launcher, tmp_path):
  config = _config(name)
  result = launcher('--config=configs/tiny.py', f'--workdir={tmp_path}', *_overrides(config))
  assert result.returncode == 0, result.stderr[-3000:]
  launched = [r['loss'] for r in read_metrics(tmp_path) if 'loss' in r]
  expected = hand_written(config)
  assert len(launched) == STEPS
  assert expected[-1] < expected[0]  # It learns, so matching means something.
  np.testing.assert_allclose(launched, expected, rtol=2e-5)
  # TFLOP/s for a brought model too, from its traced step's FLOPs (trainer/observe/flops.py); no MFU on CPU (no known
  # peak).
  counted = flops.job_step_flops(job.build_job(config)).flops
  train = [r for r in read_metrics(tmp_path) if 'loss' in r]
  for r in train:
    assert r['tflops_per_device'] * 1e12 * 8 * r['step_time_s'] == pytest.approx(counted, rel=1e-6) and 'mfu' not in r
  assert f"{train[-1]['tflops_per_device']:.3g} TFLOP/s/device" in result.stderr


def test_linen_and_nnx_models_get_named_shardings_on_a_2x2x2_mesh():
  for name, framework in (('tests.custom_models:MlpLM', 'nnx'), ('tests.custom_models:linen_mlp_lm', 'linen')):
    config = _config(name)
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
    built = job.build_job(config)
    assert built.task.model.framework == framework
    specs = {'/'.join(str(getattr(k, 'key', k)) for k in path): s.spec
             for path, s in jax.tree_util.tree_flatten_with_path(built.shardings.params)[0]}
    embedding = next(spec for path, spec in specs.items() if path.endswith('embedding'))
    assert tuple(embedding) == ('tensor', 'fsdp')  # ('vocab', 'embed') through the default rules.


def test_a_custom_loss_method_replaces_the_objective():
  config = _config('tests.custom_models:MlpLMWithOwnLoss')
  task = task_lib.build_task(config)
  assert task.custom_loss
  params = jax.jit(task.model.init)(jax.random.key(0))
  batch = _batches(config)[0]
  loss, metrics = task.loss(params, batch)
  assert set(metrics) == {'loss', 'mean_logit'} and np.isfinite(float(loss))


@pytest.mark.parametrize('name,message', [
    ('tests.custom_modls:MlpLM', r"there is no module 'tests.custom_modls' to import"),
    ('tests.custom_models:MlpLm', r"has no attribute 'MlpLM'|has no attribute 'MlpLm'.*Did you mean 'MlpLM'"),
    ('custom_models.MlpLM', r"neither a registered model \(llama, vit\) nor an import path"),
    ('tests.custom_models:NnxWithoutNames', r"3 parameter\(s\) have no axis names: embed/embedding \(256, 8\), "
     r"out/bias \(256,\).*parallel.unnamed_params='error'. Name them with nnx.with_partitioning"),
    ('tests.custom_models:linen_without_names', r"3 parameter\(s\) have no axis names: .*Dense_0/bias.*"
     r"nn.with_logical_partitioning"),
    ('tests.custom_models:NnxUnknownAxis', r"scale names axis 'logits', which is neither a mesh axis \(data, fsdp, "
     r"pipeline, expert, context, tensor\) nor in parallel.logical_axis_rules; map it with --config.parallel.extra_axis_rules="),
])
def test_unusable_model_names_what_is_missing(name, message):
  config = _config(name)
  config.parallel.unnamed_params = 'error'  # The default ('auto') names them; tests/test_param_names.py shows how.
  with pytest.raises(UserError, match=message):
    job.build_job(config)


def test_misspelled_import_path_is_one_line_from_the_launcher(launcher, tmp_path):
  result = launcher('--config=configs/tiny.py', f'--workdir={tmp_path}', '--config.model.name=tests.custom_modls:MlpLM')
  assert result.returncode == 2
  lines = [l for l in result.stderr.splitlines() if l.startswith('launch.py: error:')]
  assert len(lines) == 1 and "model.name='tests.custom_modls:MlpLM'" in lines[0], result.stderr[-2000:]
  assert 'Traceback' not in result.stderr


def test_docs_example_is_the_tested_model():
  page = (REPO / 'docs/bring_your_own_model.md').read_text()
  block = re.search(r'# Bring your own model.*?```python\n(.*?)```', page, re.S)
  assert block, 'docs/bring_your_own_model.md has no python block'
  source = pathlib.Path(custom_models.__file__).read_text()
  tested = re.search(r'# --- README example start ---\n(.*?)# --- README example end ---\n', source, re.S).group(1)
  assert block.group(1).strip() == tested.strip()
  assert len(block.group(1).strip().splitlines()) < 40


def test_nnx_model_runs_under_every_strategy_with_the_same_numbers():
  """The fallbacks wrap the same task loss: one step under shard_map and pmap equals the jit step."""
  results = {}
  for strategy in ('jit', 'shard_map', 'pmap'):
    config = _config('tests.custom_models:MlpLM')
    config.parallel.strategy = strategy
    built = job.build_job(config)
    batch = {k: jax.device_put(v, built.abstract_batch[k].sharding) for k, v in _batches(config)[0].items()}
    state, metrics = built.compile_train_step()(built.init_state(0), batch)
    results[strategy] = (float(metrics['loss']), jax.device_get(state.params))
  for strategy in ('shard_map', 'pmap'):
    assert results[strategy][0] == pytest.approx(results['jit'][0], rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), results[strategy][1],
                 results['jit'][1])
