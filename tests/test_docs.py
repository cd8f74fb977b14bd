"""Runs every ```bash block of README.md and docs/*.md, as a reader would paste it, from the repository root.

Each block runs under `bash -euo pipefail` with `/tmp/` rewritten to a fresh temporary folder, so examples never see
each other's workdirs. A line `<!-- docs-test: needs X -->` right before a fence skips that block with the reason
(`needs libtpu` runs where libtpu imports); `<!-- docs-test: each command runs on its page -->` marks a block whose
commands run, word for word, in other blocks, and `<!-- docs-test: run by tests/X.py -->` one that test runs itself
(conftest.docs_block) to check what it did. Pages may hold no runnable block at all.
"""

import importlib.util
import re
import subprocess

import pytest

from conftest import DOCS_FENCE, DOCS_RUN_BY, REPO, run_docs_block

# Hang guards, never a verdict on speed: a block gets this much per command it runs (a line calling the venv's python
# or a tool). A flat 300 s a block failed the README's "Main tasks" block (five commands, at step 12 of 12)
# on a 2-core machine at load 6-25; one tiny launch takes 40 s there when quiet.
COMMAND_TIMEOUT_S = 600
# A libtpu block compiles a real TPU step: configs/llama_1b_long.py's plan (32 chips, 131,072-token rows) took 221 s
# alone on the 2-core machine and ran past 300 s beside a test suite.
LIBTPU_COMMAND_TIMEOUT_S = 1800
COMMAND = re.compile(r'(^|[;&|(]\s*|\s)(\S*\.venv/bin/|/tmp/\S+/bin/)\S+')
PAGES = [REPO / 'README.md', *sorted((REPO / 'docs').glob('*.md'))]
NEEDS = re.compile(r'<!--\s*docs-test:\s*needs\s+(.+?)\s*-->\s*$')
# A block whose every command is also, word for word, in a block that runs (the README's list of tasks, each one
# its page's example): the launch runs once, there, where the page also checks what it did.
ON_PAGES = re.compile(r'<!--\s*docs-test:\s*each command runs on its page\s*-->\s*$')
ELSEWHERE = 'its commands run on their pages'
# A block a test runs itself (conftest.docs_block), checking more than its exit code: `<!-- docs-test: run by
# tests/test_x.py -->`.
RUN_BY = 'run by '
WORKDIR = re.compile(r'/tmp/[A-Za-z0-9_.-]+')
# A command word `python`/`python3` not reached through a path: only a venv's interpreter has the packages. Creating
# that venv (`python3 -m venv`) is the one use of the system interpreter.
BARE_PYTHON = re.compile(r'(?<![\w/.-])python3?(?![\w/.-])(?! -m venv)')
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")  # arguments (a pkill pattern), not commands


def _blocks():
  """(page, index, first line number, needs, code) for every bash block of every page."""
  found = []
  for page in PAGES:
    text = page.read_text()
    for index, match in enumerate(DOCS_FENCE.finditer(text), 1):
      line = text.count('\n', 0, match.start()) + 1
      before = text[:match.start()].rstrip('\n').rsplit('\n', 1)[-1]
      needs = NEEDS.search(before)
      run_by = DOCS_RUN_BY.search(before)
      needs = (needs.group(1) if needs else ELSEWHERE if ON_PAGES.search(before)
               else f'{RUN_BY}{run_by.group(1)}' if run_by else None)
      found.append((page.relative_to(REPO).as_posix(), index, line, needs, match.group(1)))
  return found


BLOCKS = _blocks()


def _code_lines(code):
  """The block's lines without comments, which may mention paths and commands freely."""
  return [line.split('#', 1)[0] if not line.lstrip().startswith('#') else '' for line in code.splitlines()]


def _commands(code) -> list[str]:
  """The block's commands: continued lines joined, comments and blank lines dropped, runs of spaces made one."""
  joined = '\n'.join(_code_lines(code)).replace('\\\n', ' ')
  return [' '.join(line.split()) for line in joined.splitlines() if line.strip()]


def test_every_command_of_a_block_run_on_its_pages_is_in_a_block_that_runs():
  ran = {command for _, _, _, needs, code in BLOCKS  # Run here, or by the test a block names.
         if needs is None or needs.startswith(RUN_BY) for command in _commands(code)}
  listed = [(f'{page}:{line}', command) for page, _, line, needs, code in BLOCKS if needs == ELSEWHERE
            for command in _commands(code)]
  assert listed, 'no block is marked <!-- docs-test: each command runs on its page -->'
  missing = [f'{where}: {command}' for where, command in listed if command not in ran]
  assert not missing, f'not in any block that runs (copy the page\'s command word for word): {missing}'


