"""Profiling sessions: a trace window and SIGUSR1 through real launch.py runs; the rest in-process.

A run without a window leaving no trace is checked in tests/test_tensorboard.py,
on the run it starts TensorBoard against.
"""

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import jax
import pytest

from configs import tiny
from conftest import launcher_env
from trainer.base.errors import UserError
from trainer.observe import profiling

TINY = '--config=configs/tiny.py'
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _traces(workdir) -> list:
  return sorted((workdir / 'plugins' / 'profile').glob('*/*.xplane.pb'))


def test_trace_window_leaves_an_xplane_under_the_profile_plugin_folder(launcher, tmp_path):
  result = launcher(TINY, f'--workdir={tmp_path}', '--config.profile.trace_window=True',
                    '--config.profile.start_step=3', '--config.profile.num_steps=2', '--config.train.steps=6',
                    '--config.ckpt.every_steps=100', '--config.log.progress_bar=on')
  assert result.returncode == 0, result.stderr[-3000:]
  # The bar, forced on though stderr is a pipe (text mode reads its \r as a newline).
  assert '\x1b[K[========================] 100% step 6/6 | loss ' in result.stderr
  traces = _traces(tmp_path)
  assert len(traces) == 1 and traces[0].stat().st_size > 1000
  assert 'Profiling steps 3..4 (profile.trace_window)' in result.stderr
  assert 'Trace written under' in result.stderr
  # Writing the trace out is counted apart, not as step time.
  goodput = json.loads((tmp_path / 'goodput.jsonl').read_text().splitlines()[-1])
  assert goodput['profiling_s'] > 0


def _read_lines(stream, lines: queue.Queue) -> None:
  for line in stream:
    lines.put(line)


# launch.py, except that step 1 waits until SIGUSR1 has arrived: the signal lands mid-run by construction (a fast
# machine could otherwise finish all 30 steps before it).
_HELD_FOR_SIGUSR1 = f'''
import runpy, sys, time
sys.path.insert(0, {str(REPO)!r})
from trainer.observe import profiling
step = profiling.Profiler.step

def held(self, n, state):
  deadline = time.monotonic() + 600
  while n == 1 and not self._requested.is_set() and time.monotonic() < deadline:
    time.sleep(0.01)
  return step(self, n, state)

profiling.Profiler.step = held
sys.argv = [{os.path.join(REPO, 'launch.py')!r}] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')
'''


def test_sigusr1_traces_the_next_steps_of_a_running_job(tmp_path):
  command = [sys.executable, '-c', _HELD_FOR_SIGUSR1, TINY, f'--workdir={tmp_path}',
             '--config.train.steps=30', '--config.profile.num_steps=3', '--config.ckpt.every_steps=1000',
             '--config.log.every_steps=1000']
  job = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                         env=launcher_env())
  lines, seen = queue.Queue(), []
  threading.Thread(target=_read_lines, args=(job.stderr, lines), daemon=True).start()
  try:
    deadline = time.monotonic() + 600
    while not any('kill -USR1' in line for line in seen):  # The handler is installed before step 1.
      seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.1)))
    assert not _traces(tmp_path)
    job.send_signal(signal.SIGUSR1)
    assert job.wait(timeout=max(deadline - time.monotonic(), 1)) == 0
  finally:
    job.kill()
  while not lines.empty():
    seen.append(lines.get())
  log = ''.join(seen)
  started = [line for line in seen if '(SIGUSR1)' in line]
  assert len(started) == 1, log[-3000:]
  first, last = map(int, started[0].split('Profiling steps ')[1].split(' ')[0].split('..'))
  assert (first, last) == (1, 3)  # From the step that waited for the signal.
  assert len(_traces(tmp_path)) == 1
  assert 'step 30/30' in log  # The job went on to the end.


def _profile(**overrides):
  profile = tiny.get_config().profile
  for key, value in overrides.items():
    profile[key] = value
  return profile


class _Recorder:
  """Stands in for jax.profiler's start_trace/stop_trace to see which steps a trace spans."""

  def __init__(self, monkeypatch):
    self.calls = []
    monkeypatch.setattr(jax.profiler, 'start_trace', lambda log_dir: self.calls.append(('start', log_dir)))
    monkeypatch.setattr(jax.profiler, 'stop_trace', lambda: self.calls.append(('stop',)))

  def steps(self, profiler, first, last) -> list:
    """Runs steps first..last; returns (step, what happened before it)."""
    happened = []
    for step in range(first, last + 1):
      before = len(self.calls)
      profiler.step(step, state=None)
      happened += [(step, call[0]) for call in self.calls[before:]]
    profiler.close()
    return happened


def test_window_starts_at_start_step_and_stops_after_num_steps(tmp_path, monkeypatch):
  recorder = _Recorder(monkeypatch)
  profiler = profiling.Profiler(_profile(trace_window=True, start_step=4, num_steps=3), str(tmp_path), 1, 20)
  assert recorder.steps(profiler, 1, 20) == [(4, 'start'), (7, 'stop')]
  assert recorder.calls[0] == ('start', str(tmp_path))


