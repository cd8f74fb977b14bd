"""Storage faults as real processes (issue 39, item 3): a file-size limit hit by a save, zeroed OCDBT manifests.

Each is a supervised launch (--max_restarts=2): a fault no retry can fix must end in one line, exit 2, not retried,
with no traceback, no "Event loop is closed" echo and no shutdown noise after the line.
"""

import json
import resource
import subprocess
import sys

import pytest

from conftest import REPO, launcher_env, make_text_dir

NOISE = ('Traceback', 'Event loop is closed', 'Exception ignored', 'Fatal Python error', 'after a failed save')


@pytest.fixture(scope='module')
def text_dir(tmp_path_factory):
  return make_text_dir(tmp_path_factory.mktemp('text'))


def _launch(workdir, text_dir, *extra, preexec_fn=None, env=None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py', f'--workdir={workdir}',
                         f'--config.data.text_dir={text_dir}', '--max_restarts=2', '--restart_backoff_s=0', *extra],
                        cwd=REPO, env=env or launcher_env(), capture_output=True, text=True, timeout=300,
                        preexec_fn=preexec_fn)


def _cap_file_size():
  """`ulimit -f 64` in the launch's process (and its child): no file may grow past 64 KiB."""
  resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))


def test_a_file_size_limit_hit_by_a_save_is_one_line_exit_2_and_not_retried(text_dir, tmp_path):
  # The shared compile cache would hit the same limit with its own (harmless) warnings: this launch has none.
  env = {k: v for k, v in launcher_env().items() if not k.startswith('JAX_COMPILATION_CACHE')}
  result = _launch(tmp_path, text_dir, preexec_fn=_cap_file_size, env=env)
  assert result.returncode == 2, result.stderr[-3000:]
  for noise in NOISE:
    assert noise not in result.stderr, result.stderr[-3000:]
  [line] = [l for l in result.stderr.splitlines() if l.startswith('launch.py: ')]
  assert line.startswith('launch.py: error: could not save step 4 to ') and 'ulimit -f' in line, line
  [record] = [json.loads(l) for l in (tmp_path / 'attempts.jsonl').read_text().splitlines()]
  assert (record['exit_code'], record['retried']) == (2, False)
  assert not [p for p in (tmp_path / 'checkpoints').iterdir() if p.name.isdigit()]  # Nothing passed off as complete.


def test_zeroed_ocdbt_manifests_are_recovered_from_without_event_loop_noise(text_dir, tmp_path):
  first = _launch(tmp_path, text_dir)
  assert first.returncode == 0, first.stderr[-3000:]
  zeroed = [p for p in (tmp_path / 'checkpoints' / '8').rglob('manifest.ocdbt')]
  assert zeroed
  for manifest in zeroed:
    manifest.write_bytes(bytes(manifest.stat().st_size))
  again = _launch(tmp_path, text_dir)
  assert again.returncode == 0, again.stderr[-3000:]
  for noise in NOISE:
    assert noise not in again.stderr, again.stderr[-3000:]
  assert 'Resuming from checkpoint at step 4' in again.stderr
  assert sorted(int(p.name) for p in (tmp_path / 'checkpoints').iterdir()) == [4, 8]
  assert len(list((tmp_path / 'damaged_checkpoints').iterdir())) == 1  # Step 8 kept aside, never deleted.
