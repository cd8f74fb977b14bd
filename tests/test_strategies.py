"""Every strategy and mesh trains the same numbers, and checkpoints move between strategies.

Runs `trainer.run.loop.run` in-process on the 8 fake CPU devices (subprocesses would
pay jax's start-up every time). float32 and one log line per step, so
`metrics.jsonl` holds every step's loss; equal losses for 10 steps mean equal
gradients and updates, since any difference would grow from step to step.
"""

import os
import pathlib
import shutil

import jax
import pytest

from conftest import read_metrics

from configs import tiny
from trainer.base.errors import UserError
from trainer.run import loop

RTOL = 1e-5
# A corner of the standard library: the same text for every run, read in a fraction of the full one's time.
TEXT_DIR = pathlib.Path(os.__file__).parent / 'email'
# Wide enough for mesh.tensor=8: heads, mlp and vocab all divide by 8.
WIDE = {'num_heads': 8, 'd_model': 64, 'mlp_dim': 128}


def _config(strategy='jit', mesh=(8, 1, 1), steps=10, evaluate=False, **model):
  c = tiny.get_config()
  c.parallel.strategy = strategy
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  c.data.text_dir = str(TEXT_DIR)
  c.train.steps = steps
  c.train.compute_dtype = 'float32'
  c.train.eval_every_steps = 0  # With evaluate, only at the last step: each strategy's own eval step.
  c.train.eval_batches = 2 if evaluate else 0  # Otherwise none, to keep the runs short.
  c.train.accept_schedule_change = True  # Runs stopped at 4 steps and continued to 6 extend their schedule.
  c.log.every_steps = 1
  c.ckpt.every_steps = 10
  for key, value in model.items():
    c.model[key] = value
  return c



def _train(workdir: pathlib.Path, config, devices=None) -> list[dict]:
  loop.run(config, str(workdir), devices=devices)
  return read_metrics(workdir)


def _max_relative_difference(records, reference, keys=('loss', 'grad_norm', 'eval_loss')) -> float:
  """Over every logged step and every key the run logged (eval_loss only at its last step)."""
  assert [r['step'] for r in records] == [r['step'] for r in reference]
  return max(abs(r[k] - ref[k]) / abs(ref[k]) for r, ref in zip(records, reference) for k in keys if k in r)


def _assert_same_numbers(records, reference, evaluated=False):
  assert [r['step'] for r in reference] == list(range(1, 11))
  assert ('eval_loss' in records[-1]) == evaluated
  difference = _max_relative_difference(records, reference)
  print(f'max relative difference {difference:.2e}')
  assert difference <= RTOL


@pytest.fixture(scope='module')
def data_parallel_jit(tmp_path_factory):
  """The reference: 10 steps under 'jit' on the data-parallel mesh (8, 1, 1), evaluated at the end."""
  return _train(tmp_path_factory.mktemp('reference'), _config(evaluate=True))


@pytest.mark.parametrize('mesh', [(2, 4, 1), (1, 8, 1), (2, 2, 2)], ids=lambda mesh: 'x'.join(map(str, mesh)))
def test_mesh_matches_data_parallel(mesh, data_parallel_jit, tmp_path):
  _assert_same_numbers(_train(tmp_path, _config('jit', mesh)), data_parallel_jit)


@pytest.mark.parametrize('strategy', ['shard_map', 'pmap'])
def test_strategy_matches_jit(strategy, data_parallel_jit, tmp_path):
  """Train and eval steps both: the eval step is partitioned by the strategy too."""
  records = _train(tmp_path, _config(strategy, (8, 1, 1), evaluate=True))
  _assert_same_numbers(records, data_parallel_jit, evaluated=True)


def test_one_device_matches_eight(data_parallel_jit, tmp_path):
  records = _train(tmp_path, _config(mesh=(1, 1, 1)), devices=jax.devices()[:1])
  _assert_same_numbers(records, data_parallel_jit)


def test_tensor_parallel_over_eight_devices_matches_data_parallel(tmp_path):
  reference = _train(tmp_path / 'data', _config(mesh=(8, 1, 1), **WIDE))
  _assert_same_numbers(_train(tmp_path / 'tensor', _config(mesh=(1, 1, 8), **WIDE)), reference)


@pytest.mark.parametrize('strategy,mesh,message', [
    ('pmap', (4, 2, 1), r"parallel.strategy='pmap' .* needs mesh.fsdp=1 and mesh.tensor=1 \(got mesh.fsdp=2"),
    ('shard_map', (4, 1, 2), r"parallel.strategy='shard_map' does not support .*mesh.tensor=2.*strategy='jit'"),
], ids=['pmap_with_fsdp', 'shard_map_with_tensor'])
def test_strategy_that_cannot_run_on_the_mesh_is_refused(strategy, mesh, message, tmp_path):
  with pytest.raises(UserError, match=message):
    loop.run(_config(strategy, mesh), str(tmp_path))
  assert not (tmp_path / 'checkpoints').exists()


def test_jit_checkpoint_resumes_under_every_strategy(tmp_path, caplog):
  """4 steps under 'jit', then steps 5-6 (and eval) under each strategy from a copy of that workdir.

  shard_map resumes on an fsdp mesh (2, 4, 1): the checkpoint is restored straight into shards, and
  its explicit all_gather / psum_scatter / psum must give the numbers of jit on (8, 1, 1).
  """
  _train(tmp_path / 'jit4', _config(steps=4))
  resumed = {}
  for strategy, mesh in (('jit', (8, 1, 1)), ('pmap', (8, 1, 1)), ('shard_map', (2, 4, 1))):
    workdir = tmp_path / strategy
    shutil.copytree(tmp_path / 'jit4', workdir)
    caplog.clear()
    with caplog.at_level('INFO'):
      resumed[strategy] = _train(workdir, _config(strategy, mesh, steps=6, evaluate=True))
    assert 'Resuming from checkpoint at step 4' in caplog.text
    assert [r['step'] for r in resumed[strategy]] == [1, 2, 3, 4, 5, 6]
    assert 'eval_loss' in resumed[strategy][-1]
  for strategy in ('pmap', 'shard_map'):
    difference = _max_relative_difference(resumed[strategy][4:], resumed['jit'][4:])
    print(f'{strategy} after resuming: max relative difference {difference:.2e}')
    assert difference <= RTOL


@pytest.mark.parametrize('strategy,mesh', [('jit', (2, 2, 2)), ('shard_map', (8, 1, 1)), ('pmap', (8, 1, 1))])
def test_chunked_loss_trains_the_same_numbers_under_every_strategy(strategy, mesh, data_parallel_jit, tmp_path):
  """train.loss_chunks=4 (tests/test_chunked_loss.py): the reference's losses, gradient norms and eval loss."""
  config = _config(strategy, mesh, evaluate=True)
  config.train.loss_chunks = 4
  _assert_same_numbers(_train(tmp_path, config), data_parallel_jit, evaluated=True)
