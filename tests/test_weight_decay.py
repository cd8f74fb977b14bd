"""Which parameters get weight decay: matrices, not norm scales or biases, unless train.weight_decay_exclude says."""

import jax
import pytest

from configs import tiny, vit_tiny
from parallel import sharding
from trainer.run import job as job_lib
from trainer.training import optimizer


def _decaying(config):
  job = job_lib.build_job(config, jax.devices()[:1])
  return job, optimizer.decaying_params(config.train, job.task.model.abstract_boxed)


def _llama():
  return tiny.get_config()


def test_llama_decays_its_matrices_only():
  job, decays = _decaying(_llama())
  assert sorted(p for p, d in decays.items() if d) == [
      'embed/embedding', 'head/kernel', 'layers/attention/key/kernel', 'layers/attention/out/kernel',
      'layers/attention/query/kernel', 'layers/attention/value/kernel', 'layers/mlp/down/kernel',
      'layers/mlp/gate/kernel', 'layers/mlp/up/kernel']
  # Stacked norm scales are (layers, d_model): rank 1 per layer, so no decay.
  assert sorted(p for p, d in decays.items() if not d) == [
      'final_norm/scale', 'layers/attention_norm/scale', 'layers/mlp_norm/scale']
  table, _ = sharding.sharding_table(job.abstract, job.shardings, decays=decays)
  rows = {line.split()[0]: line.split()[-1] for line in table.splitlines()[1:] if '/' in line.split()[0]}
  assert rows['layers/mlp/up/kernel'] == 'yes' and rows['final_norm/scale'] == 'no'


def test_exclude_regex_and_zero_decay():
  config = _llama()
  config.train.weight_decay_exclude = ('^embed/', 'head')
  _, decays = _decaying(config)
  assert not decays['embed/embedding'] and not decays['head/kernel'] and decays['layers/mlp/up/kernel']
  config = _llama()
  config.train.weight_decay = 0.0
  assert not any(_decaying(config)[1].values())


def test_vit_decays():
  """Multi-head attention biases are (blocks, heads, head_dim), rank 2 per block: still no decay."""
  _, decays = _decaying(vit_tiny.get_config())
  assert sorted(p for p, d in decays.items() if d) == [
      'blocks/attention/key/kernel', 'blocks/attention/out/kernel', 'blocks/attention/query/kernel',
      'blocks/attention/value/kernel', 'blocks/mlp/down/kernel', 'blocks/mlp/up/kernel', 'head/kernel',
      'patch_embed/kernel', 'position_embed']
  assert len(decays) == 23


def test_brought_model_decays():
  config = _llama()
  config.model.name = 'tests.custom_models:MlpLM'
  _, decays = _decaying(config)
  assert decays == {'embed/embedding': True, 'hidden/bias': False, 'hidden/kernel': True, 'out/kernel': True}
