"""Checkpoints in-process: restore onto any mesh and strategy, damaged checkpoints, the manifest's checks."""

import json
import logging as std_logging
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import tiny
from conftest import REPO, free_port, make_text_dir, xla_flags
from parallel import sharding
from trainer import data
from trainer.base.errors import UserError
from trainer.run import job as job_lib
from trainer.training import checkpoint
from trainer.training import manifest as manifests


@pytest.fixture(scope='module')
def text_dir(tmp_path_factory):
  return make_text_dir(tmp_path_factory.mktemp('text'))


def _config(text_dir, **overrides):
  config = tiny.get_config()
  config.data.text_dir = str(text_dir)
  for key, value in overrides.items():
    section, field = key.split('__')
    config[section][field] = value
  return config


def _iterator(config):
  return data.train_iterator_for(config)


def _save(workdir, config, steps=(7,), devices=None):
  """Saves the initial state of seed 0, its `step` field set, at each of `steps`; returns the host copy of the last."""
  job = job_lib.build_job(config, devices)
  manifest = manifests.run_manifest(config, job.abstract, job.mesh)
  ckpt = checkpoint.Checkpointer(str(workdir), config.ckpt)
  iterator = _iterator(config)
  initial = job.init_state(0)
  for step in steps:
    state = initial.replace(step=jax.device_put(np.int32(step), initial.step.sharding))
    ckpt.save(step, state, iterator, manifest, force=True)
  ckpt.close()
  return jax.device_get(state), manifest


@pytest.fixture(scope='module')
def saved_2x4(tmp_path_factory, text_dir):
  """A jit checkpoint from mesh (data=2, fsdp=4, tensor=1): parameters sharded 4 ways."""
  workdir = tmp_path_factory.mktemp('saved_2x4')
  config = _config(text_dir, mesh__data=2, mesh__fsdp=4)
  host_state, _ = _save(workdir, config)
  return workdir, host_state


@pytest.fixture(scope='module')
def saved_8x1(tmp_path_factory, text_dir):
  """Checkpoints at steps 4, 8 and 10 of the tiny config on 8 devices; tests damage copies of it."""
  workdir = tmp_path_factory.mktemp('saved_8x1')
  _, manifest = _save(workdir, _config(text_dir), steps=(4, 8, 10))
  return workdir, manifest


TARGETS = {  # name: (config overrides, number of devices)
    '(8,1,1) jit': ({}, 8),
    '4 devices': ({}, 4),
    '1 device': ({}, 1),
    '(1,8,1) fsdp': ({'mesh__data': 1, 'mesh__fsdp': 8}, 8),
    'pmap': ({'parallel__strategy': 'pmap'}, 8),
    'shard_map': ({'parallel__strategy': 'shard_map'}, 8),
}


@pytest.mark.parametrize('target', TARGETS)
def test_a_2x4_jit_checkpoint_restores_onto_any_mesh_and_strategy(saved_2x4, text_dir, target):
  workdir, expected = saved_2x4
  overrides, count = TARGETS[target]
  config = _config(text_dir, **overrides)
  job = job_lib.build_job(config, jax.devices()[:count])
  restored = checkpoint.Checkpointer(str(workdir), config.ckpt).restore_state(
      7, sharding.with_shardings(job.abstract, job.shardings))
  assert int(restored.step) == 7
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), expected)
  # Straight into the target layout: every leaf already has the sharding the compiled step expects,
  # and a sharded leaf holds only its slice on each device (Orbax reads per shard, nothing whole on the host).
  for leaf, target_sharding in zip(jax.tree.leaves(restored), jax.tree.leaves(job.shardings)):
    assert leaf.sharding.is_equivalent_to(target_sharding, leaf.ndim)
    assert {d.id for d in leaf.sharding.device_set} == {d.id for d in job.mesh.devices.flat}
  if target == '(1,8,1) fsdp':
    embed = restored.params['embed']['embedding']
    assert {s.data.shape for s in embed.addressable_shards} == {(embed.shape[0], embed.shape[1] // 8)}


def _leaf_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
  # After a save, Orbax merges each process's OCDBT store into state/d/, which restores read.
  return sorted((p for p in (step_dir / 'state' / 'd').iterdir()), key=lambda p: p.stat().st_size)


def _killed_mid_save(workdir: pathlib.Path) -> None:
  """A real save of step 12 killed by SIGKILL in a subprocess after its data is written, before its commit.

  Orbax's commit (the rename of the tmp folder) is replaced by one that signals and then blocks, so the kill
  lands mid-save by construction, however fast this machine writes.
  """
  script = f'''
import os, signal, sys, threading
sys.path.insert(0, {str(REPO)!r})
import jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp
from orbax.checkpoint._src.path import atomicity
reached = threading.Event()
async def never_commit(self):
  reached.set()
  threading.Event().wait()
for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
  cls.finalize = never_commit
manager = ocp.CheckpointManager({str(workdir / 'checkpoints')!r})
state = {{'w': jnp.asarray(np.ones((64, 64), np.float32))}}
threading.Thread(target=manager.save, args=(12,), kwargs=dict(args=ocp.args.Composite(
    state=ocp.args.StandardSave(state))), daemon=True).start()
if not reached.wait(100):
  sys.exit('the save never reached its commit')
os.kill(os.getpid(), signal.SIGKILL)
'''
  result = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, 'XLA_FLAGS': ''})
  assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]


