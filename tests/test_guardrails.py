"""train.on_nonfinite through the real launcher: a NaN gradient in one named leaf, on one chosen batch.

The run is launch.py itself, started by a small driver that first wraps
trainer.training.step.grads_and_metrics so the gradient of POISON_LEAF turns NaN on the
batch whose first row is POISON_ROW: the fault follows the data, as a real bad
batch would, so a rollback that skips it must get past it.
"""

import json
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import tiny
from conftest import REPO, launcher_env, make_text_dir, run_python
from parallel import sharding
from trainer import data
from trainer.run import job as job_lib
from trainer.training import checkpoint

LEAF = 'layers/mlp/up/kernel'  # Scanned layers: one stacked leaf for every block.
DRIVER = f'''
import json, os, runpy, sys
sys.path.insert(0, {str(REPO)!r})
import jax, jax.numpy as jnp
from trainer.training import step
row = jnp.asarray(json.loads(os.environ['POISON_ROW']), jnp.int32)
original = step.grads_and_metrics

def poisoned(params, batch, *args):
  grads, metrics = original(params, batch, *args)
  hit = jnp.any(jnp.all(batch['inputs'] == row, axis=-1))
  name = lambda path: '/'.join(str(k.key) for k in path)
  return jax.tree_util.tree_map_with_path(
      lambda p, g: jnp.where(hit, jnp.nan, g) if name(p) == {LEAF!r} else g, grads), metrics

step.grads_and_metrics = poisoned
sys.argv = ['launch.py', *sys.argv[1:]]
runpy.run_path({str(REPO / 'launch.py')!r}, run_name='__main__')
'''



@pytest.fixture(scope='module')
def text_dir(tmp_path_factory):
  return make_text_dir(tmp_path_factory.mktemp('text'))


def _config(text_dir):
  config = tiny.get_config()  # 8 steps, a checkpoint every 4; the bad batch is step 6's in every test.
  config.data.text_dir = str(text_dir)
  return config


def _run(workdir, text_dir, mode: str, *extra: str, bad_step: int = 6) -> subprocess.CompletedProcess:
  config = _config(text_dir)
  iterator = data.train_iterator_for(config)
  for _ in range(bad_step):
    row = next(iterator)['inputs'][0]
  env = launcher_env(POISON_ROW=json.dumps(row.tolist()))
  return run_python([sys.executable, '-c', DRIVER, '--config=configs/tiny.py', f'--workdir={workdir}',
                     f'--config.data.text_dir={text_dir}', '--config.log.every_steps=1',
                     f'--config.train.on_nonfinite={mode}', *extra], env=env, timeout=600,
                    read_at_run_time=('POISON_ROW',))


def _saved(workdir) -> list[int]:
  return sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir() if p.name.isdigit())


def _notfinite_count(workdir, text_dir, step: int) -> int:
  """The optimizer's count of dropped updates (optax.apply_if_finite), read from the checkpoint at `step`."""
  config = _config(text_dir)
  job = job_lib.build_job(config)
  state = checkpoint.Checkpointer(str(workdir), config.ckpt).restore_state(
      step, sharding.with_shardings(job.abstract, job.shardings))
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
  return int(state.opt_state.total_notfinite)


def _steps_logged(workdir) -> list[int]:
  return [json.loads(l)['step'] for l in (workdir / 'metrics.jsonl').read_text().splitlines()]


def test_stop_exits_3_naming_the_leaf_and_keeps_only_good_checkpoints(tmp_path, text_dir):
  # The bad step is also a save step: the loop must check it before saving it.
  result = _run(tmp_path, text_dir, 'stop', '--config.ckpt.every_steps=2')
  assert result.returncode == 3, result.stderr[-3000:]
  errors = [l for l in result.stderr.splitlines() if l.startswith('launch.py: error:')]
  assert len(errors) == 1 and 'Traceback' not in result.stderr, result.stderr[-3000:]
  assert f'step 6: finite loss and non-finite gradients in 1 parameter leaves: {LEAF}.' in errors[0]
  assert 'train.on_nonfinite=stop' in errors[0]
  assert _saved(tmp_path) == [2, 4]
  assert not list((tmp_path / 'checkpoints').glob('*tmp*'))
  assert _notfinite_count(tmp_path, text_dir, 4) == 0


def test_skip_drops_the_update_names_the_leaf_and_trains_on(tmp_path, text_dir):
  result = _run(tmp_path, text_dir, 'skip')
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'Step 6: finite loss and non-finite gradients in 1 parameter leaves: {LEAF}; update skipped' in result.stderr
  assert _saved(tmp_path) == [4, 8]
  assert _steps_logged(tmp_path) == list(range(1, 9))
  assert _notfinite_count(tmp_path, text_dir, 8) == 1


