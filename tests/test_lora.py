"""LoRA (model.lora_rank, trainer/models/lora.py through Qwix): rank 8 on the tiny imported Llama trains only its
adapters (the optimizer state and sharding.txt hold nothing else, the base stays bit for bit), the loss falls, a
resume is exact, the merged export imports back with the run's logits, the PEFT folder is PEFT's layout and its
B @ A is the merged change; bad settings are one line."""

import json
import os
import pathlib
import shutil
import subprocess

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from configs import base
from trainer.base.errors import UserError
from trainer.hf import load as hf_load
from trainer.models import lora
from trainer.run import job as job_lib
from trainer.run import loop
from trainer.training import checkpoint, validation

from scripts import eval as eval_script
from scripts import export_hf, sample

FIXTURE = pathlib.Path(__file__).parent / 'fixtures' / 'hf' / 'llama'  # 2 layers, d_model 64, GQA 4/2 heads.
STEPS = 12


def _config(folder=FIXTURE, rank=8, steps=STEPS, text_dir=None, task=None):
  c = base.get_config()
  c.model.init_from = f'hf:{folder}'
  c.model.lora_rank = rank
  c.model.scan_layers = True  # The scanned path every deep preset takes: adapters stacked on 'layers'.
  c.data.source = 'synthetic' if text_dir is None else 'text'  # Bytes: the fixture's vocabulary is 256.
  if text_dir is not None:
    c.data.text_dir, c.data.file_glob, c.data.eval_percent = str(text_dir), '*.txt', 0
    c.eval.tasks = (task,)
  c.data.seq_len = 24
  c.train.batch_size = 4
  c.train.steps = steps
  c.train.warmup_steps = 0
  c.train.learning_rate = 1e-2
  c.train.eval_batches = 0
  c.train.compute_dtype = 'float32'
  c.ckpt.every_steps = STEPS // 2
  c.log.every_steps = 1
  return c


def _devices():
  return jax.devices()[:1]


ANIMALS = [('cat', 'meow'), ('dog', 'woof'), ('cow', 'moo'), ('owl', 'hoot')]


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """The LoRA run: rank 8 on the imported fixture, on text saying what each animal says, scored on it in the run."""
  root = tmp_path_factory.mktemp('lora_run')
  (root / 'text').mkdir()
  order = np.random.default_rng(0).permutation(len(ANIMALS) * 40) % len(ANIMALS)
  (root / 'text' / 'animals.txt').write_text(''.join(f'{ANIMALS[i][0]} says {ANIMALS[i][1]}.\n' for i in order))
  lines = [{'template': '{context} says'}] + [
      {'context': animal, 'choices': [sound, ANIMALS[(i + 1) % len(ANIMALS)][1]], 'gold': 0}
      for i, (animal, sound) in enumerate(ANIMALS)]
  (root / 'animals.jsonl').write_text(''.join(json.dumps(line) + '\n' for line in lines))
  config = _config(text_dir=root / 'text', task=str(root / 'animals.jsonl'))
  loop.run(config, str(root / 'run'), devices=_devices())
  return root / 'run'


def _state(workdir, step=None):
  job = job_lib.build_job(sample.load_run_config(workdir), _devices())
  return job, checkpoint.restore_for_tool(job, str(workdir), step)[1]


