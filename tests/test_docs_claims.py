"""What the docs say the program does, checked against the program: the console the README quotes (line by line, and
no kind of line left out), the multi-process console docs/clusters.md quotes, what --start_over moves, the mesh axes,
the keys and presets configuration.md lists, and every page a doc links to."""

import re

import pytest

from configs import base
from conftest import REPO, docs_block, run_docs_block, run_launcher
from parallel import mesh
from trainer.training import checkpoint

DOCS = sorted((REPO / 'docs').glob('*.md')) + [REPO / 'README.md']
# An absl line: 'I1128 16:45:25.840057 140529952062336 loop.py:242] message'; a launch_local line adds '[0] '.
ABSL = re.compile(r'^(?:\[(\d+)\] )?[IWEF]\d{4} [\d:.]+ +\d+ ([\w.]+\.py):\d+\] (.*)$')
NUMBER = r'-?[\d,]*\d(?:\.\d+)?(?:e[+-]\d+)?'


def _quoted_block(page: str, after: str) -> list[str]:
  """The lines of the first plain ``` block after the text `after` on `page`."""
  text = (REPO / page).read_text()
  block = re.search(r'^```\n(.*?)^```', text[text.index(after):], flags=re.M | re.S)
  return [line for line in block.group(1).splitlines() if line.strip()]


def _shape(quoted: str) -> re.Pattern:
  """A quoted console line as a pattern: its numbers, paths and '...' stand for any."""
  amount = rf'{NUMBER}(?: [KMGT]iB)?'  # A size's unit follows its magnitude.
  parts = re.split(rf'(\.\.\.|/[^\s;),]+|PID|{amount})', quoted)
  pattern = ''.join('.*' if p == '...' else r'\S+' if p.startswith('/') else
                    amount if p == 'PID' or re.fullmatch(amount, p) else re.escape(p) for p in parts if p)
  return re.compile(pattern + '$')


def _logged(stderr: str) -> list[tuple[str, str, str]]:
  """(process, file, message) of every log line."""
  return [m.groups('') for m in map(ABSL.match, stderr.splitlines()) if m]


def _kind(file: str, message: str) -> tuple[str, str]:
  return file, ' '.join(re.sub(NUMBER, 'N', message).split()[:2])


def _check_quote(quote: list[str], logged: list[tuple[str, str, str]]):
  """Every quoted line is a logged line's shape; every kind of logged line is quoted (progress lines: some)."""
  said = {(p, f): [] for p, f, _ in logged}
  for process, file, message in logged:
    said[process, file].append(message)
  for line in quote:
    if line == '...':
      continue
    m = re.match(r'^(?:\[(\d+)\] )?([\w.]+\.py)\] (.*)$', line)
    assert m, f'not a console line: {line!r}'
    process, file, message = m.groups('')
    shape = _shape(message)
    assert any(shape.match(s) for s in said.get((process, file), [])), (
        f'quoted but never printed like this: {line!r}\nprinted by {file}: {said.get((process, file))}')
  quoted = {(m.group(1) or '', *_kind(m.group(2), m.group(3)))
            for m in (re.match(r'^(?:\[(\d+)\] )?([\w.]+\.py)\] (.*)$', l) for l in quote) if m}
  missing = {(p, *_kind(f, msg)) for p, f, msg in logged} - quoted
  assert not missing, f'printed by every such launch, left out of the quote: {sorted(missing)}'


def test_the_readmes_console_is_what_a_launch_prints(tmp_path):
  # The tiny config takes the Quickstart's path in seconds: the same lines with other numbers.
  result = run_launcher('--config=configs/tiny.py', f'--workdir={tmp_path}/run')
  assert result.returncode == 0, result.stderr[-3000:]
  quote = _quoted_block('README.md', '## What you get')
  _check_quote(quote, _logged(result.stderr))
  # docs/monitoring.md shows the same run's goodput table.
  [goodput] = [line.split('] ', 1)[1] for line in quote if 'Goodput' in line]
  assert goodput in _quoted_block('docs/monitoring.md', '**Goodput.**')