def test_rollback_reloads_the_last_checkpoint_and_skips_the_bad_batch(tmp_path, text_dir):
  result = _run(tmp_path, text_dir, 'rollback')
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'Step 6: finite loss and non-finite gradients in 1 parameter leaves: {LEAF}. Rolled back to the ' \
         'checkpoint at step 4' in result.stderr
  assert 'Step 6: skipped the batch that went non-finite' in result.stderr
  assert _saved(tmp_path) == [4, 8]
  logged = _steps_logged(tmp_path)
  assert logged[-1] == 8 and logged.count(5) == 2
  # The state at 8 descends from step 4's, never saw the bad batch, so no update was ever dropped.
  assert _notfinite_count(tmp_path, text_dir, 8) == 0


def _metrics(finite: bool) -> dict:
  return {'loss': np.float32(2.0 if finite else np.nan), 'grads_finite': np.array([finite, True])}


def test_skip_stops_once_most_steps_were_skipped_and_counts_them():
  from trainer.safety import guardrails
  guard = guardrails.Guard('skip', ['a', 'b'])
  for step in range(1, 10):  # 6 of the first 9 skipped: below SKIP_MIN_CHECKED steps, it trains on.
    guard.check(step, _metrics(finite=step % 3 == 0))
  with pytest.raises(guardrails.NonFiniteError, match=r'step 10: 7 of the 10 steps checked in this launch were '
                                                      r'non-finite and skipped \(train.on_nonfinite=skip\); stopped'):
    guard.check(10, _metrics(finite=False))
  assert guardrails.NonFiniteError.exit_code == 3

  sparse = guardrails.Guard('skip', ['a', 'b'])
  for step in range(1, 41):  # One step in four: the run still trains, so it goes on.
    sparse.check(step, _metrics(finite=step % 4 != 0))


def test_skip_never_saves_while_skipped_steps_outnumber_good_ones_and_names_the_resume_step():
  from trainer.safety import guardrails
  guard = guardrails.Guard('skip', ['a', 'b'], resumed_step=8)
  for step in range(9, 12):
    guard.check(step, _metrics(finite=True))
  assert guard.may_save(12)  # Three good steps since checkpoint 8 (and step 12 itself is checked before saving).
  guard.saved(12)
  for step in range(13, 16):  # From here every step is skipped: the model stopped training.
    guard.check(step, _metrics(finite=False))
  assert not guard.may_save(16)
  guard.check(16, _metrics(finite=True))
  guard.check(17, _metrics(finite=True))
  assert not guard.may_save(17)  # 3 skipped, 2 good since checkpoint 12.
  guard.check(18, _metrics(finite=True))
  assert guard.may_save(18)  # 3 and 3: training again.
  fresh = guardrails.Guard('skip', ['a', 'b'])
  for step in range(1, 10):
    fresh.check(step, _metrics(finite=False))
  assert not fresh.may_save(4)
  with pytest.raises(guardrails.NonFiniteError, match=r'a relaunch resumes from step 0 \(no checkpoint was saved '
                                                      r'before the skips\)'):
    fresh.check(10, _metrics(finite=False))


def test_a_diverged_skip_run_keeps_its_good_checkpoints_and_the_advice_is_true(tmp_path, text_dir):
  """From a good run at step 8: every later step is skipped; nothing is saved over checkpoints 4 and 8."""
  good = _run(tmp_path, text_dir, 'skip', '--config.train.steps=8', bad_step=100)
  assert good.returncode == 0, good.stderr[-3000:]
  assert _saved(tmp_path) == [4, 8]
  hashes = {p: p.read_bytes() for p in (tmp_path / 'checkpoints').rglob('*') if p.is_file()}
  diverged = _run(tmp_path, text_dir, 'skip', '--config.train.learning_rate=1e6', '--config.train.steps=40',
                  '--config.ckpt.every_steps=4', '--config.ckpt.max_to_keep=2',
                  '--config.train.accept_schedule_change=True', bad_step=100)
  assert diverged.returncode == 3, diverged.stderr[-3000:]
  assert 'a relaunch resumes from step 8: lower train.learning_rate' in diverged.stderr
  assert _saved(tmp_path) == [4, 8]
  assert {p: p.read_bytes() for p in (tmp_path / 'checkpoints').rglob('*') if p.is_file()} == hashes