def test_window_reaching_the_last_step_is_closed_and_a_passed_window_is_skipped(tmp_path, monkeypatch):
  recorder = _Recorder(monkeypatch)
  profiler = profiling.Profiler(_profile(trace_window=True, start_step=9, num_steps=5), str(tmp_path), 1, 10)
  assert recorder.steps(profiler, 1, 10) == [(9, 'start')]
  assert recorder.calls[-1] == ('stop',)  # By close(), at the end of the run.
  recorder.calls.clear()
  resumed = profiling.Profiler(_profile(trace_window=True, start_step=3, num_steps=2), str(tmp_path), 11, 20)
  assert recorder.steps(resumed, 11, 20) == [] and recorder.calls == []


def test_no_window_by_default_and_signal_traces_num_steps_from_the_next_step(tmp_path, monkeypatch):
  recorder = _Recorder(monkeypatch)
  profiler = profiling.Profiler(_profile(num_steps=2), str(tmp_path), 1, 30)
  try:
    for step in range(1, 6):
      profiler.step(step, state=None)
    assert recorder.calls == []  # trace_window is off by default.
    os.kill(os.getpid(), signal.SIGUSR1)
    happened = recorder.steps(profiler, 6, 12)
  finally:
    profiler.close()
  assert happened == [(6, 'start'), (8, 'stop')]
  assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # Restored on close.


def test_profiler_server_listens_on_the_port_or_the_next_free_one(tmp_path, caplog):
  """One process per GPU puts several processes on a host: a taken port moves the server to the next free one."""
  with socket.socket(socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET) as taken:
    taken.bind(('::' if socket.has_ipv6 else '', 0))
    taken.listen()
    port = taken.getsockname()[1]
    with caplog.at_level('INFO'):
      profiler = profiling.Profiler(_profile(server_port=port), str(tmp_path), 1, 10)
    try:
      found = re.search(rf'Profiler server on port (\d+) \({port} was taken\)', caplog.text)
      assert found, caplog.text
      with socket.create_connection(('127.0.0.1', int(found.group(1))), timeout=10):
        pass
    finally:
      profiler.close()


def test_out_of_memory_saves_a_device_memory_profile(tmp_path):
  profiler = profiling.Profiler(_profile(), str(tmp_path), 1, 10)
  keep = jax.numpy.ones((256, 256))  # Something live on the devices.
  try:
    profiler.on_error(ValueError('shapes do not match'))
    assert not (tmp_path / 'memory_profiles').exists()
    profiler.on_error(RuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.'))
  finally:
    profiler.close()
  saved = list((tmp_path / 'memory_profiles').glob('oom-*.prof'))
  assert len(saved) == 1 and saved[0].read_bytes()[:2] == b'\x1f\x8b'  # pprof: a gzipped profile proto.
  del keep
  off = profiling.Profiler(_profile(memory_on_oom=False), str(tmp_path / 'off'), 1, 10)
  off.on_error(RuntimeError('RESOURCE_EXHAUSTED: Out of memory'))
  off.close()
  assert not (tmp_path / 'off').exists()


@pytest.mark.parametrize('key,value,message', [
    ('num_steps', 0, 'profile.num_steps=0: a trace needs at least 1 step'),
    ('start_step', 0, 'profile.start_step=0: steps count from 1'),
    ('server_port', 70000, 'profile.server_port=70000: expected a TCP port'),
])
def test_bad_profile_settings_name_the_key(key, value, message):
  with pytest.raises(UserError, match=message):
    profiling.check_config(_profile(**{key: value}))


def test_bad_profile_setting_stops_the_launch_before_compiling(launcher, tmp_path):
  result = launcher(TINY, f'--workdir={tmp_path}', '--config.profile.num_steps=0', timeout=600)
  assert result.returncode == 2
  assert 'launch.py: error: profile.num_steps=0 must be an integer >= 1' in result.stderr  # Before anything starts.
  assert 'Compiled the train step' not in result.stderr


def test_out_of_memory_in_the_loop_leaves_a_memory_profile_and_the_error(tmp_path, monkeypatch):
  """The loop's wiring: an out-of-memory error mid-run reaches the profiler, then the caller as one line (exit 2)."""
  from trainer.run import loop
  from trainer.observe import metrics
  from trainer.base.errors import UserError

  def out_of_memory_at_step_3(self, step, *args):
    if step == 3:
      raise RuntimeError('RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.00GiB.')

  monkeypatch.setattr(metrics.MetricsWriter, 'step_done', out_of_memory_at_step_3)
  with pytest.raises(UserError, match='out of memory while training: the device was asked for one allocation of '
                     '2.00 GiB') as raised:
    loop.run(tiny.get_config(), str(tmp_path), devices=jax.devices()[:2])
  assert 'RESOURCE_EXHAUSTED' in str(raised.value.__context__)  # XLA's own error stays chained for the log.
  assert len(list((tmp_path / 'memory_profiles').glob('oom-*.prof'))) == 1
  assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
