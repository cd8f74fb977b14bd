"""scripts/prepare_data.py over the formats corpora come in (Parquet, save_to_disk, JSONL), in worker processes,
resumed after an interruption, with counts in meta.json, and its user errors (one line, exit status 2)."""

import json
import pathlib
import sys
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO, run_python
from trainer.data import corpus_formats, token_shards

sys.path.insert(0, str(REPO / 'scripts'))
import prepare_data  # noqa: E402

TOKENIZER = REPO / 'tests/fixtures/hf/tokenizer'  # A tiny BPE of 120 tokens.


def _texts(n=23):
  rng = np.random.default_rng(1)
  words = ['the', 'fox', 'jumps', 'over', 'a', 'lazy', 'dog', 'é', 'naïve', '\n']
  return [' '.join(rng.choice(words, size=int(rng.integers(1, 40)))) for _ in range(n)] + ['x']  # 'x': 1 token.


def _as_files(root: pathlib.Path, texts) -> pathlib.Path:
  root.mkdir()
  for i, text in enumerate(texts):
    (root / f'doc_{i:04d}.txt').write_text(text)
  return root


def _as_parquet(root: pathlib.Path, texts) -> pathlib.Path:
  root.mkdir()
  half = len(texts) // 2  # Two files, the first in row groups of 5: rows are read in file and row order.
  pq.write_table(pa.table({'id': list(range(half)), 'text': texts[:half]}), root / 'part-0.parquet', row_group_size=5)
  pq.write_table(pa.table({'id': list(range(half, len(texts))), 'text': texts[half:]}), root / 'part-1.parquet')
  return root


def _as_save_to_disk(root: pathlib.Path, texts, split=None) -> pathlib.Path:
  """What datasets' Dataset.save_to_disk writes: arrow IPC streams named by state.json (a DatasetDict: per split)."""
  folder = root / split if split else root
  folder.mkdir(parents=True)
  names = []
  for i, part in enumerate((texts[:7], texts[7:])):
    name = f'data-{i:05d}-of-00002.arrow'
    table = pa.table({'text': part, 'n': [len(t) for t in part]})
    with pa.ipc.new_stream(folder / name, table.schema) as writer:
      for batch in table.to_batches(max_chunksize=4):
        writer.write_batch(batch)
    names.append({'filename': name})
  (folder / 'state.json').write_text(json.dumps({'_data_files': names, '_fingerprint': 'x', '_split': split}))
  (folder / 'dataset_info.json').write_text('{}')
  if split:
    (root / 'dataset_dict.json').write_text(json.dumps({'splits': [split]}))
  return root


def _as_jsonl(path: pathlib.Path, texts, field='text') -> pathlib.Path:
  path.write_text(''.join(json.dumps({field: t, 'meta': i}) + '\n' for i, t in enumerate(texts)))
  return path


def _shards(root: pathlib.Path) -> dict[str, bytes]:
  """Every file prepare_data wrote, meta.json without the line that says what the input was."""
  files = {p.name: p.read_bytes() for p in root.iterdir() if p.is_file() and p.name != 'meta.json'}
  meta = json.loads((root / 'meta.json').read_text())
  meta.pop('source')
  return {**files, 'meta': json.dumps(meta, sort_keys=True).encode()}


def _run(*args):
  return run_python([sys.executable, str(REPO / 'scripts/prepare_data.py'), *map(str, args)], timeout=300)


@pytest.mark.parametrize('tokenizer', [None, TOKENIZER])
def test_every_format_gives_the_shards_of_the_same_documents_as_text_files(tmp_path, tokenizer):
  texts = _texts()
  inputs = {'files': _as_files(tmp_path / 'files', texts), 'parquet': _as_parquet(tmp_path / 'parquet', texts),
            'save_to_disk': _as_save_to_disk(tmp_path / 'disk', texts),
            'dataset_dict': _as_save_to_disk(tmp_path / 'dict', texts, split='train'),
            'jsonl': _as_jsonl(tmp_path / 'docs.jsonl', texts)}
  flags = ['--num_shards=3', '--eval_percent=0', '--workers=1'] + ([f'--tokenizer={tokenizer}'] if tokenizer else [])
  written = {}
  for name, path in inputs.items():
    prepare_data.main([f'--input={path}', f'--output={tmp_path / ("out_" + name)}', *flags])
    written[name] = _shards(tmp_path / f'out_{name}')
    assert json.loads((tmp_path / f'out_{name}' / 'meta.json').read_text())['source']['format'] == \
        {'files': 'files', 'dataset_dict': 'save_to_disk'}.get(name, name)
  assert all(w == written['files'] for w in written.values())
  docs = token_shards.load_documents(tmp_path / 'out_parquet', 'train')
  encode = prepare_data.load_tokenizer(str(tokenizer) if tokenizer else None)[0]
  expected = [np.asarray(encode(t)) for t in texts if len(encode(t)) >= 2]
  assert len(docs.lengths) == len(expected) == len(texts) - (tokenizer is None)  # Bytes: 'x' is 1 token, skipped.
  for d, tokens in enumerate(expected):
    np.testing.assert_array_equal(docs.span(d, 0, len(tokens)), tokens)


def test_rows_are_held_out_by_their_text_whatever_the_format(tmp_path):
  texts = _texts(60)
  outs = []
  for name, path in (('p', _as_parquet(tmp_path / 'parquet', texts)), ('j', _as_jsonl(tmp_path / 'd.jsonl', texts)),
                     ('d', _as_save_to_disk(tmp_path / 'disk', texts))):
    prepare_data.main([f'--input={path}', f'--output={tmp_path / name}', '--eval_percent=30', '--workers=1'])
    outs.append(_shards(tmp_path / name))
  assert outs[0] == outs[1] == outs[2]
  meta = json.loads((tmp_path / 'p' / 'meta.json').read_text())
  held = [t for t in texts if len(t.encode()) >= 2 and zlib.crc32(t.encode()) % 100 < 30]
  assert meta['splits']['eval']['documents'] == len(held) > 0
  assert meta['splits']['eval']['tokens'] == sum(len(t.encode()) for t in held)