def test_incomplete_and_corrupt_checkpoints_are_reported_skipped_and_kept(saved_8x1, tmp_path, text_dir, caplog):
  config = _config(text_dir)
  shutil.copytree(saved_8x1[0], tmp_path, dirs_exist_ok=True)
  manifest = saved_8x1[1]
  _killed_mid_save(tmp_path)
  newest = _leaf_files(tmp_path / 'checkpoints' / '10')[-1]  # The step-10 state's array data, cut short.
  newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
  before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob('*'))
  assert any('12.orbax-checkpoint-tmp/state' in p and '/d/' in p for p in before)  # Its data was written.

  job = job_lib.build_job(config)
  ckpt = checkpoint.Checkpointer(str(tmp_path), config.ckpt)
  with caplog.at_level(std_logging.WARNING):
    steps = ckpt.resumable_steps(manifest)
    step, state = ckpt.restore_newest_intact(steps, sharding.with_shardings(job.abstract, job.shardings),
                                             _iterator(config))
  ckpt.close()
  assert steps == [8, 4]  # Step 10's data no longer matches its checksums: set aside before its manifest is read.
  assert step == 8 and int(state.step) == 8  # The step field tells the saves apart.
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), jax.device_get(job.init_state(0).params))
  text = caplog.text
  assert '12.orbax-checkpoint-tmp is an incomplete save' in text
  assert f'{tmp_path / "checkpoints" / "10"} is damaged' in text
  # Nothing deleted: step 10 was moved aside whole (so it can be saved again), everything else is where it was.
  [moved] = (tmp_path / 'damaged_checkpoints').iterdir()
  assert f'moved to {moved}' in text
  after = sorted(str(p.relative_to(tmp_path)).replace(f'damaged_checkpoints/{moved.name}', 'checkpoints/10')
                 for p in tmp_path.rglob('*') if p != tmp_path / 'damaged_checkpoints')
  assert after == before


def test_a_workdir_with_only_damaged_checkpoints_is_refused_not_restarted(saved_8x1, tmp_path, text_dir):
  config = _config(text_dir)
  shutil.copytree(saved_8x1[0], tmp_path, dirs_exist_ok=True)
  for step in (4, 8, 10):
    (tmp_path / 'checkpoints' / str(step) / 'manifest' / 'metadata').write_text('{"trunc')
  with pytest.raises(UserError, match=r'holds no intact checkpoint \(damaged: \[4, 8, 10\].*--start_over'):
    checkpoint.Checkpointer(str(tmp_path), config.ckpt).resumable_steps(saved_8x1[1])


