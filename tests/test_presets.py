"""Every preset builds, shards on a (2, 2, 2) mesh (llama_1b_long: fsdp, context and tensor of 2) and runs one step
on fake devices.

Presets too large for CI (gpt2_124m, llama_1b, llama_1b_long, vit_base, moe_1b) are built from
abstract shapes only, where their parameter count and sharding are checked; the
step then runs on the same preset shrunk to tiny sizes, keeping its structure
(grouped-query ratio, tied embeddings, patch size, scanned layers, remat).
"""

import importlib

import jax
import numpy as np
import optax
import pytest

from parallel import sharding
from trainer.memory import remat
from trainer.models import layer_scan
from trainer.run import job as job_lib

# Preset -> its parameter count from abstract shapes (never allocated here).
LARGE = {'gpt2_124m': 124e6, 'llama_1b': 1.24e9, 'llama_1b_long': 1.24e9, 'vit_base': 86e6, 'moe_1b': 0.96e9}
PRESETS = ('tiny', 'default', 'gpt2_124m', 'llama_1b', 'llama_1b_long', 'vit_tiny', 'vit_base', 'moe_1b')


def _preset(name: str):
  config = importlib.import_module(f'configs.{name}').get_config()
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  if config.mesh.context > 1:  # llama_1b_long: its rows split over 2 devices in place of the data axis.
    config.mesh.data, config.mesh.context = 1, 2
  return remat.resolve(config)[0]  # 'auto' (gpt2_124m, llama_1b): 'none' on a CPU with no memory limit set.


def _shrink(config):
  """Tiny sizes with the preset's structure: the same kv-head ratio, tying, patch size, scan and remat."""
  m = config.model
  m.scan_layers = layer_scan.scans(m)  # Fixed before shrinking the depth: 'auto' would unroll 2 layers.
  ratio = m.num_heads // (m.num_kv_heads or m.num_heads)
  m.num_layers, m.d_model, m.num_heads, m.mlp_dim = 2, 64, 8, 64
  m.num_kv_heads = 8 // ratio if m.num_kv_heads else 0  # llama_1b's 4 query heads per kv head: 2 kv heads.
  if m.get('num_experts'):  # moe_1b: its experts and top-k kept, each expert narrow.
    m.expert_mlp_dim = 32
  if m.task == 'lm':
    m.vocab_size, config.data.seq_len = 256, 32
  else:
    m.num_classes = 16
    config.data.image_shape = (2 * m.patch_size, 2 * m.patch_size, 3)
  config.train.batch_size = 8
  return config


def _random_batch(job):
  rng = np.random.default_rng(0)
  config = job.config
  batch = {}
  for key, spec in job.abstract_batch.items():
    if key == 'images':
      value = rng.normal(size=spec.shape).astype(np.float32)
    else:
      high = config.model.num_classes if key == 'labels' else config.model.vocab_size
      value = rng.integers(0, high, spec.shape).astype(np.int32)
    batch[key] = jax.device_put(value, spec.sharding)
  return batch


@pytest.mark.parametrize('name', PRESETS)
def test_preset_builds_shards_on_2x2x2_and_runs_one_step(name):
  config = _preset(name)
  if name in LARGE:
    full = job_lib.build_job(config)  # Abstract state and shardings only: nothing is allocated.
    count = sum(x.size for x in jax.tree.leaves(full.abstract.params))
    print(f'{name}: {count:,} parameters')
    assert count == pytest.approx(LARGE[name], rel=0.03)
    _, totals = sharding.sharding_table(full.abstract, full.shardings)
    # fsdp x tensor = 4 ways: a device holds about a quarter of the parameters (norms and biases replicated).
    assert totals['params_bytes_per_device'] < 0.27 * totals['params_bytes_total']
    config = _shrink(config)
  config.data.source, config.data.packing = 'synthetic', False  # Random rows: no documents to pack.
  job = job_lib.build_job(config)
  assert job.mesh.shape['context'] == (2 if name == 'llama_1b_long' else 1)
  state = job.init_state(0)
  state, metrics = job.compile_train_step()(state, _random_batch(job))
  assert int(state.step) == 1
  assert np.isfinite(float(metrics['loss']))
  assert float(metrics['loss']) > 0


@pytest.mark.parametrize('name', ('tiny', 'default', 'gpt2_124m', 'llama_1b'))
def test_a_language_model_starts_near_uniform_predictions(name):
  """Step-1 loss (the freshly initialized model's) within 0.15 of ln(vocab), every LM preset at its own vocabulary
  and tying, shrunk in depth and width (the head's init scale keeps the logits' stddev independent of width)."""
  config = remat.resolve(importlib.import_module(f'configs.{name}').get_config())[0]
  vocab, tied = config.model.vocab_size, config.model.tie_embeddings
  config = _shrink(config)
  config.model.vocab_size, config.data.source = vocab, 'synthetic'
  job = job_lib.build_job(config, jax.devices()[:1])
  params = job.init_state(0).params
  tokens = np.random.default_rng(1).integers(0, vocab, (config.train.batch_size, config.data.seq_len + 1))
  logits = jax.jit(lambda p, x: job.task.model.bind(p)(x))(params, tokens[:, :-1].astype(np.int32))
  loss = float(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean())
  print(f'{name}: vocab {vocab}, tied {tied}, step-1 loss {loss:.3f} vs ln(vocab) {np.log(vocab):.3f}')
  assert config.model.tie_embeddings == tied
  assert abs(loss - np.log(vocab)) < 0.15


def test_the_moe_preset_shrunk_trains_on_cpu_and_logs_its_expert_load(tmp_path):
  """moe_1b at tiny sizes (its 8 experts, top-2), on text, with the expert axis: the loss falls, the load is logged."""
  import os
  import pathlib

  from conftest import read_metrics
  from trainer.run import loop

  config = _shrink(_preset('moe_1b'))
  config.mesh.data, config.mesh.fsdp, config.mesh.expert, config.mesh.tensor = 2, 1, 4, 1
  config.data.source, config.data.text_dir = 'text', str(pathlib.Path(os.__file__).parent / 'email')
  config.train.update(steps=30, warmup_steps=3, learning_rate=3e-3, eval_batches=0, compute_dtype='float32')
  config.log.every_steps, config.ckpt.every_steps = 10, 30
  loop.run(config, str(tmp_path))
  records = read_metrics(tmp_path)
  assert records[-1]['loss'] < records[0]['loss'] - 1.0
  for layer in ('layers_0', 'layers_1'):
    assert 0 <= records[-1][f'{layer}/moe/load_min'] <= 1 <= records[-1][f'{layer}/moe/load_max']
    assert records[-1][f'{layer}/moe/balance_loss'] > 0
  assert records[-1]['moe_balance_loss'] > 0 and records[-1]['moe_router_z_loss'] > 0
