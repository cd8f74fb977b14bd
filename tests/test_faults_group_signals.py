"""SIGTERM to a 2-process run (scripts/launch_local.py, 2 x 4 CPU devices), outside and inside the step loop (issue 39).

Once jax.distributed is up, jax's preemption service owns SIGTERM; outside the step loop the launcher takes it
back (trainer/safety/sigterm_handoff.py). Before, a SIGTERM while the processes compiled was held until step 1, which
each process saved before exiting 0 about 20 s later. Inside the loop jax's sync point must still bring every
process to one save step. The signal goes to each process's launch.py supervisor, which forwards it, as a
scheduler's or a user's `kill` would. A `sitecustomize` hook holds the compile (or the final eval) open in each
training process and prints a marker, so the signal lands after the join and before the loop (or after its last
check) by construction, on any machine. A one-process check shows the handoff itself: after jax's join a SIGTERM
reaches the launcher's handler, inside the loop jax's sync point, after the loop the final handler.
"""

import os
import pathlib
import re
import signal
import sys

import pytest

from conftest import REPO, free_port, launcher_env, make_text_dir, run_python, watch_command

TIMEOUT_S = 400  # A hang guard only.

HOLD = r'''
import importlib.abc, importlib.util, os, signal, sys, time

_where = os.environ.get('TEST_HOLD')
_patched = {'compile': ('trainer.run.preflight', 'compile_checked'), 'final_eval': ('trainer.run.evaluation', 'held_out')}


def _signal_taken():
  # During the final eval: the step loop's PreemptionWatch holds SIGTERM and has seen it.
  handler = signal.getsignal(signal.SIGTERM)
  return getattr(getattr(handler, '__self__', None), 'unanswered', lambda: None)() is not None


def _hold(original):
  def held(*args):
    print(f'held {_where} in pid {os.getpid()}', file=sys.stderr, flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (_where == 'final_eval' and _signal_taken()):
      time.sleep(0.05)  # Python-level waiting: a handler runs here at once. Ending here is the handler's doing.
    return original(*args)
  return held


class _Finder(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    module_name, function = _patched[_where]
    if name != module_name:
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    execute = spec.loader.exec_module
    def exec_module(module):
      execute(module)
      setattr(module, function, _hold(getattr(module, function)))
    spec.loader.exec_module = exec_module
    return spec


if _where:
  sys.meta_path.insert(0, _Finder())
'''


@pytest.fixture(scope='module')
def text_dir(tmp_path_factory):
  return make_text_dir(tmp_path_factory.mktemp('text'))


def _supervisors(launcher_pid: int) -> list[int]:
  """The launch.py (supervisor) of each process under launch_local.py."""
  return [int(c) for c in pathlib.Path(f'/proc/{launcher_pid}/task/{launcher_pid}/children').read_text().split()]


def _launch_local(workdir, text_dir, on_line, env, *extra):
  """launch_local.py 2 x 4 under a hang guard, each launch.py supervised (one restart allowed: none may happen)."""
  return watch_command(
      [sys.executable, str(REPO / 'scripts' / 'launch_local.py'), '--num_processes=2', '--devices_per_process=4',
       '--config=configs/tiny.py', f'--workdir={workdir}', f'--config.data.text_dir={text_dir}',
       '--config.log.every_steps=1', '--max_restarts=1', '--restart_backoff_s=0', *extra],
      env, on_line, TIMEOUT_S)[0]


@pytest.fixture(scope='module')
def hook_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp('hold_hook')
  (folder / 'sitecustomize.py').write_text(HOLD)
  return folder


def _held_launch(workdir, text_dir, hook_dir, where, *extra, sig=signal.SIGTERM):
  """A 2-process launch with `where` held in both training processes; `sig` to both supervisors once both hold."""
  held, sent = set(), []

  def on_line(proc, line):
    marker = re.match(rf'\[(\d)\] held {where} in pid', line)
    if marker:
      held.add(marker.group(1))
    if held == {'0', '1'} and not sent:
      sent.append(line)
      for pid in _supervisors(proc.pid):
        os.kill(pid, sig)

  env = launcher_env(TEST_HOLD=where, PYTHONPATH=os.pathsep.join([str(hook_dir), str(REPO)]))
  result = _launch_local(workdir, text_dir, on_line, env, *extra)
  assert sent, result.stderr[-3000:]
  return result


def _one_line_each(result, code: int = 143) -> list[str]:
  """Each process's own line (what is not a log record, a marker or launch_local's), asserted to be one."""
  ours = []
  for process in (0, 1):
    lines = [l for l in result.stderr.splitlines() if l.startswith(f'[{process}] ')
             and not re.match(r'\[\d\] ([IWE]\d{4} |held | )', l)]  # ' ': a record's later lines.
    assert len(lines) == 1, lines
    ours.append(lines[0])
  # Each ended on its own (launch_local stopped neither).
  assert result.stderr.splitlines()[-1] == f'launch_local.py: error: process 0 exited with code {code}.', result.stderr
  for noise in ('Traceback', 'Fatal Python error', 'Aborted'):
    assert noise not in result.stderr, result.stderr[-3000:]
  return ours


