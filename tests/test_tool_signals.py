"""The tools of scripts/ and launch.py as processes: --help, the wrong interpreter, stop signals in each phase,
outputs written whole, launch_local.py's processes ending with it, and the supervisor's record of a stop it received.

Signals go to real processes (tests/conftest.py `watch_command`), each sent on the stderr line of the phase it tests.
"""

import fcntl
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, launcher_env, run_python, tiny_checkpoint, watch_command

TOOLS = ['scripts/eval.py', 'scripts/sample.py', 'scripts/export_hf.py', 'scripts/export_params.py',
         'scripts/launch_local.py', 'scripts/prepare_data.py', 'launch.py']


@pytest.mark.parametrize('flag', ['--help', '-h'])
@pytest.mark.parametrize('tool', TOOLS)
def test_help_prints_the_usage_and_exits_0(tool, flag):
  result = run_python([sys.executable, str(REPO / tool), flag], timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  first_line = (REPO / tool).read_text().split('"""')[1].splitlines()[0]
  assert first_line[:40] in result.stdout and '--' in result.stdout, result.stdout[:2000]


@pytest.mark.parametrize('tool', [t for t in TOOLS if 'prepare_data' not in t])
def test_an_interpreter_without_the_packages_is_told_to_use_the_venv_in_one_line(tool):
  # -S: no site-packages, as the system python3 has none of the project's packages.
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
  result = subprocess.run([sys.executable, '-S', str(REPO / tool), '--help'], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
  assert lines[0].startswith(f'{pathlib.Path(tool).name}: error: ') and '.venv/bin/python' in lines[0]


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  """configs/tiny.py trained 2 steps, checkpointed at step 2: the file's one training run."""
  return tiny_checkpoint(tmp_path_factory.mktemp('tools'))


def _only_line(stderr: str) -> str:
  """The one line a stopped tool printed, past the import-time lines `-X importtime` adds."""
  lines = [l for l in stderr.splitlines() if l.strip() and not l.startswith('import time:')]
  assert len(lines) == 1 and 'Traceback' not in stderr, stderr[-3000:]
  return lines[0]


@pytest.mark.parametrize('tool, args, signum', [
    ('sample.py', ['--num_tokens=1'], signal.SIGHUP),
    ('eval.py', ['--tasks=never-read.jsonl'], signal.SIGTERM),  # jax is imported before the tasks are read.
    ('export_params.py', ['--config=configs/tiny.py', '--output=OUT'], signal.SIGINT),
])
def test_a_signal_while_a_tool_imports_jax_is_one_line_and_128_plus_it(workdir, tmp_path, tool, args, signum):
  args = [a.replace('OUT', str(tmp_path / 'out')) for a in args]
  sent = []

  def on_line(proc, line):
    if not sent and line.startswith('import time:') and 'jax._src' in line:  # Halfway through importing jax.
      sent.append(os.kill(proc.pid, signum))

  result, _ = watch_command([sys.executable, '-X', 'importtime', f'scripts/{tool}', f'--workdir={workdir}', *args],
                            launcher_env(), on_line, timeout=120)
  assert sent and result.returncode == 128 + signum, result.stderr[-3000:]
  what = 'Ctrl-C (SIGINT)' if signum == signal.SIGINT else signal.Signals(signum).name
  assert _only_line(result.stderr).startswith(f'{tool}: interrupted: {what} received: stopped (exit {128 + signum})')
  assert not (tmp_path / 'out').exists()


_SLOW_WRITE = '''
import runpy, sys, time
from trainer.hf import save
written = save.export
def export(*args, **kwargs):  # Every file written, the folder not yet renamed: the tool is in its writing phase.
  names = written(*args, **kwargs)
  print('written, not renamed', file=sys.stderr, flush=True)
  time.sleep(60)
  return names
save.export = export
sys.argv = ['scripts/export_hf.py', *sys.argv[1:]]
runpy.run_path('scripts/export_hf.py', run_name='__main__')
'''


def test_a_stopped_export_leaves_no_output_and_the_same_command_then_works(workdir, tmp_path):
  out = tmp_path / 'hf'
  command = [sys.executable, '-c', _SLOW_WRITE, f'--workdir={workdir}', f'--output={out}']
  stop = lambda signum: lambda proc, line: 'not renamed' in line and os.kill(proc.pid, signum)  # noqa: E731
  stopped, _ = watch_command(command, launcher_env(), stop(signal.SIGINT), timeout=120)
  assert stopped.returncode == 130, stopped.stderr[-3000:]
  line = [l for l in stopped.stderr.splitlines() if 'interrupted' in l]
  assert line == ['export_hf.py: interrupted: Ctrl-C (SIGINT) received: stopped (exit 130). Nothing partial is left '
                  'under its output name; run the same command again.'] and 'Traceback' not in stopped.stderr
  assert sorted(os.listdir(tmp_path)) == []  # Its partial folder removed on the way out.
  killed, _ = watch_command(command, launcher_env(), stop(signal.SIGKILL), timeout=120)
  assert killed.returncode == -9 and not out.exists()
  assert [p.name.startswith('.hf.partial-') for p in tmp_path.iterdir()] == [True]  # What kill -9 leaves.
  again = run_python([sys.executable, 'scripts/export_hf.py', f'--workdir={workdir}', f'--output={out}'], timeout=300)
  assert again.returncode == 0, again.stderr[-3000:]
  assert os.listdir(tmp_path) == ['hf'] and (out / 'config.json').is_file()


@pytest.mark.parametrize('tool, args', [
    ('export_hf.py', []), ('export_params.py', ['--config=configs/tiny.py']), ('eval.py', ['--tasks=t.jsonl'])])
def test_an_output_that_is_a_symlink_is_refused_in_one_line(tool, args, tmp_path):
  link = tmp_path / 'out'
  link.symlink_to(tmp_path / 'nowhere')  # Dangling.
  result = run_python([sys.executable, f'scripts/{tool}', '--workdir=/nonexistent-54', f'--output={link}', *args],
                      timeout=120)
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
  assert lines[0].startswith(f"{tool}: error: --output={link} is a symbolic link (to {tmp_path / 'nowhere'})")
  assert not (tmp_path / 'nowhere').exists()


def _processes_with(text: str) -> list[int]:
  """The ids of live processes whose command line holds `text`."""
  pids = []
  for entry in pathlib.Path('/proc').iterdir():
    try:
      if entry.name.isdigit() and text in (entry / 'cmdline').read_bytes().decode(errors='replace'):
        pids.append(int(entry.name))
    except OSError:
      pass
  return pids


@pytest.mark.parametrize('signum', [signal.SIGKILL, signal.SIGTERM])
def test_launch_locals_processes_end_with_it(tmp_path, signum):
  run_dir = tmp_path / 'run'
  command = [sys.executable, 'scripts/launch_local.py', '--config=configs/tiny.py', f'--workdir={run_dir}',
             '--devices_per_process=2', '--config.train.steps=100000', '--config.data.source=synthetic']

  def on_line(proc, line):
    if 'Joined 2 processes' in line:  # Both launch.py supervisors and their training processes are up.
      os.kill(proc.pid, signum)

  result, _ = watch_command(command, launcher_env(), on_line, timeout=180)
  if signum == signal.SIGTERM:
    assert result.returncode == 143, result.stderr[-3000:]
    assert 'launch_local.py: interrupted: SIGTERM received: forwarded to every process' in result.stderr
  # Each process saves and stops on the parent-death SIGTERM: seconds alone, tens of them on a loaded 2-core machine.
  deadline = time.monotonic() + 120
  while _processes_with(str(run_dir)) and time.monotonic() < deadline:
    time.sleep(0.5)
  left = _processes_with(str(run_dir))
  for pid in left:  # Not left training headless past a failed test.
    os.kill(pid, signal.SIGKILL)
  assert left == [], result.stderr[-3000:]
  if (run_dir / 'launch.lock').exists():
    with open(run_dir / 'launch.lock') as f:
      fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # Raises if a process still held the workdir.


_CHILD = '''
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # As launch.py's training process stops before its loop.
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])  # Held back by the supervisor until the handler is in.
print('ready', file=sys.stderr, flush=True)
time.sleep(60)
'''
_SUPERVISED = '''
import sys
from trainer.supervision import supervisor
sys.exit(supervisor.Supervisor([sys.executable, '-c', sys.argv[2]], sys.argv[1], 3, 0.1, True).run())
'''


def test_the_attempt_record_of_a_sigterm_the_supervisor_received_says_so(tmp_path):
  on_line = lambda proc, line: line.startswith('ready') and os.kill(proc.pid, signal.SIGTERM)  # noqa: E731
  result, _ = watch_command([sys.executable, '-c', _SUPERVISED, str(tmp_path), _CHILD], launcher_env(), on_line,
                            timeout=60)
  assert result.returncode == 143, result.stderr
  [record] = [json.loads(l) for l in (tmp_path / 'attempts.jsonl').read_text().splitlines()]
  assert record['cause'] == ('stopped by SIGTERM, which the supervisor received and forwarded to the training '
                             'process; it stopped with it (exit 143)') and not record['retried']
