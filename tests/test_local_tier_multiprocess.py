"""The local checkpoint tier across a lost host (issue 58): scripts/launch_local.py, 2 processes x 4 CPU devices,
float32, ckpt.local_every_steps=2, ckpt.every_steps=50. Process 1 is killed (-9) at step 37; the relaunch resumes
at step 36 from the local tier with an uninterrupted run's losses to the bit; with process 1's local folder gone
(its host replaced) the same from process 0's copy of its shards; with process 0's copy gone too, one line and
the persistent tier (nothing there yet: step 0), the same losses. One killed run serves all three relaunches: its
workdir and local folders are kept aside and put back before each."""

import pathlib
import re
import shutil
import sys

import pytest

from conftest import REPO, launcher_env, make_text_dir, read_metrics, run_python

STEPS = 38


def _launch(workdir: pathlib.Path, local: pathlib.Path, text_dir: pathlib.Path, **env: str):
  return run_python([sys.executable, str(REPO / 'scripts' / 'launch_local.py'), '--num_processes=2',
                     '--devices_per_process=4', '--timeout_s=500', '--config=configs/tiny.py', f'--workdir={workdir}',
                     f'--config.train.steps={STEPS}', '--config.train.compute_dtype=float32',
                     f'--config.ckpt.local_dir={local}', '--config.ckpt.local_every_steps=2',
                     '--config.ckpt.every_steps=50', '--config.log.every_steps=1',
                     '--config.mesh.data=1', '--config.mesh.fsdp=8',  # Each process holds its own shards: a real copy.
                     f'--config.data.text_dir={text_dir}'], env=launcher_env(**env), timeout=600)


def _losses(workdir: pathlib.Path) -> dict[int, float]:
  return {r['step']: r['loss'] for r in read_metrics(workdir) if 'loss' in r}  # A step logged twice: the later.


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp('local_tier')
  text_dir = make_text_dir((root / 'text').mkdir() or root / 'text')
  reference = _launch(root / 'reference', root / 'reference_shm', text_dir)
  assert reference.returncode == 0, reference.stderr[-3000:]
  workdir, local = root / 'run', root / 'shm'
  killed = _launch(workdir, local, text_dir, LAUNCH_TEST_FAULT='kill@37,process=1')
  assert killed.returncode == 137, killed.stderr[-3000:]
  assert 'could not be written' not in reference.stderr + killed.stderr  # The tier was on all along.
  [run_folder] = local.iterdir()
  assert sorted(int(p.name) for p in (run_folder / 'process-1-of-2').iterdir() if p.name.isdigit()) == [34, 36]
  shutil.copytree(workdir, root / 'kept_run', symlinks=True)
  shutil.copytree(local, root / 'kept_shm', symlinks=True)

  def relaunch(lose=()):
    """Puts the killed run back, deletes the `lose` process folders (host 1's, host 0's copy...), relaunches."""
    for path, kept in ((workdir, root / 'kept_run'), (local, root / 'kept_shm')):
      shutil.rmtree(path, ignore_errors=True)
      shutil.copytree(kept, path, symlinks=True)
    for name in lose:
      shutil.rmtree(run_folder / name)
    return _launch(workdir, local, text_dir)
  return _losses(root / 'reference'), workdir, relaunch


def _resumed_line(stderr: str) -> str:
  [line] = [l for l in stderr.splitlines() if re.match(r'\[0\] .*Resuming from the local tier', l)]
  return line


def test_a_killed_host_resumes_at_step_36_from_the_local_tier_with_the_same_losses(runs):
  reference, workdir, relaunch = runs
  result = relaunch()
  assert result.returncode == 0, result.stderr[-3000:]
  line = _resumed_line(result.stderr)
  assert 'Resuming from the local tier at step 36' in line and "persistent tier's none" in line, line
  assert 'every process from its own folder' in line, line
  assert sorted(_losses(workdir)) == list(range(1, STEPS + 1))
  assert _losses(workdir) == reference  # To the bit: steps 1-36 of the killed run, 37-38 resumed.


def test_a_replaced_host_takes_its_shards_from_its_peers_copy_with_the_same_losses(runs):
  reference, workdir, relaunch = runs
  result = relaunch(lose=['process-1-of-2'])
  assert result.returncode == 0, result.stderr[-3000:]
  line = _resumed_line(result.stderr)
  assert 'Resuming from the local tier at step 36' in line, line
  assert "process(es) [1] from their peer's copy (their own folder lacks it)" in line, line
  assert _losses(workdir) == reference


def test_a_lost_host_whose_peer_copy_is_lost_too_is_one_line_and_the_persistent_tier(runs):
  reference, workdir, relaunch = runs
  result = relaunch(lose=['process-1-of-2', 'process-0-of-2'])  # Both hosts replaced: no copy of 1's shards left.
  assert result.returncode == 0, result.stderr[-3000:]
  [said] = [l for l in result.stderr.splitlines() if l.startswith('[0] ') and 'the local tier holds no' in l]
  assert said.endswith(  # The persistent tier has no step before 50: nothing lost.
      f"Training from step 0: the local tier holds no step, and the persistent tier ({workdir / 'checkpoints'}) has "
      f'none.'), said
  assert _losses(workdir) == reference
