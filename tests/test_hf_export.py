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
from trainer.hf import load as hf_load
from trainer.run import job as job_lib
from trainer.run import loop, plan
from trainer.training import checkpoint

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
    config = _config(FIXTURES / 'llama_tied', steps=3)  # One step more: a finished run returns before restoring.
    config.train.accept_schedule_change = True
    loop.run(config, str(run), devices=jax.devices()[:1])
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
  from trainer.base.errors import UserError
  with pytest.raises(UserError, match='exists; choose a new folder'):
    export_hf.export(str(trained), str(tmp_path))


NAMES = ('llama', 'llama_tied', 'llama3_rope', 'qwen2', 'qwen3', 'mistral', 'mistral_head_dim')


def _exported_config(folder, seq_len=24) -> dict:
  """config.json as export_hf.py writes it for a run imported from `folder` (the fields besides the weights)."""
  from trainer.hf import architectures, serving
  config = hf_load.configure(_config(folder))
  config.data.seq_len = seq_len
  info = serving.of_run(config)
  return {**architectures.hf_config(config.model, info.dtype, info.architecture), **info.fields}


def _rope(hf: dict) -> dict:
  """The source's RoPE in one form, read here from either of the two forms transformers writes."""
  params = hf.get('rope_parameters') or {}
  scaling = {k: v for k, v in (hf.get('rope_scaling') or params).items() if k != 'rope_theta'}
  return {'theta': hf.get('rope_theta', params.get('rope_theta')),
          'scaling': None if scaling.get('rope_type', 'default') == 'default' else scaling}


@pytest.mark.parametrize('name', NAMES)
def test_the_export_keeps_the_sources_token_ids_context_rope_architecture_and_dtype(name):
  source = json.loads((FIXTURES / name / 'config.json').read_text())
  exported = _exported_config(FIXTURES / name)
  for key in ('bos_token_id', 'eos_token_id', 'pad_token_id', 'max_position_embeddings', 'architectures'):
    assert exported[key] == source[key], (name, key)
  assert exported['max_position_embeddings'] == 128  # Not the 8192 every export once said.
  assert _rope(exported) == _rope(source), name
  assert exported['torch_dtype'] == source['dtype'] == 'float32'
  if name.startswith('mistral'):
    assert exported['model_type'] == 'mistral' and exported['sliding_window'] == source['sliding_window']


def test_a_run_trained_on_longer_rows_than_the_source_states_the_trained_length():
  assert _exported_config(FIXTURES / 'llama', seq_len=96)['max_position_embeddings'] == 128
  assert _exported_config(FIXTURES / 'qwen2', seq_len=256)['max_position_embeddings'] == 256


def test_a_model_trained_from_scratch_takes_its_token_ids_from_the_datas_tokenizer(tmp_path):
  from trainer.hf import serving
  shutil.copytree(FIXTURES / 'tokenizer', tmp_path / 'data' / 'tokenizer')
  config = base.get_config()
  config.data.source, config.data.path, config.data.seq_len = 'array_record', str(tmp_path / 'data'), 48
  info = serving.of_run(config)
  vocab = json.loads((FIXTURES / 'tokenizer' / 'tokenizer.json').read_text())['model']['vocab']
  assert info.fields == {'max_position_embeddings': 48, 'bos_token_id': vocab['<s>'], 'eos_token_id': vocab['</s>']}
  assert (info.fields['bos_token_id'], info.fields['eos_token_id']) == (1, 2)
  assert sorted(p.name for p in info.files) == ['tokenizer.json', 'tokenizer_config.json']


def test_the_export_carries_generation_config_and_the_imported_tokenizer(trained, tmp_path, capsys):
  out = tmp_path / 'exported'
  export_hf.main([f'--workdir={trained}', f'--output={out}'])
  # The closing line lists every file the export wrote, the tokenizer's and generation_config.json included.
  [line] = [l for l in capsys.readouterr().out.splitlines() if l.startswith(f'wrote {out}')]
  files = sorted(p.name for p in out.iterdir())
  assert line.endswith(': ' + ', '.join(files)) and {'generation_config.json', 'config.json'} <= set(files), line
  assert (out / 'generation_config.json').read_bytes() == (
      FIXTURES / 'llama_tied' / 'generation_config.json').read_bytes()
  exported = json.loads((out / 'config.json').read_text())
  assert (exported['bos_token_id'], exported['eos_token_id'], exported['max_position_embeddings']) == (1, 2, 128)


@pytest.fixture(scope='module')
def bf16_source(tmp_path_factory):
  """The Llama fixture as a bfloat16 checkpoint with its tokenizer beside it, as published models come."""
  import ml_dtypes
  from safetensors.numpy import save_file
  folder = tmp_path_factory.mktemp('bf16') / 'llama_bf16'
  shutil.copytree(FIXTURES / 'llama', folder)
  tensors = load_file(folder / 'model.safetensors')
  save_file({k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}, folder / 'model.safetensors',
            metadata={'format': 'pt'})
  hf = json.loads((folder / 'config.json').read_text())
  (folder / 'config.json').write_text(json.dumps({**hf, 'dtype': 'bfloat16'}))
  for f in (FIXTURES / 'tokenizer').iterdir():
    shutil.copy(f, folder)
  return folder


def test_the_export_is_written_in_the_imported_checkpoints_dtype(bf16_source, tmp_path):
  from safetensors import safe_open
  workdir = tmp_path / 'run'
  loop.run(_config(bf16_source, steps=1), str(workdir), devices=jax.devices()[:1])
  out = tmp_path / 'exported'
  export_hf.export(str(workdir), str(out))
  assert json.loads((out / 'config.json').read_text())['torch_dtype'] == 'bfloat16'
  with safe_open(out / 'model.safetensors', 'numpy') as f:
    assert {f.get_slice(k).get_dtype() for k in f.keys()} == {'BF16'}
  assert sorted(p.name for p in out.iterdir()) == ['config.json', 'generation_config.json', 'model.safetensors',
                                                   'tokenizer.json', 'tokenizer_config.json']
  assert (out / 'tokenizer.json').read_bytes() == (bf16_source / 'tokenizer.json').read_bytes()


@pytest.mark.parametrize('script, args, message', [
    ('export_hf.py', ['--workdir=/nonexistent-40', '--output=/tmp/never-40'], "--workdir='/nonexistent-40' does not "),
    ('export_hf.py', [], 'the following arguments are required: --workdir, --output'),
    ('sample.py', [], 'flag --workdir=None: Flag --workdir must have a value other than None.'),
    ('sample.py', ['--workdir=/nonexistent-40', 'stray'], 'unexpected arguments: stray'),
    ('export_params.py', ['--config=configs/tiny.py', '--config.nope=1', '--workdir=/w', '--output=/o'],
     "a --config override names a key the config lacks"),
    ('export_params.py', ['--config=configs/missing-40.py', '--workdir=/w', '--output=/o'],
     "No such file or directory: 'configs/missing-40.py'"),
])
def test_every_scripts_user_error_is_one_line_and_exit_2(script, args, message):
  import subprocess
  import sys
  result = subprocess.run([sys.executable, str(REPO / 'scripts' / script), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
  last = result.stderr.strip().splitlines()[-1]
  assert result.returncode == 2 and last.startswith(f'{script}: error: ') and message in last, result.stderr[-2000:]
  assert 'Traceback' not in result.stderr
