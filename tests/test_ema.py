"""train.ema_decay: a float32 moving average of the parameters, updated by the step and evaluated."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, read_metrics, run_python

from configs import tiny
from parallel import sharding
from trainer.base.errors import UserError
from trainer.run import job as job_lib
from trainer.run import loop
from trainer.training import checkpoint
from trainer.training import state as state_lib
from test_strategies import TEXT_DIR

DECAY = 0.75


def _config(**train):
  c = tiny.get_config()
  c.train.ema_decay = DECAY
  c.train.compute_dtype = 'float32'
  c.data.text_dir = str(TEXT_DIR)
  for key, value in train.items():
    c.train[key] = value
  return c


def test_ema_equals_hand_computed_average_after_3_steps():
  job = job_lib.build_job(_config(), jax.devices()[:2])
  state = job.init_state(0)
  compiled = job.compile_train_step()
  history = [jax.device_get(state.params)]
  for i in range(3):
    batch = {k: jax.device_put(jax.random.randint(jax.random.key(i), s.shape, 0, 256).astype(s.dtype), s.sharding)
             for k, s in job.abstract_batch.items()}
    state, _ = compiled(state, batch)
    history.append(jax.device_get(state.params))
  # ema_0 = params_0; ema_t = d ema_{t-1} + (1 - d) params_t, here summed in closed form.
  for path, ema in jax.tree_util.tree_leaves_with_path(jax.device_get(state.ema_params)):
    p = [np.asarray(dict(jax.tree_util.tree_leaves_with_path(h))[path], np.float64) for h in history]
    expected = DECAY ** 3 * p[0] + (1 - DECAY) * (DECAY ** 2 * p[1] + DECAY * p[2] + p[3])
    assert ema.dtype == jnp.float32
    np.testing.assert_allclose(ema, expected, rtol=1e-5, atol=1e-7)
  # Sharded like the parameters.
  assert jax.tree.map(lambda s: s.spec, job.shardings.ema_params) == jax.tree.map(lambda s: s.spec,
                                                                                   job.shardings.params)
  assert not np.allclose(jax.tree.leaves(state.ema_params)[0], jax.tree.leaves(state.params)[0])


def _ema_at(workdir, step):
  job = job_lib.build_job(_config(steps=step))
  ckpt = checkpoint.Checkpointer(str(workdir), job.config.ckpt)
  restored = ckpt.restore_state(step, sharding.with_shardings(job.abstract, job.shardings))
  ckpt.close()
  return jax.device_get(restored.ema_params)


def test_ema_is_evaluated_and_survives_resume_bit_exactly(tmp_path):
  straight, resumed = tmp_path / 'straight', tmp_path / 'resumed'
  loop.run(_config(steps=4), str(straight))  # Checkpoints at step 4 (ckpt.every_steps=4).
  last = read_metrics(straight)[-1]
  assert last['step'] == 4 and 'eval_ema_loss' in last and last['eval_ema_loss'] != last['eval_loss']
  loop.run(_config(steps=2), str(resumed))  # Stops (and saves) at step 2 ...
  assert (resumed / 'checkpoints' / '2').is_dir()
  loop.run(_config(steps=4), str(resumed))  # ... and goes on to 4 from that checkpoint.
  ema, again = _ema_at(straight, 4), _ema_at(resumed, 4)
  assert jax.tree.leaves(ema)[0].dtype == np.float32
  jax.tree.map(np.testing.assert_array_equal, ema, again)

  # The exports and sample.py use the average when asked: the exported tree is the average, in the parameters' dtype.
  import orbax.checkpoint as ocp

  from scripts import sample  # Imported once per process: its absl flags can be defined only once.
  export = run_python([sys.executable, str(REPO / 'scripts/export_params.py'), '--config=configs/tiny.py',
                       f'--config.data.text_dir={TEXT_DIR}', f'--config.train.ema_decay={DECAY}',
                       '--config.train.compute_dtype=float32', f'--workdir={straight}',
                       f'--output={tmp_path / "ema_export"}', '--params=ema'], timeout=300)
  assert export.returncode == 0, export.stderr[-2000:]
  meta = ocp.PyTreeCheckpointer().metadata(tmp_path / 'ema_export').item_metadata.tree
  exported = ocp.PyTreeCheckpointer().restore(
      tmp_path / 'ema_export', restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta))
  jax.tree.map(lambda e, x: np.testing.assert_array_equal(np.asarray(e, np.float32), x), ema, exported)
  greedy = {which: sample.sample(str(straight), 'def ', 8, 0.0, 0, 'latest', params=which) for which in ('raw', 'ema')}
  assert all(text.startswith(b'def ') and len(text) == 4 + 8 for text in greedy.values())

  # Turning the average off on resume is refused in one line: the saved state has it.
  with pytest.raises(UserError, match=r'trained with train.ema_decay=0.75, so its checkpoints keep a parameter '
                                      r'average; resume with --config.train.ema_decay=0.75'):
    loop.run(_config(steps=6, ema_decay=0.0), str(straight))


def test_asking_for_the_average_of_a_run_without_one_is_one_line():
  job = job_lib.build_job(_config(ema_decay=0.0), jax.devices()[:1])
  with pytest.raises(UserError, match=r'--params=ema: this run kept no parameter average \(it was trained with '
                                      r'train.ema_decay=0\)'):
    state_lib.params_of(job.init_state(0), 'ema')


def test_ema_decay_out_of_range_is_refused():
  with pytest.raises(UserError, match=r'train.ema_decay=1.0 must be in \[0, 1\)'):
    job_lib.build_job(_config(ema_decay=1.0))
