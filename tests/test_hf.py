"""Hugging Face import: the tiny fixtures (tests/fixtures/make_hf_fixtures.py) imported give transformers' own logits.

Golden logits were computed by transformers in float32 on tests/fixtures/hf/input_ids.npy; here the built-in
Llama, configured from each config.json and loaded from its safetensors, must reproduce them within 1e-4, on one
device and on a (data 2, fsdp 2, tensor 2) mesh whose every parameter is read slice by slice.
"""

import json
import pathlib
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

from configs import base
from trainer.base.errors import UserError
from trainer.hf import architectures, safetensors_files
from trainer.hf import load as hf_load
from trainer.run import job as job_lib

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'hf'
NAMES = ('llama', 'llama_tied', 'llama3_rope', 'qwen2', 'qwen3', 'mistral', 'mistral_head_dim')


def import_config(folder, **mesh):
  c = base.get_config()
  c.model.init_from = f'hf:{folder}'
  c.data.source = 'synthetic'
  c.data.seq_len = 24
  c.train.batch_size = 4
  c.train.compute_dtype = 'float32'
  c.model.scan_layers = True
  for axis, size in mesh.items():
    c.mesh[axis] = size
  return c


def imported_logits(config, devices):
  config = hf_load.configure(config)
  job = job_lib.build_job(config, devices)
  params = hf_load.load_params(config, job.abstract.params, job.shardings.params)
  tokens = np.tile(np.load(FIXTURES / 'input_ids.npy').astype(np.int32), (2, 1))  # Rows of 4: every mesh splits it.
  logits = jax.jit(lambda p, x: job.task.outputs(p, {'inputs': x}))(params, tokens)
  return np.asarray(logits)[:2], params


@pytest.mark.parametrize('name', NAMES)
def test_imported_logits_equal_transformers_on_one_device(name):
  logits, _ = imported_logits(import_config(FIXTURES / name, data=1), jax.devices()[:1])
  golden = np.load(FIXTURES / f'{name}.logits.npy')
  assert logits.shape == golden.shape
  np.testing.assert_allclose(logits, golden, atol=1e-4, rtol=0)


@pytest.mark.parametrize('name', NAMES)
def test_imported_logits_equal_transformers_on_a_2x2x2_mesh(name):
  config = import_config(FIXTURES / name, data=2, fsdp=2, tensor=2)
  config.model.scan_layers = name != 'llama'  # The unrolled blocks' names ('block_<i>') too.
  logits, params = imported_logits(config, jax.devices())
  sharded = [p for p in jax.tree.leaves(params) if len(p.sharding.device_set) == 8 and not p.is_fully_replicated]
  assert sharded  # Split parameters were read slice by slice.
  np.testing.assert_allclose(logits, np.load(FIXTURES / f'{name}.logits.npy'), atol=1e-4, rtol=0)


def test_llama3_rope_scaling_is_visible_in_the_logits():
  """The golden llama3_rope logits are not those of the same weights with plain RoPE: the scaling is proven."""
  config = import_config(FIXTURES / 'llama3_rope', data=1)
  plain = hf_load.configure(config)
  with plain.unlocked():
    plain.model.init_from = None
    plain.model.rope_scaling = 'none'
  job = job_lib.build_job(plain, jax.devices()[:1])
  params = hf_load.load_params(config, job.abstract.params, job.shardings.params)
  tokens = np.load(FIXTURES / 'input_ids.npy').astype(np.int32)
  with plain.unlocked():
    plain.train.batch_size = 2
  job = job_lib.build_job(plain, jax.devices()[:1])
  logits = np.asarray(jax.jit(lambda p, x: job.task.outputs(p, {'inputs': x}))(params, tokens))
  assert np.abs(logits - np.load(FIXTURES / 'llama3_rope.logits.npy')).max() > 1e-2