def test_sigterm_while_both_processes_compile_ends_each_in_one_line_with_143(text_dir, hook_dir, tmp_path):
  workdir = tmp_path / 'run'
  result = _held_launch(workdir, text_dir, hook_dir, 'compile')
  assert result.returncode == 143, result.stderr[-3000:]
  for line in _one_line_each(result):
    assert 'launch.py: interrupted: SIGTERM received outside the step loop' in line, line
  assert 'saved step' not in result.stderr  # Not held until a first step was saved, as jax's service did.
  assert not list(workdir.glob('checkpoints/*'))


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_during_the_final_eval_of_both_processes_says_what_was_kept(text_dir, hook_dir, tmp_path, sig):
  workdir = tmp_path / 'run'
  result = _held_launch(workdir, text_dir, hook_dir, 'final_eval', '--config.train.steps=4',
                        '--config.ckpt.every_steps=2', sig=sig)
  assert result.returncode == 128 + sig, result.stderr[-3000:]
  for line in _one_line_each(result, 128 + sig):
    assert line.endswith(f'launch.py: interrupted: {sig.name} received outside the step loop (while starting, '
                         f'compiling or closing): stopped. It came during the final eval or save, which finished: the '
                         f'newest checkpoint is step 4 in {workdir}/checkpoints.'), line
  assert sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir()) == [2, 4]


def test_sigterm_inside_the_loop_still_saves_every_process_at_one_step(text_dir, tmp_path):
  sent = []

  def on_line(proc, line):
    if not sent and re.match(r'\[0\] .*step 3/', line):
      sent.append(line)
      for pid in _supervisors(proc.pid):
        os.kill(pid, signal.SIGTERM)

  workdir = tmp_path / 'run'
  result = _launch_local(workdir, text_dir, on_line, launcher_env(), '--config.train.steps=40',
                         '--config.ckpt.every_steps=100')
  assert sent, result.stderr[-3000:]
  assert result.returncode == 0, result.stderr[-3000:]
  saved = {}
  for process in (0, 1):
    [line] = [l for l in result.stderr.splitlines()
              if l.startswith(f'[{process}] ') and "preemption notice (SIGTERM via jax's preemption sync point)" in l]
    saved[process] = int(re.search(r'saved step (\d+)', line).group(1))
  assert saved[0] == saved[1] >= 3, saved
  assert [p.name for p in (workdir / 'checkpoints').iterdir()] == [str(saved[0])]
  assert 'Traceback' not in result.stderr and 'interrupted' not in result.stderr


HANDOFF = r'''
import os, signal, sys, time
import jax
from jax.experimental import multihost_utils
from trainer.safety import sigterm_handoff

saw = []
signal.signal(signal.SIGTERM, lambda signum, frame: saw.append('launcher'))
jax.distributed.initialize(f'127.0.0.1:{sys.argv[1]}', 1, 0)  # Starts jax's preemption service, which takes SIGTERM.
sigterm_handoff.hold_back()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print('held back:', saw)
sigterm_handoff.hand_to_jax()
os.kill(os.getpid(), signal.SIGTERM)
step, deadline = 0, time.monotonic() + 120
while not multihost_utils.reached_preemption_sync_point(step) and time.monotonic() < deadline:
  step += 1
  time.sleep(0.05)
print('in the loop: sync point', time.monotonic() < deadline, saw)
sigterm_handoff.take_back(lambda signum, frame: saw.append('final'))
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print('taken back:', saw)
'''


def test_the_handoff_moves_sigterm_between_the_launcher_and_jaxs_sync_point():
  result = run_python([sys.executable, '-c', HANDOFF, str(free_port())], timeout=TIMEOUT_S)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.splitlines() == ["held back: ['launcher']",
                                        "in the loop: sync point True ['launcher']",
                                        "taken back: ['launcher', 'final']"], result.stdout + result.stderr[-3000:]


REENTRY = r'''
import os, signal, sys, time
import jax
from trainer.safety import preemption, startup_signals, sigterm_handoff

startup_signals.install_early()
jax.distributed.initialize(f'127.0.0.1:{sys.argv[1]}', 1, 0)
sigterm_handoff.hold_back()
watch = preemption.PreemptionWatch()
print('step 1:', watch.reached(1))
watch.done_checking()  # The last step was checked; a rollback then re-enters the loop.
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
step, deadline = 1, time.monotonic() + 120
while not watch.reached(step) and time.monotonic() < deadline:
  step += 1
  time.sleep(0.05)
print('re-entered: sync point', time.monotonic() < deadline, watch.unanswered())
watch.close()
'''


def test_a_signal_between_the_last_check_and_a_rollback_goes_to_jaxs_sync_point():
  result = run_python([sys.executable, '-c', REENTRY, str(free_port())], timeout=TIMEOUT_S)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.splitlines() == ['step 1: False', 're-entered: sync point True None'], result.stdout
