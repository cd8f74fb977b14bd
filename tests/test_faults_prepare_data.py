"""scripts/prepare_data.py against hostile inputs, changed inputs and interruptions (issue 54, its data rows).

- Input that is corrupt or undecodable, in every format it reads, is one line naming the file and the line or row,
  exit 2, and leaves nothing that blocks the corrected command.
- A resume happens only for the same input (each file's size and modification time) and settings; the line that
  says otherwise tells how to start over, and following it works.
- --output is written under OUT.partial and renamed when complete: an interruption while writing, or of a
  fine-tuning file, leaves no partial OUT, and "run the same command again" works.
- Ctrl-C (to the process group, tokenizer workers included), SIGTERM and SIGHUP during tokenizing: one line, exit
  128 + the signal, then the advice followed resumes.
"""

import json
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from conftest import REPO, run_python
from test_data_formats import _as_files, _as_jsonl, _as_parquet, _as_save_to_disk, _texts
from trainer.data import corpus_formats, token_shards

sys.path.insert(0, str(REPO / 'scripts'))
import prepare_data  # noqa: E402


def _refused(capsys, *args) -> str:
  """The one line of a prepare_data run that exits 2."""
  with pytest.raises(SystemExit) as stopped:
    prepare_data.main([str(a) for a in args])
  err = [l for l in capsys.readouterr().err.strip().splitlines() if not l.startswith('tokenized ')]  # Progress.
  assert stopped.value.code == 2 and len(err) == 1 and err[0].startswith('prepare_data.py: error: '), err
  return err[0]


def _truncated_arrow(tmp_path):
  root = _as_save_to_disk(tmp_path / 'disk', _texts(30))
  arrow = root / 'data-00001-of-00002.arrow'
  arrow.write_bytes(arrow.read_bytes()[:-300])
  return root


def _corrupt_parquet_page(tmp_path):
  import pyarrow.parquet as pq
  (tmp_path / 'pq').mkdir()
  path = tmp_path / 'pq' / 'part.parquet'
  pq.write_table(pa.table({'text': [f'row {i} ' * 40 for i in range(60)]}), path, row_group_size=20,
                 use_dictionary=False)
  data = bytearray(path.read_bytes())
  page = pq.ParquetFile(path).metadata.row_group(1).column(0).data_page_offset  # The footer stays readable.
  data[page:page + 400] = b'\xff' * 400
  path.write_bytes(bytes(data))
  return path


def _lines(path, lines: list[bytes]):
  path.write_bytes(b''.join(line + b'\n' for line in lines))
  return path


CORRUPT = {
    'truncated arrow': (_truncated_arrow, [],
                        "data-00001-of-00002.arrow' is truncated or corrupt after its first 20 row(s) (OSError: "
                        "Expected to be able to read"),
    'corrupt parquet page': (_corrupt_parquet_page, [],
                             "part.parquet' is truncated or corrupt (OSError: Couldn't deserialize thrift"),
    'invalid UTF-8': (lambda t: _lines(t / 'x.jsonl', [b'{"text": "ok"}', b'{"text": "caf\xe9"}']), [],
                      'x.jsonl:2 is not UTF-8 (byte 0xe9 at column 14)'),
    'lone surrogate': (lambda t: _lines(t / 'x.jsonl', [b'{"text": "ok"}', b'{"text": "a\\ud800b"}']), [],
                       "x.jsonl:2: the text field 'text' holds a lone surrogate escape (\\ud800 at character 1)"),
    'fine-tuning, invalid UTF-8': (lambda t: _lines(t / 'f.jsonl', [b'{"prompt": "\xff", "completion": "b"}']), [],
                                   'f.jsonl:1 is not UTF-8 (byte 0xff at column 13)'),
    'fine-tuning, lone surrogate': (
        lambda t: _lines(t / 'f.jsonl', [b'{"prompt": "a", "completion": "b"}',
                                         b'{"prompt": "a", "completion": "\\udfff"}']), [],
        'f.jsonl:2: "prompt" or "completion" holds a lone surrogate escape (\\udfff'),
    'null text': (lambda t: _lines(t / 'x.jsonl', [b'{"text": "ok"}', b'{"text": null}']), [],
                  "x.jsonl:2: the text field 'text' is null, not a string"),
    'null row': (lambda t: _as_parquet(t / 'p', ['a b', 'c d', None, 'e f']), [],
                 "part-1.parquet' row 0: column 'text' is null, not text"),
    'empty JSONL': (lambda t: _lines(t / 'e.jsonl', []), [], "e.jsonl' holds no JSON line (it is empty or blank)"),
    'blank JSONL': (lambda t: _lines(t / 'e.jsonl', [b'', b'  ', b'\t']), [],
                    "e.jsonl' holds no JSON line (it is empty or blank)"),
    'missing column': (lambda t: _as_parquet(t / 'p', ['a b', 'c d']), ['--text_column=body'],
                       "has no column 'body'"),
}