def test_config_json_sets_the_model_and_a_contradicting_override_is_refused():
  config = hf_load.configure(import_config(FIXTURES / 'qwen2'))
  m = config.model
  assert (m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.mlp_dim, m.vocab_size) == (2, 64, 4, 2, 128, 256)
  assert m.qkv_bias and not m.tie_embeddings and m.rope_max_wavelength == 1e6 and m.norm_eps == 1e-5
  rope = hf_load.configure(import_config(FIXTURES / 'llama3_rope')).model
  assert (rope.rope_scaling, rope.rope_scaling_factor, rope.rope_original_max_positions) == ('llama3', 8.0, 64)
  qwen3 = hf_load.configure(import_config(FIXTURES / 'qwen3')).model
  assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 24 and qwen3.tie_embeddings
  assert hf_load.configure(import_config(FIXTURES / 'llama')).model.head_dim == 0  # hidden_size / heads: the default.
  bad = import_config(FIXTURES / 'llama')
  bad.model.d_model = 128
  with pytest.raises(UserError, match=r"model.d_model=128 \(config.json: 64\).*drop that override"):
    hf_load.configure(bad)
  with pytest.raises(UserError, match=r"--config.model.d_model=128 \(config.json: 64\) contradicts .*drop that"):
    hf_load.configure(bad, command_line={'model.d_model': 128})
  assert hf_load.configure(bad, command_line={'train.steps': 3}).model.d_model == 64  # The file's value: replaced.


def _copy(name, tmp_path):
  return pathlib.Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def _check(folder):
  config = hf_load.configure(import_config(folder))
  job = job_lib.build_job(config, jax.devices()[:1] * 1)
  hf_load.check_weights(config, job.abstract.params)


def test_bad_folders_fail_in_one_line(tmp_path):
  with pytest.raises(UserError, match='has no config.json'):
    hf_load.configure(import_config(tmp_path))
  with pytest.raises(UserError, match="give 'hf:'"):
    c = import_config(FIXTURES / 'llama')
    c.model.init_from = str(FIXTURES / 'llama')
    hf_load.configure(c)
  folder = _copy('llama', tmp_path)
  cfg = json.loads((folder / 'config.json').read_text())
  (folder / 'config.json').write_text(json.dumps({**cfg, 'architectures': ['GemmaForCausalLM']}))
  with pytest.raises(UserError, match='names architecture GemmaForCausalLM.*supported: LlamaForCausalLM, '
                                      'Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM'):
    hf_load.configure(import_config(folder))
  (folder / 'config.json').write_text(json.dumps(cfg))
  (folder / 'model.safetensors').unlink()
  with pytest.raises(UserError, match='has no weights: neither model.safetensors.index.json nor model.safetensors'):
    _check(folder)


def _rewrite(folder, change):
  """Rewrites model.safetensors with `change(tensors)` applied (numpy, through the safetensors package)."""
  from safetensors.numpy import load_file, save_file
  tensors = load_file(folder / 'model.safetensors')
  change(tensors)
  save_file(tensors, folder / 'model.safetensors', metadata={'format': 'pt'})


def test_missing_extra_and_misshapen_tensors_fail_in_one_line(tmp_path):
  folder = _copy('llama', tmp_path)
  _rewrite(folder, lambda t: t.pop('model.layers.1.mlp.up_proj.weight'))
  with pytest.raises(UserError, match=r"lack 1 tensor\(s\).*'model.layers.1.mlp.up_proj.weight'"):
    _check(folder)
  shutil.rmtree(folder)
  folder = _copy('llama', tmp_path)
  _rewrite(folder, lambda t: t.update({'model.layers.0.self_attn.q_norm.weight': np.ones(16, np.float32)}))
  with pytest.raises(UserError, match=r"hold 1 tensor\(s\) the model has no place for.*q_norm"):
    _check(folder)
  shutil.rmtree(folder)
  folder = _copy('llama', tmp_path)
  _rewrite(folder, lambda t: t.update({'model.layers.0.mlp.down_proj.weight': np.ones((64, 64), np.float32)}))
  with pytest.raises(UserError, match=r"'model.layers.0.mlp.down_proj.weight'.*shape \(64, 64\), but config.json "
                                      r"makes it \(64, 128\)"):
    _check(folder)


def test_corrupt_truncated_and_unreadable_files_fail_in_one_line(tmp_path):
  folder = _copy('llama', tmp_path)
  weights = folder / 'model.safetensors'
  whole = weights.read_bytes()
  weights.write_bytes(whole[:-100])  # A download cut short.
  with pytest.raises(UserError, match=r"model.safetensors' is not a readable safetensors file \(SafetensorError: "
                                      r".*\); download it again"):
    _check(folder)
  weights.write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}' + whole[24:])
  with pytest.raises(UserError, match=r'is not a readable safetensors file .*download it again'):
    _check(folder)
  f8 = {'model.norm.weight': np.ones(64, ml_dtypes.float8_e4m3fn)}
  from safetensors.numpy import save_file
  save_file(f8, weights)
  with pytest.raises(UserError, match=r"tensor 'model.norm.weight' has dtype F8_E4M3, which is not read here"):
    _check(folder)


