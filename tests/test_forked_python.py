"""tests/forked_python.py: a command forked from the warm server runs as the same command in a fresh interpreter."""

import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest

import forked_python
from conftest import REPO, launcher_env, run_docs_block, run_python

# What a process sees of itself: argv, sys.path[0], its folder, a variable, __name__, its own process group, and
# whether jax was imported before its first line ran (only in the fork).
SELF = '''
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "var": os.environ.get("FORKED_TEST"),
                  "name": __name__, "own_group": os.getpgid(0) == os.getpid(), "preloaded": "jax" in sys.modules}))
print("to stderr", file=sys.stderr)
'''


@pytest.fixture(scope='module', autouse=True)
def server():
  for _ in range(2):  # The suite's environment's server starts at its second command.
    run_python([sys.executable, '-c', 'pass'], timeout=120)


def _fresh(argv, **kwargs):
  return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kwargs)


def test_a_forked_command_sees_its_argv_folder_and_environment_as_a_fresh_one_does(tmp_path):
  env = launcher_env(FORKED_TEST='one')
  argv = [sys.executable, '-c', SELF, 'a', '--b=c']
  forked = run_python(argv, env=env, cwd=tmp_path, timeout=120, read_at_run_time=('FORKED_TEST',))
  fresh = _fresh(argv, env=env, cwd=tmp_path)
  seen, expected = json.loads(forked.stdout), json.loads(fresh.stdout)
  assert seen.pop('preloaded') and not expected.pop('preloaded')  # It was forked; the other was not.
  assert seen.pop('own_group')  # A group of its own: a command that signals its group leaves the server be.
  expected.pop('own_group')
  assert seen == expected == {'argv': ['-c', 'a', '--b=c'], 'path0': '', 'cwd': str(tmp_path), 'var': 'one',
                              'name': '__main__'}
  assert forked.stderr == fresh.stderr == 'to stderr\n' and forked.returncode == fresh.returncode == 0


def test_a_script_gets_its_own_folder_first_on_the_path_and_the_same_error_and_exit_code(tmp_path):
  # launch.py refuses a misspelled key before jax loads: the whole of both outputs is compared.
  argv = [sys.executable, 'launch.py', '--config=configs/tiny.py', f'--workdir={tmp_path}',  # Relative, from REPO.
          '--config.train.stpes=5']
  forked, fresh = run_python(argv, timeout=120), _fresh(argv, cwd=REPO, env=launcher_env())
  assert forked.returncode == fresh.returncode == 2
  assert forked.stderr == fresh.stderr and 'train.stpes' in forked.stderr
  assert forked.stdout == fresh.stdout
  # sys.argv[0] as given, relative: the fork moves to its folder first.
  assert forked_python._command(argv, REPO) == argv[1:]  # pylint: disable=protected-access


@pytest.mark.parametrize('code, returncode, last_line', [
    ('import sys; sys.exit(3)', 3, None),
    ('raise ValueError("bad")', 1, 'ValueError: bad'),
    ('import os, signal; os.kill(os.getpid(), signal.SIGKILL)', -signal.SIGKILL, None),
    ('import sys; print("\\r".join("abc"), end="", file=sys.stderr)', 0, 'c'),  # Text mode: universal newlines.
])
def test_exit_codes_tracebacks_and_deaths_by_signal_reach_the_test(code, returncode, last_line):
  result = run_python([sys.executable, '-c', code], timeout=120)
  assert result.returncode == returncode, result.stderr
  if last_line is not None:
    assert result.stderr.splitlines()[-1] == last_line
  if returncode == 1:
    assert result.stderr.startswith('Traceback (most recent call last):')