def test_only_the_adapters_train_and_hold_optimizer_state(trained):
  job, state = _state(trained)
  moments = [(jax.tree_util.keystr(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
             if leaf.ndim > 0]  # Adam's mu and nu; the step counts are scalars.
  assert moments and all('_lora_a' in p or '_lora_b' in p for p, _ in moments), moments[:3]
  assert len(moments) == 2 * 2 * 7  # mu and nu of a and b on the 7 targets (layers stacked).
  rows = {line.split()[0]: line.split() for line in (trained / 'sharding.txt').read_text().splitlines()}
  adapter_bytes = sum(int(row[-2].replace(',', '')) for name, row in rows.items() if '_lora_' in name)
  assert rows['layers/mlp/up/kernel_lora_b'][-1] == 'yes' and rows['layers/mlp/up/kernel'][-1] == 'no'  # decay
  opt_bytes = int(rows['opt_state'][3].replace(',', ''))  # 'opt_state per device: N bytes of N in total'
  assert 2 * adapter_bytes <= opt_bytes <= 2 * adapter_bytes + 64  # Adam's two moments of the adapters, counts.
  imported = hf_load.load_params(hf_load.configure(_config(rank=0)), *(_plain(job.abstract.params, job.shardings.params)))
  for path, want in jax.tree_util.tree_flatten_with_path(imported)[0]:  # The base is frozen: bit for bit.
    got = state.params
    for key in path:
      got = got[key.key]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert np.abs(np.asarray(state.params['layers']['mlp']['up']['kernel_lora_b'])).max() > 0  # The adapters moved.


def _plain(*trees):
  return tuple(lora.base(t) for t in trees)


def test_the_loss_falls(trained):
  losses = [json.loads(line)['loss'] for line in (trained / 'metrics.jsonl').read_text().splitlines()
            if 'loss' in json.loads(line)]
  assert len(losses) >= STEPS - 1
  assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.05, losses


def test_a_resume_from_the_middle_is_exact(trained, tmp_path):
  run = tmp_path / 'resumed'
  shutil.copytree(trained, run)
  shutil.rmtree(run / 'checkpoints' / str(STEPS))  # Back to the step-6 checkpoint (a copy; the run is untouched).
  manifest = run / 'checkpoints' / str(STEPS // 2) / 'manifest' / 'metadata'
  saved = json.loads(manifest.read_text())
  for key in ('lora_targets', 'lora_alpha'):  # At their defaults: as a checkpoint from before the keys has them.
    del saved['model'][key]
  manifest.write_text(json.dumps(saved))
  # A checkpoint from before the keys also predates the checksums (trainer/safety/checksums.py): an edited manifest
  # with them is a damaged checkpoint, and is set aside.
  (manifest.parent.parent / 'checksums.json').unlink()
  loop.run(sample.load_run_config(trained), str(run), devices=_devices())
  _, straight = _state(trained)
  _, resumed = _state(run)
  for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope='module')
def run_logits(trained):
  """(config, params, tokens, logits, bind) of the LoRA run's last checkpoint, as scripts/sample.py and eval.py run
  it."""
  config = sample.load_run_config(trained)
  _, bind, params = sample.restore_model(config, trained, 'latest')
  tokens = np.load(FIXTURE.parent / 'input_ids.npy')
  return config, params, tokens, np.asarray(bind(params)(tokens)), bind


def test_the_reference_view_is_the_imported_base(run_logits):
  """What a DPO reference reads under LoRA: the adapted model on lora.reference(params) is transformers' base."""
  _, params, tokens, trained_logits, bind = run_logits
  got = np.asarray(bind(lora.reference(params))(tokens))
  np.testing.assert_allclose(got, np.load(FIXTURE.parent / 'llama.logits.npy'), atol=1e-4, rtol=0)
  assert np.abs(trained_logits - got).max() > 1e-3


def test_decoding_with_the_kv_cache_runs_the_adapters(run_logits):
  config, params, tokens, want, _ = run_logits
  decoder = sample.cached_decoder(config)  # llama.for_decoding: Qwix's subclass kept, adapters and all.
  got, _ = decoder.apply({'params': params}, tokens[:1], mutable=['cache'])
  np.testing.assert_allclose(np.asarray(got), want[:1], atol=1e-4, rtol=0)


def test_the_merged_export_imports_with_the_runs_logits(trained, run_logits, tmp_path):
  out = tmp_path / 'merged'
  export_hf.export(str(trained), str(out))
  assert not any('lora' in name for name in load_file(out / 'model.safetensors'))
  _, _, tokens, want, _ = run_logits
  config = _config(out, rank=0)
  config.model.init_from = f'hf:{out}'
  job = job_lib.build_job(hf_load.configure(config), _devices())
  params = hf_load.load_params(job.config, job.abstract.params, job.shardings.params)
  got = np.asarray(job.task.outputs(params, {'inputs': tokens, 'targets': np.roll(tokens, -1, axis=1)}))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  base_logits = np.load(FIXTURE.parent / 'llama.logits.npy')  # transformers' logits of the base fixture.
  assert np.abs(got - base_logits).max() > 1e-3  # The adapters changed the model.


def test_the_peft_folder_is_peft_layout_and_its_product_is_the_merged_change(trained, tmp_path):
  merged, peft = tmp_path / 'merged', tmp_path / 'peft'
  export_hf.export(str(trained), str(merged), lora_mode='merge')
  export_hf.export(str(trained), str(peft), lora_mode='peft')
  config = json.loads((peft / 'adapter' / 'adapter_config.json').read_text())
  assert config['peft_type'] == 'LORA' and config['r'] == 8 and config['lora_alpha'] == 16.0
  assert config['base_model_name_or_path'] == str(peft.resolve())
  assert sorted(config['target_modules']) == sorted(['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj',
                                                     'down_proj'])
  adapters = load_file(peft / 'adapter' / 'adapter_model.safetensors')
  assert len(adapters) == 2 * 7 * 2  # A and B, 7 modules, 2 layers.
  base_weights, merged_weights = load_file(peft / 'model.safetensors'), load_file(merged / 'model.safetensors')
  np.testing.assert_array_equal(base_weights['model.embed_tokens.weight'],
                                load_file(FIXTURE / 'model.safetensors')['model.embed_tokens.weight'])
  for name in base_weights:
    stem = 'base_model.model.' + name[:-len('.weight')]
    if f'{stem}.lora_A.weight' not in adapters:
      np.testing.assert_array_equal(base_weights[name], merged_weights[name])
      continue
    a, b = adapters[f'{stem}.lora_A.weight'], adapters[f'{stem}.lora_B.weight']
    assert a.shape == (8, base_weights[name].shape[1]) and b.shape == (base_weights[name].shape[0], 8)
    np.testing.assert_allclose(base_weights[name] + (16.0 / 8) * b @ a, merged_weights[name], atol=1e-5)


# transformers' Llama and peft need torch, which the project's environments do not install (CI's machine has no room
# for its 3 GB of CUDA wheels): TORCH_PYTHON names a python of an environment of its own that has torch,
# transformers and peft (docs/lora.md), where this test loads both exports as a user would.
TORCH_PYTHON = os.environ.get('TORCH_PYTHON')
_LOAD_IN_TRANSFORMERS = """
import sys
import numpy as np, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
merged, peft, tokens, merged_out, peft_out = sys.argv[1:]
ids = torch.tensor(np.load(tokens))
model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
np.save(merged_out, model(ids).logits.detach().numpy())
base = AutoModelForCausalLM.from_pretrained(peft, dtype=torch.float32)
np.save(peft_out, PeftModel.from_pretrained(base, peft + '/adapter')(ids).logits.detach().numpy())
"""


@pytest.mark.skipif(not TORCH_PYTHON, reason='TORCH_PYTHON: a python with torch, transformers and peft')
def test_transformers_loads_the_merged_export_and_peft_the_adapter_with_the_runs_logits(trained, run_logits,
                                                                                         tmp_path):
  merged, peft = tmp_path / 'merged', tmp_path / 'peft'
  export_hf.export(str(trained), str(merged), lora_mode='merge')
  export_hf.export(str(trained), str(peft), lora_mode='peft')
  _, _, tokens, want, _ = run_logits
  np.save(tmp_path / 'tokens.npy', tokens)
  outs = [tmp_path / 'merged_logits.npy', tmp_path / 'peft_logits.npy']
  subprocess.run([TORCH_PYTHON, '-c', _LOAD_IN_TRANSFORMERS, str(merged), str(peft), str(tmp_path / 'tokens.npy'),
                  *map(str, outs)], check=True, timeout=600, env={**os.environ, 'HF_HUB_OFFLINE': '1'})
  for out in outs:
    np.testing.assert_allclose(np.load(out), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize('change, words', [
    ({'lora_targets': ('query', 'proj_q')}, "model.lora_targets names 'proj_q', which is no matmul"),
    ({'lora_rank': 65}, "model.lora_rank=65 exceeds the 'query' matrix's smaller dimension 64"),
    ({'lora_rank': -1}, 'model.lora_rank=-1'),
    ({'name': 'vit', 'task': 'classifier'}, "LoRA adapts only the built-in Llama (model.name='llama')"),
])
def test_bad_lora_settings_are_one_line(change, words):
  config = _config(rank=8)
  config.model.init_from = None
  config.model.d_model, config.model.num_heads, config.model.mlp_dim = 64, 4, 128
  for key, value in change.items():
    config.model[key] = value
  with pytest.raises(UserError) as e:  # launch.py prints a UserError as its one line and exits 2.
    validation.validate_config(config)
  assert words in str(e.value) and '\n' not in str(e.value)


def test_eval_script_scores_the_adapted_model_as_the_run_did(trained, tmp_path):
  task = sample.load_run_config(trained).eval.tasks[0]
  record = eval_script.evaluate(str(trained), [task], 'latest', 'raw', 0, 8, 4, str(tmp_path / 'out.json'))
  in_run = json.loads((trained / 'evals' / f'step_{STEPS}.json').read_text())['params']['animals']
  script = record['tasks']['animals']
  np.testing.assert_allclose([q['log_likelihoods'] for q in script['per_question']],
                             [q['log_likelihoods'] for q in in_run['per_question']], rtol=1e-5, atol=1e-5)


def test_targets_that_adapt_nothing_in_the_built_model_are_one_line():
  config = _config(rank=4)
  config.model.init_from = None
  config.model.d_model, config.model.num_heads, config.model.mlp_dim, config.model.num_layers = 32, 2, 64, 2
  config.model.num_experts, config.model.lora_targets = 4, ('gate', 'down')  # Every block MoE: no dense MLP.
  with pytest.raises(UserError, match=r"model.lora_targets=\('gate', 'down'\) adapts no matmul of this model"):
    job_lib.build_job(config, _devices())


def test_a_peft_export_of_a_run_without_adapters_is_one_line(trained, tmp_path):
  run = tmp_path / 'plain'
  run.mkdir()
  config = json.loads((trained / 'config.json').read_text())
  config['model']['lora_rank'] = 0
  (run / 'config.json').write_text(json.dumps(config))
  with pytest.raises(UserError, match=r"--lora=peft: .* trained no adapters \(model.lora_rank=0\)"):
    export_hf.export(str(run), str(tmp_path / 'out'), lora_mode='peft')
  assert not (tmp_path / 'out').exists()


def test_bfloat16_compute_compiles_through_the_scanned_blocks():
  """The adapters' float32 product is added in the layer's compute dtype (GPUs' 'auto'): the scan carry stays bf16."""
  config = _config(rank=4)
  config.model.init_from = None
  config.model.d_model, config.model.num_heads, config.model.mlp_dim, config.model.num_layers = 32, 2, 64, 2
  config.train.compute_dtype = 'bfloat16'
  job = job_lib.build_job(config, _devices())  # The model's abstract init runs the scan: refused before the fix.
  assert job.abstract.params['layers']['mlp']['up']['kernel_lora_a'].shape == (2, 32, 4)
