"""Hostile Hugging Face folders: every config.json field the import reads checked for type and range, the sizes
they make checked against an array's extent, every tensor's dtype against the model's; one line naming config.json
(or the tensor), exit 2, never retried, under --plan too (issue 54, Hugging Face row).

The field sweep is in process (architectures.model_keys, what hf_load.configure runs first); two launches show the
one line and exit 2 from a supervised run and from --plan, where a product of sizes past int64 aborted XLA (-6).
"""

import json
import math
import pathlib
import re
import shutil
import sys

import jax
import numpy as np
import pytest

from conftest import REPO, launcher_env, run_python
from trainer.base.errors import UserError
from trainer.hf import architectures, config_fields
from trainer.hf import load as hf_load

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'hf'
NAMES = ('llama', 'llama_tied', 'llama3_rope', 'qwen2', 'qwen3', 'mistral', 'mistral_head_dim')
LLAMA = json.loads((FIXTURES / 'llama' / 'config.json').read_text())
LLAMA3_ROPE = json.loads((FIXTURES / 'llama3_rope' / 'config.json').read_text())
# JSON can hold each of these (json.loads reads NaN): no field the import reads takes any of them.
HOSTILE = (math.nan, -10**20, [[1]], '')


def _refusal(hf: dict) -> str:
  with pytest.raises(UserError) as raised:
    architectures.model_keys(hf, 24, 'model.init_from=X')
  return str(raised.value)


@pytest.mark.parametrize('name', NAMES)
def test_every_fixture_passes(name):
  config_fields.check(json.loads((FIXTURES / name / 'config.json').read_text()), 'X')


