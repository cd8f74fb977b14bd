"""Processes of one run stop together on a signal outside the step loop, each naming it (trainer/safety/startup_signals.py
over parallel/watchdog.py's connections), and a supervisor waits for its own signal before it restarts such a child.

A group-wide preemption reaches the hosts a little apart. Before, a process whose own SIGTERM was still on its way
when the first one stopped called that one lost (exit 75), which run 12 and run 17 of the suite met under load. Here
only one process of three gets the signal: the others must stop with its code and a line naming it, never a loss.
These processes load no jax: the watchdog and the signal handling are all that is under test.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import REPO, free_port
from parallel import watchdog
from trainer.supervision import supervisor

TIMEOUT_S = 60  # A hang guard only.

PROCESS = r'''
import socket, sys, time
from trainer.safety import startup_signals
from parallel import watchdog
startup_signals.install_early()
process, num_processes, port = map(int, sys.argv[1:])
if process == 0:
  server = socket.create_server(('127.0.0.1', port))
  print('listening', flush=True)
  watchdog.serve(server, num_processes, 30)
else:
  watchdog.join('127.0.0.1', port, process, num_processes, 30)
print('joined', flush=True)
time.sleep(600)  # Where a compile would be.
'''


def _start(process: int, port: int) -> subprocess.Popen:
  proc = subprocess.Popen([sys.executable, '-c', PROCESS, str(process), '3', str(port)], cwd=REPO,
                          env={**os.environ, 'PYTHONPATH': str(REPO)}, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  return proc


@pytest.mark.parametrize('signalled', [0, 1])
def test_one_process_stopping_on_sigterm_stops_the_others_naming_it(signalled):
  port = free_port()
  procs = [_start(0, port)]
  try:
    assert procs[0].stdout.readline() == 'listening\n', procs[0].stderr.read()
    procs += [_start(1, port), _start(2, port)]
    for proc in procs[1:] + procs[:1]:
      assert proc.stdout.readline() == 'joined\n', proc.stderr.read()
    os.kill(procs[signalled].pid, signal.SIGTERM)
    sent = time.monotonic()
    for proc in procs:
      proc.wait(timeout=TIMEOUT_S)
    elapsed = time.monotonic() - sent
  finally:
    for proc in procs:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
  who = 'process 0 (the coordinator)' if signalled == 0 else f'process {signalled}'
  for i, proc in enumerate(procs):
    err = proc.stderr.read()
    assert proc.returncode == 143, (i, err)
    [line] = err.splitlines()
    where = 'SIGTERM received outside the step loop (while starting, compiling or closing)'
    if i == signalled:
      assert line.startswith(f'launch.py: interrupted: {where}: stopped. No step of this launch'), line
    else:
      assert line.startswith(f'launch.py: interrupted: {where} by {who} of 3: this process stopped with it. '
                             f'No step of this launch'), (i, line)
  assert elapsed < 10  # At once: not the watchdog's SILENT_AFTER_S (20 s) nor a timeout.
  assert watchdog.SILENT_AFTER_S >= 20


def _child_exiting(code: int) -> list[str]:
  return [sys.executable, '-c', f'import os; os._exit({code})']


def test_a_supervisor_waits_for_its_own_stop_signal_before_restarting_a_child_that_stopped_with_a_peer():
  run = supervisor.Supervisor(_child_exiting(143), '/tmp/unused', max_restarts=3, backoff_s=0, writes_record=False)
  # This host's SIGTERM comes a second after its child stopped with a peer; handed to the handler directly, so no
  # real signal can reach pytest after run() restored its handlers.
  threading.Timer(1.0, run._on_signal, (signal.SIGTERM, None)).start()  # pylint: disable=protected-access
  assert run.run() == 143
  assert [(r['attempt'], r['retried']) for r in run.records] == [(1, False)], run.records
  assert run.records[0]['cause'].startswith('stopped by SIGTERM'), run.records


def test_without_its_own_signal_the_supervisor_restarts_after_the_grace(monkeypatch, capfd):
  monkeypatch.setattr(supervisor, '_PEER_STOP_GRACE_S', 0.2)
  run = supervisor.Supervisor(_child_exiting(143), '/tmp/unused', max_restarts=1, backoff_s=0, writes_record=False)
  started = time.monotonic()
  assert run.run() == 143
  assert time.monotonic() - started >= 0.4  # The grace after each of the two attempts.
  assert [(r['attempt'], r['retried']) for r in run.records] == [(1, True), (2, False)], run.records
  assert ('attempt 1 ended with SIGTERM that reached the child or a peer, not this supervisor (exit 143); '
          'restarting') in capfd.readouterr().err


def test_a_child_stopped_by_ctrl_c_is_never_retried_so_the_supervisor_does_not_wait():
  run = supervisor.Supervisor(_child_exiting(130), '/tmp/unused', max_restarts=3, backoff_s=0, writes_record=False)
  started = time.monotonic()
  assert run.run() == 130
  assert time.monotonic() - started < supervisor._PEER_STOP_GRACE_S  # pylint: disable=protected-access
  assert [(r['attempt'], r['retried'], r['cause']) for r in run.records] == [(1, False, 'interrupted (Ctrl-C)')]