def test_workers_give_the_same_shards_and_a_tokens_per_second_line(tmp_path):
  corpus = _as_parquet(tmp_path / 'parquet', _texts(40))
  one = _run(f'--input={corpus}', f'--output={tmp_path / "one"}', '--workers=1', '--chunk_docs=4')
  two = _run(f'--input={corpus}', f'--output={tmp_path / "two"}', '--workers=2', '--chunk_docs=4')
  assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
  assert _shards(tmp_path / 'one') == _shards(tmp_path / 'two')
  assert 'tokenized 41 documents' in two.stderr and 'in 11 chunk(s)' in two.stderr and 'tokens/s' in two.stderr
  meta = json.loads((tmp_path / 'two' / 'meta.json').read_text())
  texts = [t for t in _texts(40) if len(t.encode()) >= 2]
  assert sum(s['documents'] for s in meta['splits'].values()) == len(texts)
  assert sum(s['tokens'] for s in meta['splits'].values()) == sum(len(t.encode()) for t in texts)
  assert meta['skipped_documents'] == 41 - len(texts) == 1 and not (tmp_path / 'two.partial').exists()


def test_an_interrupted_run_resumes_and_tokenizes_only_what_is_left(tmp_path, monkeypatch, capsys):
  corpus = _as_parquet(tmp_path / 'parquet', _texts(40))
  flags = ['--workers=1', '--chunk_docs=4', f'--tokenizer={TOKENIZER}']
  prepare_data.main([f'--input={corpus}', f'--output={tmp_path / "clean"}', *flags])
  read = corpus_formats.read

  def interrupted(*args, **kwargs):
    for i, doc in enumerate(read(*args, **kwargs)):
      if i == 25:
        raise KeyboardInterrupt
      yield doc

  monkeypatch.setattr(corpus_formats, 'read', interrupted)
  with pytest.raises(SystemExit) as stopped:
    prepare_data.main([f'--input={corpus}', f'--output={tmp_path / "out"}', *flags])
  assert stopped.value.code == 130 and 'run the same command again to resume' in capsys.readouterr().err
  assert sorted(p.name for p in (tmp_path / 'out.partial').glob('chunk-*.npz'))[-1] == 'chunk-000005.npz'
  assert not (tmp_path / 'out').exists()  # Only a complete output is ever renamed into place.
  monkeypatch.setattr(corpus_formats, 'read', read)
  with pytest.raises(SystemExit, match='holds an interrupted run with other settings.*chunk_docs: 4 then, 5 now'):
    prepare_data.main([f'--input={corpus}', f'--output={tmp_path / "out"}', *flags[:-2], '--chunk_docs=5',
                       flags[-1]])
  prepare_data.main([f'--input={corpus}', f'--output={tmp_path / "out"}', *flags])
  err = capsys.readouterr().err
  assert 'tokenized 17 documents, ' in err and 'in 5 chunk(s), 6 chunk(s) kept from before' in err
  assert _shards(tmp_path / 'out') == _shards(tmp_path / 'clean')


@pytest.mark.parametrize('make, args, expected', [
    (lambda t: _as_parquet(t / 'p', ['a b', 'c d']), ['--text_column=body'],
     "part-0.parquet' has no column 'body' (its columns: ['id', 'text']); set --text_column"),
    (lambda t: _as_save_to_disk(t / 'd', _texts(9)), ['--text_column=content'],
     "data-00000-of-00002.arrow' has no column 'content' (its columns: ['text', 'n'])"),
    (lambda t: _as_save_to_disk(t / 'dd', _texts(9), split='train'), ['--split=test'],
     "is a DatasetDict with splits ['train']; choose one with --split"),
    (lambda t: _as_jsonl(t / 'x.jsonl', ['a b'], field='content'), [],
     "x.jsonl:1 has ['content', 'meta'], no text field 'text'; set --text_column"),
    (lambda t: _as_files(t / 'f', ['hello there']), [f'--tokenizer={TOKENIZER}', '--vocab_size=100'],
     'has 120 tokens but --vocab_size gives a vocabulary of 100'),
])
def test_user_errors_are_one_line_and_exit_2(tmp_path, make, args, expected):
  result = _run(f'--input={make(tmp_path)}', f'--output={tmp_path / "out"}', *args)
  assert result.returncode == 2, result.stderr[-2000:]
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('prepare_data.py: error: ') and expected in lines[0], lines


def test_a_tokenizer_within_the_model_vocabulary_is_recorded_at_the_model_size(tmp_path):
  src = _as_files(tmp_path / 'f', ['hello there world'])
  hf_model = tmp_path / 'model'
  hf_model.mkdir()
  (hf_model / 'config.json').write_text(json.dumps({'vocab_size': 128}))
  prepare_data.main([f'--input={src}', f'--output={tmp_path / "out"}', f'--tokenizer={TOKENIZER}',
                     f'--model={hf_model}', '--eval_percent=0'])
  assert json.loads((tmp_path / 'out' / 'meta.json').read_text())['vocab_size'] == 128
  (hf_model / 'config.json').write_text(json.dumps({'vocab_size': 64}))
  with pytest.raises(SystemExit, match='has 120 tokens but --model=.* gives a vocabulary of 64') as refused:
    prepare_data.main([f'--input={src}', f'--output={tmp_path / "out2"}', f'--tokenizer={TOKENIZER}',
                       f'--model={hf_model}'])
  assert refused.value.code == 2