@pytest.mark.parametrize('case', CORRUPT, ids=list(CORRUPT))
def test_bad_input_is_one_line_naming_it_and_leaves_nothing_in_the_way(tmp_path, capsys, case):
  make, flags, expected = CORRUPT[case]
  line = _refused(capsys, f'--input={make(tmp_path)}', f'--output={tmp_path / "out"}', '--workers=1', *flags)
  assert expected in line, line
  assert not (tmp_path / 'out').exists() and not (tmp_path / 'out.partial').exists()


def test_a_failed_first_check_does_not_block_the_corrected_command(tmp_path, capsys):
  corpus = _as_parquet(tmp_path / 'p', _texts(9))
  _refused(capsys, f'--input={corpus}', f'--output={tmp_path / "out"}', '--text_column=body')
  prepare_data.main([f'--input={corpus}', f'--output={tmp_path / "out"}', '--text_column=text', '--workers=1'])
  assert json.loads((tmp_path / 'out' / 'meta.json').read_text())['splits']['train']['documents'] > 0


def test_a_run_that_failed_at_a_bad_line_keeps_nothing_and_the_corrected_file_runs(tmp_path, capsys):
  texts = _texts(30)
  path = _lines(tmp_path / 'd.jsonl', [json.dumps({'text': t}).encode() for t in texts] + [b'{"text": 3}'])
  flags = [f'--input={path}', f'--output={tmp_path / "out"}', '--workers=1', '--chunk_docs=4', '--eval_percent=0']
  assert 'd.jsonl:32: the text field' in _refused(capsys, *flags)  # After 7 chunks were tokenized.
  assert not (tmp_path / 'out.partial').exists()
  _as_jsonl(path, texts)
  prepare_data.main(flags)
  assert json.loads((tmp_path / 'out' / 'meta.json').read_text())['splits']['train']['documents'] == len(texts) - 1


def test_text_column_decides_whether_a_jsonl_is_fine_tuning(tmp_path):
  path = _lines(tmp_path / 'd.jsonl', [json.dumps({'text': t * 3, 'prompt': 'p', 'completion': 'c'}).encode()
                                       for t in ('ab', 'cd', 'ef')])
  prepare_data.main([f'--input={path}', f'--output={tmp_path / "docs"}', '--text_column=text', '--eval_percent=0'])
  prepare_data.main([f'--input={path}', f'--output={tmp_path / "pairs"}', '--eval_percent=0'])
  docs, pairs = (json.loads((tmp_path / n / 'meta.json').read_text()) for n in ('docs', 'pairs'))
  assert docs['source']['format'] == 'jsonl' and docs['splits']['train']['tokens'] == 18  # 'ababab' ... as bytes.
  assert 'trained_tokens' in pairs and 'source' not in pairs


def test_invalid_utf8_in_text_files_is_counted_in_a_warning(tmp_path, capsys):
  (tmp_path / 'docs').mkdir()
  (tmp_path / 'docs' / 'latin.txt').write_bytes(('naïve café ' * 20).encode('latin-1'))  # 40 bad of 220 bytes.
  (tmp_path / 'docs' / 'clean.txt').write_text('plain text ' * 20)
  prepare_data.main([f'--input={tmp_path / "docs"}', f'--output={tmp_path / "out"}', '--workers=1'])
  [warning] = [l for l in capsys.readouterr().err.splitlines() if 'warning' in l]
  assert warning.startswith('prepare_data.py: warning: 40 byte(s) of invalid UTF-8 in 1 text file(s) were replaced '
                            "with U+FFFD (18.18% of their bytes): 'latin.txt' (40 of 220 bytes, 18.2%)"), warning


def _interrupt_reading_at(monkeypatch, n):
  read = corpus_formats.read

  def interrupted(*args, **kwargs):
    for i, doc in enumerate(read(*args, **kwargs)):
      if i == n:
        raise KeyboardInterrupt
      yield doc
  monkeypatch.setattr(corpus_formats, 'read', interrupted)
  return read