def test_the_multi_process_console_in_clusters_md_is_what_launch_local_prints(tmp_path):
  """The page's own block (the run and its --dry_run), run as a reader pastes it; its output holds the quoted lines."""
  result = run_docs_block(docs_block('docs/clusters.md', 'scripts/launch_local.py --num_processes=2'), tmp_path, 600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.count('launch.py --config=configs/tiny.py') >= 2  # The dry run's command per process.
  quote = _quoted_block('docs/clusters.md', 'Each line shows its')
  logged = _logged(result.stdout + result.stderr)
  # The quote shows the join, the mesh, the optimizer and the progress lines; each must be printed as shown.
  for line in quote:
    if line != '...':
      process, file, message = re.match(r'^\[(\d+)\] ([\w.]+\.py)\] (.*)$', line).groups()
      assert any(p == process and f == file and _shape(message).match(m) for p, f, m in logged), line


def test_start_over_moves_what_the_docs_say():
  text = (REPO / 'docs/checkpoints.md').read_text()
  paragraph = text[text.index('**Starting over.**'):].split('\n- ')[0]
  assert sorted(re.findall(r'`([\w.]+)/?`', paragraph.split('are moved to')[0])) == sorted(checkpoint.START_OVER_NAMES)


def test_every_page_lists_the_six_mesh_axes_in_order():
  for page in ('docs/meshes.md', 'docs/context.md'):
    text = (REPO / page).read_text()
    listed = re.search(r'`data`, `fsdp`, `pipeline`, `expert`, `context`,? (?:and )?`tensor`', text)
    assert listed, f'{page} does not list the axes {mesh.AXES}'
  assert mesh.AXES == ('data', 'fsdp', 'pipeline', 'expert', 'context', 'tensor')


def test_configuration_md_names_every_mesh_key_and_every_preset():
  text = (REPO / 'docs/configuration.md').read_text()
  for key in base.get_config().mesh:
    assert f'`mesh.{key}`' in text, key
  for preset in sorted((REPO / 'configs').glob('*.py')):
    if preset.stem not in ('base', '__init__'):
      assert f'`configs/{preset.name}`' in text, preset.name


@pytest.mark.parametrize('page', DOCS, ids=lambda p: p.name)
def test_every_link_and_named_page_exists(page):
  text = page.read_text()
  for target in re.findall(r'\]\(([^)#\s]+)(?:#[^)]*)?\)', text):
    if '://' not in target:
      assert (page.parent / target).exists(), f'{page.name} links {target}'
  for named in re.findall(r'\bdocs/[\w-]+\.md\b', text):
    assert (REPO / named).exists(), f'{page.name} names {named}'


def test_moe_md_quotes_the_parameter_line_the_preset_prints(caplog):
  """docs/moe.md quotes the mesh line's parameters of configs/moe_1b.py: the same numbers, in the same words."""
  import jax
  from absl import logging as absl_logging

  from configs import moe_1b
  from trainer.run import job as job_lib
  from trainer.run import loop
  config = moe_1b.get_config()
  config.data.source = 'synthetic'
  job = job_lib.build_job(config)  # Abstract: nothing of the 0.96B parameters is allocated.
  with caplog.at_level('INFO'):
    absl_logging.get_absl_handler()  # absl's records reach caplog through the root logger.
    loop._describe(job, '', write=False)  # noqa: SLF001 - the line a launch prints, from the function that prints it.
  [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith('Mesh ')]
  [quoted] = re.findall(r'`([\d,]+ parameters \([\d,]+ active per token\))`', (REPO / 'docs/moe.md').read_text())
  assert line.endswith(f'model: llama (linen, lm), {quoted}'), (line, quoted)
  assert sum(x.size for x in jax.tree.leaves(job.abstract.params)) == int(quoted.split()[0].replace(',', ''))