def test_bfloat16_slices_are_read_as_bfloat16(tmp_path):
  from safetensors.numpy import save_file
  table = (np.arange(6 * 8, dtype=np.float32).reshape(6, 8) / 7).astype(ml_dtypes.bfloat16)
  save_file({'t': table}, tmp_path / 'model.safetensors')
  info = safetensors_files.read_tensors(tmp_path, 'test')['t']
  block = safetensors_files.read_block(info, slice(1, 4), slice(2, 5))
  assert block.dtype == ml_dtypes.bfloat16 and info.shape == (6, 8)
  np.testing.assert_array_equal(block.astype(np.float32), table.astype(np.float32)[1:4, 2:5])


def test_column_slices_read_only_what_is_asked(tmp_path):
  info = safetensors_files.read_tensors(FIXTURES / 'llama', 'test')['model.layers.0.mlp.up_proj.weight']
  from safetensors.numpy import load_file
  whole = load_file(FIXTURES / 'llama' / 'model.safetensors')['model.layers.0.mlp.up_proj.weight']
  np.testing.assert_array_equal(safetensors_files.read_block(info, slice(3, 70), slice(5, 37)), whole[3:70, 5:37])


def test_the_launcher_says_a_bad_folder_in_one_line_before_compiling(launcher, tmp_path):
  folder = _copy('llama', tmp_path)
  (folder / 'model.safetensors').unlink()
  result = launcher('--config=configs/base.py', f'--workdir={tmp_path / "run"}', f'--config.model.init_from=hf:{folder}',
                    '--config.data.source=synthetic', '--config.data.seq_len=24', '--config.train.batch_size=8')
  assert result.returncode == 2
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("launch.py: error: model.init_from='hf:") and 'has no weights' in last
  assert 'Compiled the train step' not in result.stderr


@pytest.mark.parametrize('name', ['llama', 'qwen2', 'qwen3', 'mistral_head_dim'])
def test_the_exported_config_json_describes_the_imported_model(name):
  """config.json -> model keys -> config.json -> the same keys (export_hf.py writes hf_config)."""
  model = hf_load.configure(import_config(FIXTURES / name)).model
  again = architectures.model_keys(architectures.hf_config(model), seq_len=24, where='test')
  assert again == {k: model[k] for k in again}, name


def test_export_refuses_a_model_no_hugging_face_architecture_describes():
  model = hf_load.configure(import_config(FIXTURES / 'llama')).model
  model.num_experts = 4
  with pytest.raises(UserError, match=r'model.num_experts > 0 \(a mixture of experts\), which none of the exported '
                                      r'Hugging Face architectures .* scripts/export_params.py instead'):
    architectures.hf_config(model)


def test_any_config_file_imports_and_only_a_contradicting_flag_is_refused(launcher, tmp_path):
  """configs/tiny.py sets the model's sizes: config.json replaces them and the log lists them; a flag is refused."""
  common = ('--config=configs/tiny.py', f'--config.model.init_from=hf:{FIXTURES / "llama"}',
            '--config.data.source=synthetic', '--config.train.steps=1', '--config.train.eval_batches=0')
  result = launcher(*common, f'--workdir={tmp_path / "run"}')
  assert result.returncode == 0, result.stderr[-3000:]
  (line,) = [l for l in result.stderr.splitlines() if 'config.json replaces what the config file set' in l]
  assert 'model.d_model=32 -> 64' in line and 'model.mlp_dim=64 -> 128' in line and 'model.num_heads=2 -> 4' in line
  config = json.loads((tmp_path / 'run' / 'config.json').read_text())['model']
  assert (config['d_model'], config['num_heads'], config['mlp_dim']) == (64, 4, 128)
  refused = launcher(*common, f'--workdir={tmp_path / "refused"}', '--config.model.d_model=32')
  assert refused.returncode == 2
  last = refused.stderr.strip().splitlines()[-1]
  assert last == (f"launch.py: error: model.init_from='hf:{FIXTURES / 'llama'}': --config.model.d_model=32 "
                  f"(config.json: 64) contradicts {FIXTURES / 'llama' / 'config.json'}, which decides the model; "
                  f"drop that override."), last