@pytest.mark.parametrize('change', ['rewritten', 'touched'])
def test_a_resume_after_the_input_changed_is_refused_and_the_advice_works(tmp_path, monkeypatch, capsys, change):
  path = _as_jsonl(tmp_path / 'd.jsonl', _texts(40))
  flags = [f'--input={path}', f'--output={tmp_path / "out"}', '--workers=1', '--chunk_docs=4']
  read = _interrupt_reading_at(monkeypatch, 25)
  with pytest.raises(SystemExit, match='130'):
    prepare_data.main(flags)
  monkeypatch.setattr(corpus_formats, 'read', read)
  assert '6 tokenized chunk(s) are kept in' in capsys.readouterr().err
  before = path.stat().st_size
  if change == 'rewritten':
    new = [t + ' and more' for t in _texts(40)]
    _as_jsonl(path, new)
    said = f'was {before:,} bytes, now {path.stat().st_size:,}'
  else:  # The same bytes again: only its modification time says it may differ.
    new, said = _texts(40), 'was modified'
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
  line = _refused(capsys, *flags)
  assert (f"the input or the tokenizer changed since the interrupted run in '{tmp_path}/out.partial' ('{path}' "
          f"{said})") in line, line
  assert 'its 6 chunk(s) would mix old and new documents; remove it to start over (rm -r ' in line
  assert len(list((tmp_path / 'out.partial').glob('chunk-??????.npz'))) == 6  # The refusal touched nothing.
  advice = re.search(r'\((rm -r [^)]+)\)', line).group(1)
  assert subprocess.run(['bash', '-c', advice], check=False).returncode == 0  # The advice, as printed.
  prepare_data.main(flags)
  meta = json.loads((tmp_path / 'out' / 'meta.json').read_text())
  assert sum(s['tokens'] for s in meta['splits'].values()) == sum(len(t.encode()) for t in new if len(t.encode()) > 1)


def test_an_input_changed_while_it_is_read_keeps_nothing(tmp_path, monkeypatch, capsys):
  path = _as_jsonl(tmp_path / 'd.jsonl', _texts(20))
  read = corpus_formats.read

  def appended(*args, **kwargs):
    yield from read(*args, **kwargs)
    with path.open('a') as more:
      more.write('{"text": "late"}\n')
  monkeypatch.setattr(corpus_formats, 'read', appended)
  line = _refused(capsys, f'--input={path}', f'--output={tmp_path / "out"}', '--workers=1', '--chunk_docs=4')
  assert 'the input changed while it was read' in line and 'run the same command again once' in line, line
  assert not (tmp_path / 'out').exists() and not (tmp_path / 'out.partial').exists()


INPUTS = {
    'jsonl': lambda t: _as_jsonl(t / 'd.jsonl', _texts(40)),
    'text files': lambda t: _as_files(t / 'docs', _texts(40)),
    'parquet': lambda t: _as_parquet(t / 'p', _texts(40)),
    'save_to_disk': lambda t: _as_save_to_disk(t / 'disk', _texts(40)),
    'fine-tuning': lambda t: _lines(t / 'f.jsonl', [json.dumps({'prompt': x, 'completion': 'ok'}).encode()
                                                    for x in _texts(40)]),
}


@pytest.mark.parametrize('kind', INPUTS)
def test_an_interruption_while_writing_leaves_no_output_and_the_same_command_finishes(tmp_path, monkeypatch, capsys,
                                                                                      kind):
  path = INPUTS[kind](tmp_path)
  flags = [f'--input={path}', f'--output={tmp_path / "out"}', '--workers=1', '--chunk_docs=8', '--num_shards=4']
  prepare_data.main([*flags[:1], f'--output={tmp_path / "clean"}', *flags[2:]])
  write_split = token_shards.write_split

  def cut_short(root, split, *args):
    write_split(root, split, *args)  # One split's shards on disk, then the interruption.
    raise KeyboardInterrupt
  monkeypatch.setattr(token_shards, 'write_split', cut_short)
  with pytest.raises(SystemExit, match='130'):
    prepare_data.main(flags)
  monkeypatch.setattr(token_shards, 'write_split', write_split)
  line = capsys.readouterr().err.strip().splitlines()[-1]
  assert f'nothing was written to {tmp_path / "out"}' in line and 'run the same command again' in line, line
  assert not (tmp_path / 'out').exists()
  prepare_data.main(flags)
  assert ('6 chunk(s) kept from before' in capsys.readouterr().err) == (kind != 'fine-tuning')
  assert _written(tmp_path / 'out') == _written(tmp_path / 'clean') and not (tmp_path / 'out.partial').exists()


def _written(root):
  """Every file under root, meta.json without the path of the input."""
  files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob('*') if p.is_file() and p.name != 'meta.json'}
  meta = json.loads((root / 'meta.json').read_text())
  meta.pop('source', None)
  return {**files, 'meta': meta}


def test_a_second_run_into_the_same_output_is_refused_while_the_first_works(tmp_path, capsys):
  import fcntl
  path = _as_jsonl(tmp_path / 'd.jsonl', _texts(9))
  (tmp_path / 'out.partial').mkdir()
  (tmp_path / 'out.partial' / 'job.json').write_text('{}')  # The first run, before its first chunk.
  first = os.open(tmp_path / 'out.partial', os.O_RDONLY)
  fcntl.flock(first, fcntl.LOCK_EX)
  try:
    line = _refused(capsys, f'--input={path}', f'--output={tmp_path / "out"}')
  finally:
    os.close(first)
  assert f"another prepare_data.py is writing '{tmp_path}/out.partial'" in line, line
  assert (tmp_path / 'out.partial' / 'job.json').read_text() == '{}'  # Left to the run that holds it.


