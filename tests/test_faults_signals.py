"""Stop signals at every phase of a supervised launch, as real signals to real processes (issue 39).

Each launch runs under the supervisor (--max_restarts=1), so the signal goes to the parent, which forwards it, as a
user's `kill` or a scheduler's would. A `sitecustomize` module put on the path of both processes holds one phase
open (an import, the compile, the first step, the final eval) and prints a marker line from the process it holds; the
test sends the signal when it reads the marker, so the signal lands in that phase by construction, however fast or
slow this machine is. Two more phases are made the same way: the child held before its handlers are in, and the
supervisor's own signal watcher scheduled late, after the supervisor returned (the CI flake: two lines).
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, launcher_env, make_text_dir, watch_command

TIMEOUT_S = 300

HOLD = r'''
import importlib.abc, importlib.util, os, signal, sys, threading, time

_where = os.environ.get('TEST_HOLD')
_in_child = 'LAUNCH_ATTEMPT' in os.environ  # Set by the supervisor for the training process it starts.


def _marker(what):
  print(f'held {what} in pid {os.getpid()}', file=sys.stderr, flush=True)


def _hold(seconds):
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:  # Python-level waiting: a handler runs here at once, as between bytecodes.
    time.sleep(0.05)


_supervisor_returned = threading.Event()


def _patch(name, module):
  if os.environ.get('TEST_LATE_WATCH') and name == 'trainer.safety.startup_signals' and not _in_child:
    # The supervisor's stop-signal watcher, as a loaded machine may schedule it: what it reads reaches it only once
    # the supervisor has returned (and put launch.py's handlers back), before the process exits.
    watch = module._watch
    def late_watch(read_fd):
      relay_read, relay_write = os.pipe()
      def relay():
        while received := os.read(read_fd, 64):
          _supervisor_returned.wait(10)
          os.write(relay_write, received)
      threading.Thread(target=relay, daemon=True).start()
      watch(relay_read)
    module._watch = late_watch
  if os.environ.get('TEST_LATE_WATCH') and name == 'trainer.supervision.supervisor':
    run = module.Supervisor.run
    def returns_late(self):
      try:
        return run(self)
      finally:
        _supervisor_returned.set()
        time.sleep(0.5)  # A slow exit: time for a watcher that got something to act on it.
    module.Supervisor.run = returns_late
  if _where == 'compile' and name == 'trainer.run.preflight':
    original = module.compile_checked
    def compile_checked(job):
      _marker('compile')
      return original(job)
    module.compile_checked = compile_checked
  if _where == 'step' and name == 'trainer.supervision.faults':
    original_inject = module.inject
    def inject(fault, step, where, **settle):
      if step == 1 and where == 'step':
        _marker('step 1')
        _hold(3)
      return original_inject(fault, step, where, **settle)
    module.inject = inject
  if _where == 'final_eval' and name == 'trainer.run.evaluation':
    original_eval = module.held_out
    def evaluate(*args):
      _marker('final eval')
      _hold(3)
      return original_eval(*args)
    module.held_out = evaluate


_PATCHED = ('trainer.run.preflight', 'trainer.supervision.faults', 'trainer.run.evaluation',
            'trainer.safety.startup_signals', 'trainer.supervision.supervisor')


class _Finder(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    # The child imports numpy (through jax); the supervisor, which imports no jax, its own module. One of the two:
    # held in the supervisor too, the child would only start once the supervisor's hold ran out.
    held = {'import': 'numpy', 'supervisor_import': 'trainer.supervision.supervisor'}.get(_where)
    if name == held and 'trainer.safety.startup_signals' in sys.modules:
      _marker(f'import of {name}')
      _hold(60)  # Inside the import machinery, where a raised exception became an ImportError.
    if _where == 'before_handlers' and name == 'trainer.safety.startup_signals' and _in_child:
      _marker('start-up before the stop handlers')  # launch.py's own first lines, before install_early().
      deadline = time.monotonic() + 60
      while not signal.sigpending() and time.monotonic() < deadline:  # Held until the forwarded signal came.
        time.sleep(0.05)
    if name not in _PATCHED:
      return None
    sys.meta_path.remove(self)
    try:
      spec = importlib.util.find_spec(name)
    finally:
      sys.meta_path.insert(0, self)
    execute = spec.loader.exec_module
    def exec_module(module):
      execute(module)
      _patch(name, module)
    spec.loader.exec_module = exec_module
    return spec


if _where:
  sys.meta_path.insert(0, _Finder())
'''


@pytest.fixture(scope='module')
def text_dir(tmp_path_factory):
  return make_text_dir(tmp_path_factory.mktemp('text'))


@pytest.fixture(scope='module')
def hook_dir(tmp_path_factory):
  folder = tmp_path_factory.mktemp('hold_hook')
  (folder / 'sitecustomize.py').write_text(HOLD)
  return folder


def _launch(tmp_path, text_dir, hook_dir, where, sig, from_child=True, *extra):
  """A supervised tiny launch with `where` held; `sig` goes to the parent when the marker comes from the child."""
  sent = []

  def on_line(proc, line):
    held = re.match(r'held .* in pid (\d+)', line)
    if held and not sent and (int(held.group(1)) != proc.pid) == from_child:
      sent.append(line)
      os.kill(proc.pid, sig)

  env = launcher_env(TEST_HOLD=where, PYTHONPATH=os.pathsep.join([str(hook_dir), str(REPO)]))
  if where == 'compile':  # A compile of its own, not a hit in the suite's shared cache: it lasts seconds.
    env = {k: v for k, v in env.items() if not k.startswith('JAX_COMPILATION_CACHE')}
  result, lines = watch_command([sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py',
                                 f'--workdir={tmp_path}', f'--config.data.text_dir={text_dir}', '--max_restarts=1',
                                 '--restart_backoff_s=0', *extra], env, on_line, TIMEOUT_S)
  assert sent, result.stderr[-3000:]
  return result


def _assert_one_clean_line(result, sig):
  assert result.returncode == 128 + sig, result.stderr[-3000:]
  for noise in ('Traceback', 'Fatal Python error', 'Exception ignored', 'Segmentation fault'):
    assert noise not in result.stderr, result.stderr[-3000:]
  lines = [l for l in result.stderr.splitlines() if l.startswith('launch.py: ')]
  assert len(lines) == 1, lines
  name = 'Ctrl-C (SIGINT)' if sig == signal.SIGINT else signal.Signals(sig).name
  assert lines[0].startswith(f'launch.py: interrupted: {name} received outside the step loop'), lines[0]
  return lines[0]


STOPS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT]


@pytest.mark.parametrize('sig', STOPS, ids=lambda s: s.name)
def test_a_stop_signal_while_the_child_still_imports_ends_in_one_line(text_dir, hook_dir, tmp_path, sig):
  result = _launch(tmp_path, text_dir, hook_dir, 'import', sig)
  line = _assert_one_clean_line(result, sig)
  assert 'No step of this launch was left unsaved' in line
  assert not (tmp_path / 'checkpoints').exists() or not any((tmp_path / 'checkpoints').iterdir())


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_stop_signal_forwarded_before_the_child_has_its_handlers_ends_in_one_line(text_dir, hook_dir, tmp_path, sig):
  # Held in launch.py's own first lines, before install_early(): the forwarded signal waits for the handlers (it was
  # a KeyboardInterrupt traceback for SIGINT, a death without a word for SIGTERM).
  result = _launch(tmp_path, text_dir, hook_dir, 'before_handlers', sig)
  assert 'No step of this launch was left unsaved' in _assert_one_clean_line(result, sig)


def test_a_stop_signal_the_supervisor_answered_is_not_answered_again_by_its_late_watcher(text_dir, hook_dir, tmp_path,
                                                                                        monkeypatch):
  # The CI flake: the supervisor's C-level watcher read the signal only after the supervisor had returned and put
  # launch.py's start-up handlers back, and printed a second line after the child's.
  monkeypatch.setenv('TEST_LATE_WATCH', '1')
  _assert_one_clean_line(_launch(tmp_path, text_dir, hook_dir, 'import', signal.SIGINT), signal.SIGINT)


_CHILD = '''
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # As launch.py's start-up handlers, then unblocked as they are.
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
time.sleep(20)
'''


def _supervised_with_a_sigterm_while_starting(child: str, monkeypatch):
  """A Supervisor of `python -c child` whose SIGTERM comes as Popen returns, before the child is known."""
  from trainer.supervision import supervisor
  run = supervisor.Supervisor([sys.executable, '-c', child], '/tmp/unused', 0, 0.0, writes_record=False)
  popen = subprocess.Popen

  def popen_with_a_signal_meanwhile(*args, **kwargs):
    started = popen(*args, **kwargs)
    # Handed to the handler directly (no real signal reaches pytest), as Python runs it in Popen's last bytecodes,
    # before the child is known; the child has not installed its handler yet (Python takes ~20 ms to start).
    run._on_signal(signal.SIGTERM, None)  # pylint: disable=protected-access
    return started

  monkeypatch.setattr(subprocess, 'Popen', popen_with_a_signal_meanwhile)
  return run


def test_a_stop_signal_while_the_supervisor_starts_its_child_reaches_the_child_once_it_can_answer(monkeypatch):
  run = _supervised_with_a_sigterm_while_starting(_CHILD, monkeypatch)
  assert run.run() == 143
  # Its own handler answered (it was lost, and the child slept its 20 s; or, forwarded at once, it killed it).
  assert run.records[0]['cause'] == ('stopped by SIGTERM, which the supervisor received and forwarded to the '
                                     'training process; it stopped with it (exit 143)'), run.records


def test_a_stop_signal_while_the_supervisor_itself_imports_ends_in_one_line(text_dir, hook_dir, tmp_path):
  result = _launch(tmp_path, text_dir, hook_dir, 'supervisor_import', signal.SIGTERM, False)
  _assert_one_clean_line(result, signal.SIGTERM)
  assert not (tmp_path / 'attempts.jsonl').exists()  # No attempt was started, so none is recorded.


@pytest.mark.parametrize('sig', STOPS, ids=lambda s: s.name)
def test_a_stop_signal_while_compiling_ends_in_one_line_without_a_crash(text_dir, hook_dir, tmp_path, sig):
  result = _launch(tmp_path, text_dir, hook_dir, 'compile', sig)
  _assert_one_clean_line(result, sig)
  assert 'Compiled the train step' not in result.stderr  # It ended during the compile, not after it.
  [record] = [l for l in (tmp_path / 'attempts.jsonl').read_text().splitlines()]
  assert '"retried": false' in record and 'SIGSEGV' not in record, record


def test_a_stop_signal_during_the_first_step_saves_it_and_stops(text_dir, hook_dir, tmp_path):
  result = _launch(tmp_path, text_dir, hook_dir, 'step', signal.SIGTERM)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  assert re.search(r'SIGTERM received: saved step 1 to \S+ and stopped', result.stderr), result.stderr[-3000:]
  assert sorted(p.name for p in (tmp_path / 'checkpoints').iterdir()) == ['1']


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_during_the_final_eval_says_what_was_kept(text_dir, hook_dir, tmp_path, sig):
  result = _launch(tmp_path, text_dir, hook_dir, 'final_eval', sig)
  line = _assert_one_clean_line(result, sig)
  assert 'during the final eval or save' in line and 'the newest checkpoint is step 8' in line, line
  assert sorted(int(p.name) for p in (tmp_path / 'checkpoints').iterdir()) == [4, 8]


_HUNG_CHILD = '''
import time
time.sleep(60)  # Hung while starting: it never installs a handler nor unblocks what its supervisor held.
'''


def test_a_stop_signal_to_a_child_hung_while_starting_ends_it_after_a_grace_in_one_line(monkeypatch, capsys):
  from trainer.supervision import supervisor
  monkeypatch.setattr(supervisor, '_STARTING_STOP_GRACE_S', 0.5)
  run = _supervised_with_a_sigterm_while_starting(_HUNG_CHILD, monkeypatch)
  began = time.monotonic()
  code = run.run()
  # Blocked, SIGTERM never reached it: without the grace the supervisor waited out its 60 s sleep.
  assert time.monotonic() - began < 15
  lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith('launch.py: ')]
  assert len(lines) == 1 and lines[0].startswith('launch.py: interrupted: attempt 1: asked to stop (SIGTERM), the '
                                                 'training process was still starting'), lines
  assert code == 128 + signal.SIGTERM, (code, run.records)