def test_the_newest_readable_manifest_is_read_without_touching_the_workdir(saved_8x1, tmp_path):
  """What remat 'auto' reads to reuse its choice: an unfinished save and a damaged newest manifest are skipped."""
  from trainer.memory import remat
  shutil.copytree(saved_8x1[0], tmp_path, dirs_exist_ok=True)
  folder = tmp_path / 'checkpoints'
  shutil.copytree(folder / '10', folder / '12.orbax-checkpoint-tmp-1')  # A save killed before its rename.
  (folder / '10' / 'manifest' / 'metadata').write_text('{"trunc')
  older = checkpoint.newest_manifest(str(tmp_path))
  assert older is not None and older[0] == 8 and older[1]['param_shapes'] == saved_8x1[1]['param_shapes']
  marked = {**older[1], 'memory': {'remat_policy': 'full', 'grad_accum_steps': 2}}
  (folder / '8' / 'manifest' / 'metadata').write_text(json.dumps(marked))
  before = sorted(str(p) for p in tmp_path.rglob('*'))
  assert checkpoint.newest_manifest(str(tmp_path)) == (8, marked)
  assert remat.previous_choice(str(tmp_path)) == {'remat_policy': 'full', 'grad_accum_steps': 2}
  assert sorted(str(p) for p in tmp_path.rglob('*')) == before  # Nothing created, moved or deleted.
  for step in (4, 8):
    (folder / str(step) / 'manifest' / 'metadata').write_text('')
  assert checkpoint.newest_manifest(str(tmp_path)) is None and remat.previous_choice(str(tmp_path)) is None
  assert checkpoint.newest_manifest(str(tmp_path / 'new')) is None and not (tmp_path / 'new').exists()


def test_manifest_records_the_run_and_logs_the_changes(saved_2x4, text_dir, caplog):
  tmp_path = saved_2x4[0]
  config = _config(text_dir, mesh__data=2, mesh__fsdp=4)
  saved = checkpoint.Checkpointer(str(tmp_path), config.ckpt).read_manifest(7)
  assert saved['mesh'] == {'data': 2, 'fsdp': 4, 'pipeline': 1, 'expert': 1, 'context': 1, 'tensor': 1} and saved['strategy'] == 'jit'
  assert set(saved['versions']) == {'jax', 'jaxlib', 'flax', 'optax', 'orbax.checkpoint', 'grain'}
  assert saved['versions']['jax'] == jax.__version__
  assert '--xla_force_host_platform_device_count=8' in saved['xla_flags']
  assert saved['config']['train']['steps'] == 8 and saved['device_count'] == 8
  assert saved['git_commit'] is None or len(saved['git_commit']) == 40

  other = _config(text_dir, train__steps=50, train__accept_schedule_change=True, parallel__strategy='pmap',
                  model__attention='xla')  # A kernel, not weights; a longer cosine schedule, accepted.
  job = job_lib.build_job(other, jax.devices()[:4])
  with caplog.at_level(std_logging.INFO):
    assert checkpoint.Checkpointer(str(tmp_path), other.ckpt).resumable_steps(
        manifests.run_manifest(other, job.abstract, job.mesh)) == [7]
  assert "config.train.steps: 8 -> 50" in caplog.text
  assert 'train.steps 8 -> 50 since checkpoint 7: the learning-rate schedule moves' in caplog.text
  assert "strategy: 'jit' -> 'pmap'" in caplog.text
  assert 'device_count: 8 -> 4' in caplog.text

  bigger_vocab = _config(text_dir, model__vocab_size=512)
  job = job_lib.build_job(bigger_vocab)
  with pytest.raises(UserError, match='different model .*model.vocab_size: checkpoint 256 vs config 512'):
    checkpoint.Checkpointer(str(tmp_path), config.ckpt).check_compatible(
        7, manifests.run_manifest(bigger_vocab, job.abstract, job.mesh))

  lion = _config(text_dir, train__optimizer='lion')
  job = job_lib.build_job(lion)
  with pytest.raises(UserError, match=r"trained with train.optimizer='adamw', not 'lion': resume with "
                                      r"--config.train.optimizer=adamw"):
    checkpoint.Checkpointer(str(tmp_path), config.ckpt).check_compatible(
        7, manifests.run_manifest(lion, job.abstract, job.mesh))