@pytest.mark.parametrize('target', ['dangling', 'a folder'])
def test_a_symlinked_output_is_refused_and_not_followed(tmp_path, capsys, target):
  (tmp_path / 'docs').mkdir()
  (tmp_path / 'docs' / 'a.txt').write_text('some text ' * 10)
  if target == 'a folder':
    (tmp_path / 'real').mkdir()
  (tmp_path / 'out').symlink_to(tmp_path / 'real')
  line = _refused(capsys, f'--input={tmp_path / "docs"}', f'--output={tmp_path / "out"}')
  assert f"--output='{tmp_path / 'out'}' is a symbolic link (to '{tmp_path / 'real'}')" in line, line
  assert not (tmp_path / 'real').exists() or not any((tmp_path / 'real').iterdir())


# prepare_data.py run as a script (argv: the signal's name, then the script and its flags), signalled by the stop
# signal right after its second tokenized chunk: mid-run by construction, however fast or slow the machine is.
# Ctrl-C goes to the whole process group, the tokenizer workers included, as a terminal sends it.
SIGNALLED = """
import os, runpy, signal, sys
os.setpgid(0, 0)  # A group of its own (a forked command has one already): Ctrl-C must not reach the test.
from trainer.data import tokenize_job
add, sig = tokenize_job.Progress.add, signal.Signals[sys.argv[1]]
def add_then_stop(progress, *args):
  add(progress, *args)
  if progress.chunks == 2:
    os.killpg(0, sig) if sig == signal.SIGINT else os.kill(os.getpid(), sig)
tokenize_job.Progress.add = add_then_stop
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


@pytest.mark.parametrize('sig, workers', [(signal.SIGINT, 2), (signal.SIGTERM, 1), (signal.SIGHUP, 1)],
                         ids=['Ctrl-C', 'SIGTERM', 'SIGHUP'])
def test_a_stop_signal_while_tokenizing_is_one_line_and_the_same_command_resumes(tmp_path, sig, workers):
  texts = _texts(30)
  command = [str(REPO / 'scripts/prepare_data.py'), f'--input={_as_jsonl(tmp_path / "d.jsonl", texts)}',
             f'--output={tmp_path / "out"}', f'--workers={workers}', '--chunk_docs=2', '--eval_percent=0']
  result = run_python([sys.executable, '-c', SIGNALLED, sig.name, *command], timeout=120)
  assert result.returncode == 128 + sig, result.stderr[-3000:]
  lines = [l for l in result.stderr.splitlines() if not l.startswith('tokenized ')]
  name = 'Ctrl-C (SIGINT)' if sig == signal.SIGINT else sig.name
  kept = len(list((tmp_path / 'out.partial').glob('chunk-??????.npz')))
  assert lines == [f'prepare_data.py: interrupted by {name}: nothing was written to {tmp_path / "out"} yet; '
                   f'{kept} tokenized chunk(s) are kept in {tmp_path / "out.partial"}: run the same command again '
                   f'to resume.'] and kept >= 2, result.stderr[-3000:]
  resumed = run_python([sys.executable, *command], timeout=120)
  assert resumed.returncode == 0 and f'{kept} chunk(s) kept from before' in resumed.stderr, resumed.stderr[-3000:]
  kept_texts = [t for t in texts if len(t.encode()) >= 2]
  meta = json.loads((tmp_path / 'out' / 'meta.json').read_text())
  assert meta['splits']['train'] == {**meta['splits']['train'], 'documents': len(kept_texts),
                                     'tokens': sum(len(t.encode()) for t in kept_texts)}
  np.testing.assert_array_equal(token_shards.load_documents(tmp_path / 'out', 'train').lengths,
                                [len(t.encode()) for t in kept_texts])


def test_off_a_terminal_the_progress_summary_is_printed_once():
  import io
  from trainer.data import tokenize_job
  log = io.StringIO()
  progress = tokenize_job.Progress(stream=log)
  progress.add(3, 120)  # A one-chunk corpus: its line is the summary.
  progress.show(final=True)
  assert log.getvalue().count('tokenized 3 documents, 120 tokens in 1 chunk(s)') == 1, log.getvalue()
  progress.add(2, 80)  # Within the 10 s of a log file's lines: only the final line says it.
  progress.show(final=True)
  assert log.getvalue().count('tokenized 5 documents, 200 tokens in 2 chunk(s)') == 1, log.getvalue()