def test_every_block_run_by_a_test_is_read_by_that_test():
  marked = [(page, needs.removeprefix(RUN_BY)) for page, _, _, needs, _ in BLOCKS if (needs or '').startswith(RUN_BY)]
  assert marked, 'no block is marked <!-- docs-test: run by tests/... -->'
  for page, test_file in marked:
    assert f"docs_block('{page}'" in (REPO / test_file).read_text(), f'{test_file} never runs a block of {page}'


def test_every_workdir_belongs_to_one_example():
  users = {}
  for page, index, line, needs, code in BLOCKS:
    if needs == ELSEWHERE:  # Word-for-word copies of commands that run elsewhere (checked above).
      continue
    for path in set(WORKDIR.findall('\n'.join(_code_lines(code)))):
      users.setdefault(path, []).append(f'{page}:{line}')
  shared = {path: where for path, where in users.items() if len(where) > 1}
  assert not shared, f'each example needs its own /tmp/ workdir; used by several blocks: {shared}'


def test_no_block_runs_a_bare_python():
  bare = [f'{page}:{line}: {text.strip()}' for page, _, line, _, code in BLOCKS for text in _code_lines(code)
          if BARE_PYTHON.search(QUOTED.sub("''", text))]
  assert not bare, f'use .venv/bin/python (only the venv has the packages): {bare}'


def test_the_checks_catch_what_they_are_for():
  assert BARE_PYTHON.search('python launch.py') and BARE_PYTHON.search('cd x && python3 a.py')
  assert not BARE_PYTHON.search('.venv/bin/python launch.py') and not BARE_PYTHON.search('python3 -m venv .venv')
  assert not BARE_PYTHON.search(QUOTED.sub("''", "pkill -f '^python launch'"))
  assert NEEDS.search('<!-- docs-test: needs libtpu -->').group(1) == 'libtpu'
  assert WORKDIR.findall('--workdir=/tmp/a-b_1 --output=/tmp/c') == ['/tmp/a-b_1', '/tmp/c']
  assert _commands('# x\nA=1 a \\\n   --b  # c\n\nd') == ['A=1 a --b', 'd']
  assert ON_PAGES.search('<!-- docs-test: each command runs on its page -->')
  assert DOCS_RUN_BY.search('<!-- docs-test: run by tests/test_x.py -->').group(1) == 'tests/test_x.py'


def block_timeout(code: str, needs: str | None) -> int:
  """The block's hang guard: one command's guard for each command it runs."""
  commands = sum(len(COMMAND.findall(line)) for line in _code_lines(code))
  return max(commands, 1) * (LIBTPU_COMMAND_TIMEOUT_S if needs == 'libtpu' else COMMAND_TIMEOUT_S)


def test_a_blocks_guard_scales_with_the_commands_it_runs():
  readme_tasks = next(code for page, _, _, _, code in BLOCKS if page == 'README.md' and 'export_params' in code)
  launches = [l for l in _code_lines(readme_tasks) if '.venv/bin/python' in l]
  assert block_timeout(readme_tasks, None) == len(launches) * COMMAND_TIMEOUT_S >= 5 * COMMAND_TIMEOUT_S
  assert block_timeout('.venv/bin/python a.py && .venv/bin/pip install x  # .venv/bin/python b.py', None) == 1200
  assert block_timeout('ls /tmp', 'libtpu') == LIBTPU_COMMAND_TIMEOUT_S


@pytest.mark.parametrize('page,index,line,needs,code', BLOCKS,
                         ids=[f'{page}-block{index}-line{line}' for page, index, line, _, _ in BLOCKS])
def test_block_runs(page, index, line, needs, code, tmp_path):
  if needs == ELSEWHERE:
    pytest.skip(f'{ELSEWHERE} (test_every_command_of_a_block_run_on_its_pages_is_in_a_block_that_runs)')
  if needs and needs.startswith(RUN_BY):
    pytest.skip(f'{needs}, which checks what it did (conftest.docs_block)')
  if needs == 'libtpu':
    if importlib.util.find_spec('libtpu') is None:
      pytest.skip('needs libtpu (pip install -r requirements-tpu-plan.txt)')
  elif needs:
    pytest.skip(f'needs {needs}')
  timeout = block_timeout(code, needs)
  try:
    result = run_docs_block(code, tmp_path, timeout, forked=True)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f'{page} block {index} (line {line}) ran over {timeout}s:\n{code}\n{e.stderr or ""}')
  assert result.returncode == 0, (f'{page} block {index} (line {line}) exited {result.returncode}:\n{code}\n'
                                  f'--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-6000:]}')
