"""One launch per workdir (trainer/safety/lock.py): refused while held, taken over from a dead or silent holder."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_python
from trainer.base.errors import UserError
from trainer.safety import lock

HOLDER = f'''
import sys, time
sys.path.insert(0, {str(REPO)!r})
from trainer.safety import lock
lock.acquire(sys.argv[1])
print('held', flush=True)
time.sleep(600)
'''


def _hold(workdir) -> subprocess.Popen:
  """A real process holding WORKDIR/launch.lock until killed."""
  proc = subprocess.Popen([sys.executable, '-c', HOLDER, str(workdir)], stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == 'held'
  return proc


def test_a_held_workdir_is_refused_naming_the_holder_then_free_once_released(tmp_path):
  held = lock.acquire(tmp_path)
  with pytest.raises(UserError) as refused:
    lock.acquire(tmp_path)  # flock is per open file: a second open in the same process contends too.
  assert re.match(rf'--workdir={tmp_path} is in use by another launch \(pid {os.getpid()} on host '
                  rf'{re.escape(socket.gethostname())}, running since \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ: ',
                  str(refused.value)), refused.value
  held.release()
  assert (tmp_path / 'launch.lock').read_text() == ''  # Cleared, not deleted.
  lock.acquire(tmp_path).release()


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path, caplog):
  proc = _hold(tmp_path)
  with pytest.raises(UserError, match=f'pid {proc.pid} on host'):
    lock.acquire(tmp_path)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert json.loads((tmp_path / 'launch.lock').read_text())['pid'] == proc.pid  # Left behind by kill -9.
  taken = lock.acquire(tmp_path)
  assert f'took over the lock of an earlier launch (pid {proc.pid}' in caplog.text
  assert f'process {proc.pid} is gone' in caplog.text
  assert json.loads((tmp_path / 'launch.lock').read_text())['pid'] == os.getpid()
  taken.release()


def test_another_hosts_lock_is_live_until_its_heartbeat_is_stale(tmp_path, caplog):
  path = tmp_path / 'launch.lock'
  path.write_text(json.dumps({'host': 'node-7', 'pid': 4242, 'since': '2026-11-22T10:00:00Z', 'command': 'x'}))
  with pytest.raises(UserError, match=r'pid 4242 on host node-7, running since 2026-11-22T10:00:00Z: x\).*last '
                                      r'heartbeat was \d+s ago'):
    lock.acquire(tmp_path)  # flock is free here (another host's flock is not visible), the heartbeat is fresh.
  old = time.time() - lock.STALE_AFTER_S - 5
  os.utime(path, (old, old))
  lock.acquire(tmp_path).release()
  assert 'no heartbeat for 12' in caplog.text


def test_a_second_launch_and_start_over_stop_before_compiling_and_touch_nothing(tmp_path):
  (tmp_path / 'metrics.jsonl').write_text('{"step": 1}\n')  # A live run's files, which --start_over would move.
  (tmp_path / 'checkpoints').mkdir()
  proc = _hold(tmp_path)
  try:
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_python([sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py',
                         f'--workdir={tmp_path}', '--start_over'],
                        timeout=600)  # A hang guard; 'Compiled' below shows it was early.
  finally:
    proc.kill()
    proc.wait()
  assert result.returncode == 2, result.stderr[-3000:]
  [line] = [l for l in result.stderr.splitlines() if l.startswith('launch.py: error:')]
  assert f'is in use by another launch (pid {proc.pid} on host {socket.gethostname()}, running since' in line
  assert 'Traceback' not in result.stderr and 'Compiled' not in result.stderr
  assert sorted(p.name for p in tmp_path.iterdir()) == before
