"""The `expert` mesh axis: the MoE Llama trains the same numbers at every expert-axis size, and resumes across sizes.

In-process runs on the 8 fake CPU devices, float32, a loss logged every step. A
constant learning rate after warmup, so a run stopped at step 5 and resumed to 10
follows the straight 10-step run exactly.
"""

import os
import pathlib
import shutil

import pytest

from conftest import read_metrics

from configs import tiny
from trainer.base.errors import UserError
from trainer.run import loop

RTOL = 1e-5
TEXT_DIR = pathlib.Path(os.__file__).parent / 'email'


def _config(mesh, steps=10, strategy='jit'):
  c = tiny.get_config()
  c.mesh.data, c.mesh.fsdp, c.mesh.expert = mesh
  c.parallel.strategy = strategy
  c.data.text_dir = str(TEXT_DIR)
  c.train.steps = steps
  c.train.schedule = 'constant'
  c.train.compute_dtype = 'float32'
  c.train.eval_batches = 0
  c.log.every_steps = 1
  c.ckpt.every_steps = 5
  c.model.num_experts = 8
  c.model.experts_per_token = 2
  c.model.router_aux_loss_weight = 0.1  # Large enough that the balancing term moves the numbers compared.
  return c


def _losses(workdir: pathlib.Path, config) -> list[float]:
  loop.run(config, str(workdir))
  return [r['loss'] for r in read_metrics(workdir)]


def _assert_close(losses, reference):
  assert len(losses) == len(reference)
  worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
  print(f'max relative difference {worst:.2e}')
  assert worst <= RTOL


@pytest.fixture(scope='module')
def expert_1(tmp_path_factory):
  """The reference: data=4 x fsdp=2, no expert axis, 10 steps."""
  return _losses(tmp_path_factory.mktemp('expert1'), _config((4, 2, 1)))


def test_expert_axis_of_8_trains_the_same_losses(expert_1, tmp_path):
  _assert_close(_losses(tmp_path, _config((1, 1, 8))), expert_1)


def test_checkpoint_from_expert_4_resumes_at_expert_2(expert_1, tmp_path, caplog):
  """5 steps at data=1 x fsdp=2 x expert=4, then steps 6-10 at data=2 x fsdp=2 x expert=2 from its checkpoint.

  Both sizes train the reference's losses (expert=4 steps 1-5, expert=2 steps 6-10), so expert = 1, 2, 4 and 8
  are all compared with one compile each (the CPU budget of the suite).
  """
  first = _losses(tmp_path / 'run', _config((1, 2, 4), steps=5))
  _assert_close(first, expert_1[:5])
  with caplog.at_level('INFO'):
    resumed = _losses(tmp_path / 'run', _config((2, 2, 2), steps=10))
  assert 'Resuming from checkpoint at step 5' in caplog.text
  _assert_close(resumed[5:], expert_1[5:])


@pytest.mark.parametrize('strategy', ['shard_map', 'pmap'])
def test_per_device_strategies_refuse_an_expert_axis(strategy, tmp_path):
  with pytest.raises(UserError, match=rf"parallel.strategy='{strategy}' does not support an expert axis "
                                      r"\(mesh.expert=2\); set mesh.expert=1"):
    loop.run(_config((4, 1, 2), strategy=strategy), str(tmp_path))
  assert not (tmp_path / 'checkpoints').exists()