def test_keep_period_keeps_old_multiples_beyond_max_to_keep(tmp_path, text_dir):
  config = _config(text_dir, ckpt__max_to_keep=2, ckpt__keep_period=4, ckpt__every_steps=1, ckpt__async_save=False)
  _save(tmp_path, config, steps=(2, 3, 4, 5, 6, 7, 8, 9))
  assert sorted(int(p.name) for p in (tmp_path / 'checkpoints').iterdir()) == [4, 8, 9]
  bad = _config(text_dir, ckpt__keep_period=-1)
  with pytest.raises(UserError, match='ckpt.keep_period=-1'):
    checkpoint.Checkpointer(str(tmp_path / 'x'), bad.ckpt)


TWO_PROCESS_SAVER = '''
import sys
sys.path.insert(0, {repo!r})
from parallel import distributed
distributed.initialize('127.0.0.1:{port}', 2, int(sys.argv[1]), 120)
import jax
from configs import tiny
from trainer import data
from trainer.run import job as job_lib
from trainer.training import checkpoint
from trainer.training import manifest as manifests
config = tiny.get_config()
config.data.text_dir = {text_dir!r}
config.mesh.data, config.mesh.fsdp = 1, 8  # (1, 8, 1) over 2 processes x 4 devices: each holds only its shards.
job = job_lib.build_job(config)
state = job.init_state(5)
iterator = data.train_iterator_for(config, jax.process_index(), 2)
ckpt = checkpoint.Checkpointer({workdir!r}, config.ckpt)
ckpt.save(5, state, iterator, manifests.run_manifest(config, job.abstract, job.mesh), force=True)
ckpt.close()
'''


def test_a_two_process_save_restores_its_state_in_one_process(tmp_path, text_dir):
  """State only, through the Checkpointer (the data position is per process; see check_compatible)."""
  script = TWO_PROCESS_SAVER.format(repo=str(REPO), port=free_port(), text_dir=str(text_dir),
                                    workdir=str(tmp_path))
  env = {**os.environ, 'XLA_FLAGS': xla_flags(4), 'JAX_PLATFORMS': 'cpu'}
  procs = [subprocess.Popen([sys.executable, '-c', script, str(i)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True) for i in (0, 1)]
  try:
    outputs = [p.communicate(timeout=600)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  assert [p.returncode for p in procs] == [0, 0], '\n'.join(o[-2000:] for o in outputs)
  state_dir = tmp_path / 'checkpoints' / '5' / 'state'
  assert {p.name for p in state_dir.glob('ocdbt.process_*')} == {'ocdbt.process_0', 'ocdbt.process_1'}

  for count in (8, 1):
    config = _config(text_dir)
    job = job_lib.build_job(config, jax.devices()[:count])
    restored = checkpoint.Checkpointer(str(tmp_path), config.ckpt).restore_state(
        5, sharding.with_shardings(job.abstract, job.shardings))
    # The same seed on one process gives the same values (jax's RNG does not depend on the layout).
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(job.init_state(5)))
    for leaf, target in zip(jax.tree.leaves(restored), jax.tree.leaves(job.shardings)):
      assert leaf.sharding.is_equivalent_to(target, leaf.ndim)


def test_the_copy_a_cpu_save_writes_from_outlives_the_donated_state_and_compiles_nothing():
  mesh = jax.make_mesh((2, 4), ('data', 'fsdp'))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data', 'fsdp'))
  state = {'w': jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), spec),
           'step': jax.numpy.asarray(3, jax.numpy.int32),
           'rng': jax.random.key_data(jax.random.key(1)), 'bf16': jax.numpy.ones((5, 3), jax.numpy.bfloat16)}
  expected = jax.tree.map(np.asarray, state)
  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, *_, **__: compiles.append(name) if name == '/jax/core/compile/backend_compile_duration' else None)
  copy = checkpoint.detach(state)
  assert not compiles
  for name, leaf in state.items():
    assert copy[name].sharding == leaf.sharding and copy[name].dtype == leaf.dtype, name
    leaf.delete()  # What the next step's donation does to the state.
  for name, value in expected.items():
    np.testing.assert_array_equal(np.asarray(copy[name]), value)