def test_what_the_fork_cannot_give_runs_in_a_fresh_interpreter():
  preloaded = [sys.executable, '-c', 'import sys; print("jax" in sys.modules)']
  assert run_python(preloaded, timeout=120).stdout == 'True\n'
  # A new environment (its server starts for its second command), an interpreter option, a --plan: fresh.
  new = launcher_env(JAX_ENABLE_X64='1')
  assert [run_python(preloaded, env=new, timeout=120).stdout for _ in range(2)] == ['False\n', 'True\n']
  assert run_python([sys.executable, '-I', *preloaded[1:]], timeout=120).stdout == 'False\n'
  assert forked_python._command([*preloaded, '--plan'], REPO) is None  # pylint: disable=protected-access
  assert forked_python._command([sys.executable, '/usr/lib/x.py'], REPO) is None  # pylint: disable=protected-access


def test_an_environment_that_changed_under_the_test_process_gets_a_server_of_its_own(monkeypatch):
  # In-process tests may set variables for good (a tracker's, a tokenizer's): one more environment than there are
  # servers, each asked for twice; the second command of each is forked, the least recently used server giving way.
  preloaded = [sys.executable, '-c', 'import os, sys; print("jax" in sys.modules, os.environ["FORKED_DRIFT"])']
  environments = range(forked_python._MAX_SERVERS + 1)  # pylint: disable=protected-access
  seen = []
  for i in environments:
    monkeypatch.setenv('FORKED_DRIFT', str(i))
    seen.append([run_python(preloaded, timeout=120).stdout for _ in range(2)])
  assert seen == [[f'False {i}\n', f'True {i}\n'] for i in environments]


def test_a_forked_command_past_its_timeout_is_killed():
  start = time.monotonic()
  with pytest.raises(subprocess.TimeoutExpired):
    run_python([sys.executable, '-c', 'import os, time; print(os.getpid(), flush=True); time.sleep(600)'], timeout=3)
  assert time.monotonic() - start < 60
  # The server answers the next command: the killed one was reaped, not left holding it.
  assert run_python([sys.executable, '-c', 'print(7)'], timeout=120).stdout == '7\n'


def test_a_shells_python_commands_are_forked_with_their_stdin_output_and_exit_status(tmp_path):
  """A docs block's `.venv/bin/python` (conftest.run_docs_block(forked=True), tests/forked_command.py): from the
  environment's second command on, forked; what it prints, its exit code and its death by a signal reach the shell."""
  code = """
.venv/bin/python -c 'pass'
.venv/bin/python -c 'import sys; print("jax" in sys.modules)'
.venv/bin/python -c 'import sys; print(sys.argv[1:]); sys.exit(3)' a 'b c' || echo "exit $?"
.venv/bin/python -c 'import os, signal; os.kill(os.getpid(), signal.SIGTERM)' || echo "exit $?"
echo hi | .venv/bin/python -c 'import sys; print(sys.stdin.read().upper(), file=sys.stderr)'
.venv/bin/python -m json.tool --help > /dev/null  # -m: a fresh interpreter
"""
  result = run_docs_block(code, tmp_path, 120, forked=True)
  assert (result.returncode, result.stdout) == (0, "True\n['a', 'b c']\nexit 3\nexit 143\n"), result
  assert result.stderr == 'Terminated\nHI\n\n'  # bash's word for its command's SIGTERM, as for a fresh one.


def test_a_shells_forked_command_is_killed_with_the_shell_by_the_hang_guard(tmp_path):
  start = time.monotonic()
  with pytest.raises(subprocess.TimeoutExpired) as e:
    run_docs_block('.venv/bin/python -c pass\n'
                   '.venv/bin/python -c \'import os, time; print(os.getpid(), flush=True); time.sleep(600)\'\n',
                   tmp_path, 5, forked=True)
  assert time.monotonic() - start < 60  # Not left running: it held the block's stdout, so the guard waited on it.
  pid = int(e.value.stdout)
  deadline = time.monotonic() + 30
  while pathlib.Path(f'/proc/{pid}').exists() and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not pathlib.Path(f'/proc/{pid}').exists()
