"""The router bias (model.router_bias_rate) through real runs: on resume, and under every strategy and accumulation.

Resume, through the launcher: another rate > 0 resumes and moves the saved bias by the new rate (with a line naming
both), while turning the bias on or off is one `launch.py: error:` line before the compile. The tiny MoE (4 experts,
top-2, scanned layers) trained 2 steps at rate 0.01 and at 0; a constant schedule, so a longer train.steps moves no
learning rate and the only change a resume sees is the rate.

Strategies, in-process (as tests/test_strategies.py): 'shard_map' and 'pmap' move each bias by the mean of the
devices' signs (docs/moe.md), which is not the 'jit' run's sign of the global load (on 8 devices from the same start
the two differ after one step, by design). Their rule is that of a 'jit' run whose microbatches are the devices' rows:
one device, train.grad_accum_steps=8 over a batch of 8, where each microbatch is one row as each device's shard is.
Those three runs, by three code paths (the accumulation's scan, shard_map's pmean, pmap's pmean), train the same
losses, gradient norms and biases.
"""

import re
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from conftest import read_metrics, run_launcher
from test_strategies import RTOL, TEXT_DIR, _config, _max_relative_difference
from trainer.run import loop

RATE = 0.01
STEPS = 3  # Of the strategy runs.


def _launch(workdir, steps: int, rate: float):
  return run_launcher('--config=configs/tiny.py', f'--workdir={workdir}', f'--config.data.text_dir={TEXT_DIR}',
                      '--config.model.num_experts=4', '--config.model.experts_per_token=2',
                      f'--config.model.router_bias_rate={rate}', f'--config.train.steps={steps}',
                      '--config.train.schedule=constant', '--config.train.eval_batches=0',
                      '--config.train.compute_dtype=float32', '--config.ckpt.every_steps=2')


def _saved_bias(workdir, step: int) -> np.ndarray:
  """Every MoE layer's router bias (layers, experts) in checkpoint `step`, read with Orbax alone."""
  path = workdir / 'checkpoints' / str(step) / 'state'
  reader = ocp.PyTreeCheckpointer()
  tree = reader.metadata(path).item_metadata.tree
  state = reader.restore(path, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
  return state['params']['layers']['moe']['router_bias']


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """{rate: workdir} of 2 steps at RATE and at 0, each checkpointed at step 2."""
  root = tmp_path_factory.mktemp('router_bias')
  workdirs = {}
  for rate in (RATE, 0.0):
    workdirs[rate] = root / f'rate-{rate}'
    result = _launch(workdirs[rate], 2, rate)
    assert result.returncode == 0, result.stderr[-3000:]
  return workdirs


def test_another_nonzero_rate_resumes_and_moves_the_bias_by_it(trained, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(trained[RATE], workdir)
  result = _launch(workdir, 3, 2 * RATE)
  assert result.returncode == 0, result.stderr[-3000:]
  assert re.search(r'Resuming step 2 with 2 setting\(s\) changed since it was saved: config.model.router_bias_rate: '
                   r'0.01 -> 0.02; config.train.steps: 2 -> 3\n', result.stderr), result.stderr[-3000:]
  before, after = _saved_bias(workdir, 2), _saved_bias(workdir, 3)
  # Steps 1-2 moved each bias by +-0.01 a step; step 3 by +-0.02 (or 0 where an expert sat exactly at its share).
  np.testing.assert_allclose(np.abs(before) % RATE, 0, atol=1e-6)
  moved = np.abs(after - before)
  assert np.all(np.isclose(moved, 0, atol=1e-6) | np.isclose(moved, 2 * RATE, atol=1e-6)), moved
  assert np.isclose(moved, 2 * RATE, atol=1e-6).any(), moved


@pytest.mark.parametrize('saved, relaunched, message', [
    (RATE, 0.0, r'was trained with model.router_bias_rate=0.01, so its checkpoints hold the router bias its experts '
                r'are chosen with; resume with a rate > 0 \(--config.model.router_bias_rate=0.01, or another'),
    (0.0, RATE, r'was trained with model.router_bias_rate=0, so its checkpoints hold no router bias; resume with '
                r'--config.model.router_bias_rate=0, or use a fresh --workdir to train with '
                r'model.router_bias_rate=0.01 from step 0'),
], ids=['off', 'on'])
def test_turning_the_bias_on_or_off_on_resume_is_one_line_before_the_compile(trained, saved, relaunched, message):
  workdir = trained[saved]
  listing = sorted(p.relative_to(workdir) for p in (workdir / 'checkpoints').rglob('*'))
  result = _launch(workdir, 4, relaunched)
  assert result.returncode == 2, result.stderr[-3000:]
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith(f'launch.py: error: --workdir {workdir} ') and re.search(message, last), last
  assert 'Traceback' not in result.stderr and 'Compiling the train step' not in result.stderr
  assert sorted(p.relative_to(workdir) for p in (workdir / 'checkpoints').rglob('*')) == listing  # Nothing changed.


@pytest.fixture(scope='module')
def accumulated(tmp_path_factory):
  """(records, final bias) of 3 steps under 'jit' on one device, 8 microbatches of one row each."""
  workdir = tmp_path_factory.mktemp('accumulated')
  loop.run(_bias_config('jit', (1, 1, 1), grad_accum_steps=8), str(workdir), devices=jax.devices()[:1])
  return read_metrics(workdir), _saved_bias(workdir, STEPS)


def _bias_config(strategy: str, mesh: tuple[int, int, int], grad_accum_steps: int = 1):
  c = _config(strategy, mesh, steps=STEPS, num_experts=4, experts_per_token=2, router_bias_rate=RATE)
  c.train.grad_accum_steps, c.ckpt.every_steps = grad_accum_steps, STEPS
  return c


@pytest.mark.parametrize('strategy, mesh', [('shard_map', (2, 4, 1)), ('pmap', (8, 1, 1))])
def test_each_devices_rows_move_the_bias_as_a_microbatch_does(strategy, mesh, accumulated, tmp_path):
  records, bias = accumulated
  # The accumulated rule itself: each step moves a bias by rate x the mean of 8 signs, so by a multiple of rate / 8
  # and by at most rate (a sum of the microbatches' moves would go up to 8 x rate).
  np.testing.assert_allclose(bias / (RATE / 8), np.round(bias / (RATE / 8)), atol=1e-3)
  assert np.abs(bias).max() <= STEPS * RATE + 1e-6 and np.abs(bias).max() > 0, bias
  loop.run(_bias_config(strategy, mesh), str(tmp_path))
  assert [r['step'] for r in read_metrics(tmp_path)] == list(range(1, STEPS + 1))
  difference = _max_relative_difference(read_metrics(tmp_path), records, keys=('loss', 'grad_norm'))
  print(f'{strategy}: max relative difference {difference:.2e}')
  assert difference <= RTOL
  np.testing.assert_allclose(_saved_bias(tmp_path, STEPS), bias, rtol=0, atol=1e-6)  # A sign apart is rate / 8.
