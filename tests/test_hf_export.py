"""A run started from a Hugging Face folder: trains, resumes without re-reading it, exports, and imports back bit
for bit; --plan sizes it from config.json alone."""

import json
import logging
import pathlib
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import REPO
from configs import base
from trainer import checkpoint, loop, plan
from trainer import job as job_lib
from trainer.hf import load as hf_load

from scripts import export_hf

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'hf'


def _config(folder, steps=2, learning_rate=3e-4):
  c = base.get_config()
  c.model.init_from = f'hf:{folder}'
  c.data.source = 'synthetic'
  c.data.seq_len = 24
  c.train.batch_size = 4
  c.train.steps = steps
  c.train.warmup_steps = 0
  c.train.learning_rate = learning_rate
  c.train.eval_batches = 0
  c.train.compute_dtype = 'float32'
  c.ckpt.every_steps = 2
  c.log.every_steps = 1
  return c


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """The tied Llama fixture trained 2 steps from its imported weights on one device."""
  workdir = tmp_path_factory.mktemp('hf_run') / 'run'
  loop.run(_config(FIXTURES / 'llama_tied'), str(workdir), devices=jax.devices()[:1])
  return workdir


def test_export_then_import_is_bit_identical(trained, tmp_path):
  out = tmp_path / 'exported'
  step, names = export_hf.export(str(trained), str(out), max_shard_gb=150e3 / (1 << 30))  # ~150 kB files: sharded.
  assert step == 2 and len(names) > 1 and (out / 'model.safetensors.index.json').is_file()
  exported = json.loads((out / 'config.json').read_text())
  assert exported['architectures'] == ['LlamaForCausalLM'] and exported['tie_word_embeddings'] is True
  assert 'lm_head.weight' not in json.loads((out / 'model.safetensors.index.json').read_text())['weight_map']
  config = json.loads((trained / 'config.json').read_text())
  job = job_lib.build_job(hf_load.configure(_config(out)), jax.devices()[:1])
  _, state = checkpoint.restore_for_tool(job, str(trained))
  imported = hf_load.load_params(hf_load.configure(_config(out)), job.abstract.params, job.shardings.params)
  for want, got in zip(jax.tree.leaves(state.params), jax.tree.leaves(imported)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert config['model']['d_model'] == 64  # The run's config came from the fixture's config.json.
  first = load_file(FIXTURES / 'llama_tied' / 'model.safetensors')['model.embed_tokens.weight']
  assert not np.array_equal(np.asarray(state.params['embed']['embedding']), first)  # Two steps changed it.


def test_a_resumed_run_does_not_read_init_from_and_says_so(trained, tmp_path, caplog):
  run = tmp_path / 'resumed'
  shutil.copytree(trained, run)
  with caplog.at_level(logging.INFO):
    loop.run(_config(FIXTURES / 'llama_tied'), str(run), devices=jax.devices()[:1])  # Step 2 reached: no step.
  assert "model.init_from='hf:" in caplog.text and 'is not read: a resumed run continues' in caplog.text
  assert 'into the run\'s shardings' not in caplog.text


def test_plan_sizes_an_imported_model_without_its_weights(tmp_path):
  folder = tmp_path / 'config_only'
  folder.mkdir()
  shutil.copy(FIXTURES / 'qwen2' / 'config.json', folder)  # No safetensors at all.
  config = _config(folder)
  config.mesh.data = 8
  config.train.batch_size = 8
  lines = []
  result = plan.run(config, print_fn=lines.append)
  job = job_lib.build_job(hf_load.configure(config))
  expected = sum(int(np.prod(p.shape)) * 4 for p in jax.tree.leaves(job.abstract.params))
  assert result.params_bytes == expected and job.config.model.qkv_bias  # Qwen2's shape, biases included.


def test_export_refuses_an_existing_output(trained, tmp_path):
  from trainer.errors import UserError
  with pytest.raises(UserError, match='exists; choose a new folder'):
    export_hf.export(str(trained), str(tmp_path))
