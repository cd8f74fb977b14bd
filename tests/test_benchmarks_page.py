"""BENCHMARKS.md's current figures: every row's command names files that exist, and every row points at a journal
section that holds its details (a reader who follows a row finds the run behind it)."""

import re

from conftest import REPO

PAGE = (REPO / 'BENCHMARKS.md').read_text()
CURRENT, JOURNAL = PAGE.split('\n# Journal', 1)[0].split('## Current figures', 1)[1], PAGE.split('\n# Journal', 1)[1]


def _rows() -> list[tuple[str, list[str]]]:
  """(the table's header line, a row's cells) for every table row under 'Current figures'."""
  rows, header = [], None
  for line in CURRENT.splitlines():
    if not line.startswith('|'):
      header = None
      continue
    cells = [c.strip() for c in line.strip('|').split('|')]
    if header is None:
      header = cells
    elif not set(line) <= set('|-: '):
      rows.append((header, cells))
  return rows


def test_the_current_figures_come_first_one_table_per_platform():
  assert PAGE.index('## Current figures') < PAGE.index('# Journal')
  platforms = re.findall(r'^### (.+)$', CURRENT, flags=re.M)
  assert [p.split(',')[0].split(':')[0] for p in platforms][:2] == ['CPU', 'NVIDIA H100']
  assert any(p.startswith('TPU') for p in platforms)
  assert len(_rows()) >= 20


def test_every_command_names_files_that_exist():
  checked = 0
  for header, cells in _rows():
    if 'command' not in header:
      continue
    command = cells[header.index('command')]
    for path in re.findall(r'\b((?:benchmarks|scripts|configs)/[\w./-]+\.py|launch\.py)\b', command):
      assert (REPO / path).is_file(), (path, cells)
      checked += 1
  assert checked >= 15


def test_every_row_points_at_a_journal_section_that_exists():
  headings = re.findall(r'^#{2,4} (.+)$', JOURNAL, flags=re.M)
  for header, cells in _rows():
    if 'journal' not in header:
      continue
    section = cells[header.index('journal')].strip('"')
    if section in ('same', ''):
      continue
    assert any(h.startswith(section) for h in headings), (section, cells)