def test_every_field_read_refuses_a_hostile_value_of_every_type_naming_config_json_and_the_field():
  for field in config_fields.FIELDS:
    for value in HOSTILE:
      said = _refusal({**LLAMA, field: value})
      assert said.startswith('model.init_from=X: config.json: ') and f'{field}={value!r} must be ' in said, said
  for field in config_fields.ROPE_FIELDS:
    for value in HOSTILE:
      said = _refusal({**LLAMA3_ROPE, 'rope_scaling': {**LLAMA3_ROPE['rope_scaling'], field: value}})
      assert f'rope_scaling.{field}={value!r} must be ' in said, said
  assert config_fields.LLAMA3_FIELDS == tuple(architectures.LLAMA3_KEYS)
  said = _refusal({**LLAMA3_ROPE, 'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0}})
  assert 'rope_scaling.low_freq_factor is missing' in said


def test_any_json_value_of_any_field_read_is_taken_or_refused_in_one_line_never_a_traceback():
  values = (None, True, False, 0, 1, 1.5, 'x', [], ['x'], {}, {'rope_type': 'llama3'})
  for value in values:
    for field in config_fields.FIELDS:
      try:
        architectures.model_keys({**LLAMA, field: value}, 24, 'X')
      except UserError:
        pass
    for field in config_fields.ROPE_FIELDS:
      try:
        architectures.model_keys({**LLAMA3_ROPE, 'rope_scaling': {**LLAMA3_ROPE['rope_scaling'], field: value}}, 24, 'X')
      except UserError:
        pass


@pytest.mark.parametrize('field, value, said', [
    ('vocab_size', 10**12, 'vocab_size=1000000000000 must be an integer >= 1 and <= 2147483647'),
    ('num_attention_heads', -4, 'num_attention_heads=-4 must be an integer >= 1 and <= 2147483647'),
    ('hidden_size', '64', "hidden_size='64' must be an integer >= 1 and <= 2147483647"),
    ('hidden_size', True, 'hidden_size=True must be an integer'),
    ('tie_word_embeddings', 'no', "tie_word_embeddings='no' must be None or one of True, False"),
    ('rms_norm_eps', 2, 'rms_norm_eps=2 must be in (0, 1)'),
    ('hidden_size', 10**9, 'num_hidden_layers=2 x hidden_size=1000000000 x hidden_size=1000000000 makes the stacked '
                           "layers' attention weights 2e+18 elements, more than 4.4e+12"),
    ('hidden_size', 66, 'hidden_size=66 must divide by num_attention_heads=4'),
])
def test_the_one_line_names_the_field_its_value_and_what_it_must_be(field, value, said):
  hf = {**LLAMA, field: value}
  if field == 'hidden_size' and value == 66:
    del hf['head_dim']
  assert said in _refusal(hf)


def test_a_config_json_missing_a_size_or_not_an_object_is_one_line():
  assert 'config.json: vocab_size is missing' in _refusal({k: v for k, v in LLAMA.items() if k != 'vocab_size'})
  with pytest.raises(UserError, match='config.json holds a list, not an object of fields'):
    config_fields.check([LLAMA], 'X')


def test_an_integer_tensor_in_a_float_model_is_refused_naming_it_its_dtype_and_the_expected(tmp_path):
  from safetensors.numpy import load_file, save_file

  from trainer.run import job as job_lib
  from test_hf import import_config
  folder = pathlib.Path(shutil.copytree(FIXTURES / 'llama', tmp_path / 'llama'))
  tensors = load_file(folder / 'model.safetensors')
  tensors['model.layers.0.mlp.up_proj.weight'] = tensors['model.layers.0.mlp.up_proj.weight'].astype(np.int32)
  save_file(tensors, folder / 'model.safetensors', metadata={'format': 'pt'})
  config = hf_load.configure(import_config(folder))
  job = job_lib.build_job(config, jax.devices()[:1])
  with pytest.raises(UserError) as raised:
    hf_load.check_weights(config, job.abstract.params)
  assert ("tensor 'model.layers.0.mlp.up_proj.weight' in model.safetensors has dtype I32, but the model's parameters "
          'are floating point (expected one of F64, F32, F16, BF16)') in str(raised.value)


def _broken(tmp_path, **fields) -> pathlib.Path:
  folder = pathlib.Path(shutil.copytree(FIXTURES / 'llama', tmp_path / 'llama'))
  (folder / 'config.json').write_text(json.dumps({**LLAMA, **fields}))
  return folder


def _one_line(result) -> str:
  lines = [l for l in result.stderr.splitlines() if l.strip() and not re.match(r'I\d{4} ', l)]
  assert len(lines) == 1, lines
  return lines[0]


def test_a_supervised_launch_says_a_bad_field_in_one_line_exit_2_and_never_retries(tmp_path):
  folder, workdir = _broken(tmp_path, hidden_size='64'), tmp_path / 'run'
  result = run_python([sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py', f'--workdir={workdir}',
                       f'--config.model.init_from=hf:{folder}', '--config.data.source=synthetic',
                       '--config.data.seq_len=24', '--restart_backoff_s=0'],
                      env=launcher_env(LAUNCH_MAX_RESTARTS='2'), timeout=300)
  assert result.returncode == 2, result.stderr[-3000:]
  assert _one_line(result) == (
      f"launch.py: error: model.init_from='hf:{folder}': config.json: hidden_size='64' must be an integer >= 1 and "
      f"<= 2147483647; the folder's config.json is damaged or not of a model this import reads (download it again, "
      f'or fix the field).')
  [record] = [json.loads(l) for l in (workdir / 'attempts.jsonl').read_text().splitlines()]
  assert (record['exit_code'], record['cause'], record['retried']) == (2, 'user error', False)


def test_plan_refuses_sizes_past_an_array_s_extent_in_one_line_not_an_abort(tmp_path):
  folder = _broken(tmp_path, hidden_size=10**9)
  result = run_python([sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py', '--plan',
                       f'--config.model.init_from=hf:{folder}', '--config.data.source=synthetic',
                       '--config.data.seq_len=24'], timeout=300)
  assert result.returncode == 2, result.stderr[-3000:]
  line = _one_line(result)
  assert line.startswith(f"launch.py: error: model.init_from='hf:{folder}': config.json: num_hidden_layers=2 x "
                         f'hidden_size=1000000000 x hidden_size=1000000000 makes'), line
