"""Sources other than the default text: ArrayRecord token shards (and prepare_data.py), packing, .npz arrays,
synthetic tokens; and one clear error for each kind of bad input, before training starts."""

import json
import pathlib
import sys

import numpy as np
import pytest

from configs import tiny
from conftest import REPO, run_python
from parallel import mesh as mesh_lib
from parallel import sharding
from trainer import data
from trainer.base.errors import UserError
from trainer.data import token_shards

sys.path.insert(0, str(REPO / 'scripts'))
import prepare_data  # noqa: E402


def _config(**data_overrides):
  config = tiny.get_config()
  config.data.update(data_overrides)
  return config


def _prepare(tmp_path, docs: dict[str, bytes | np.ndarray], *flags) -> pathlib.Path:
  src, out = tmp_path / 'src', tmp_path / 'shards'
  src.mkdir(exist_ok=True)
  for name, content in docs.items():
    if isinstance(content, np.ndarray):
      np.save(src / name, content)
    else:
      (src / name).write_bytes(content)
  prepare_data.main([f'--input={src}', f'--output={out}', '--num_shards=3', '--eval_percent=0', *flags])
  return out


@pytest.fixture
def token_docs():
  """Documents of distinct lengths whose tokens say which document they come from."""
  rng = np.random.default_rng(0)
  return {f'doc_{i:02d}.npy': np.concatenate([[i], rng.integers(100, 300, size=5 + 7 * i)]).astype(np.int32)
          for i in range(12)}


def test_prepare_data_writes_every_document_in_order(tmp_path, token_docs):
  root = _prepare(tmp_path, token_docs)
  meta = json.loads((root / 'meta.json').read_text())
  assert meta['vocab_size'] == 300 and meta['dtype'] == 'uint16' and sum(meta['splits']['train']['records_per_shard']) == 12
  docs = token_shards.load_documents(root, 'train')
  for d, (name, tokens) in enumerate(sorted(token_docs.items())):
    np.testing.assert_array_equal(docs.span(d, 0, len(tokens)), tokens)
  assert docs.stream(4, 9).tolist() == token_docs['doc_00.npy'][4:6].tolist() + token_docs['doc_01.npy'][:3].tolist()


def test_packed_rows_never_predict_across_documents(tmp_path, token_docs):
  docs = token_shards.load_documents(_prepare(tmp_path, token_docs), 'train')
  rows = data.PackedRows(docs, seq_len=16)
  by_first_token = {int(t[0]): t for t in token_docs.values()}
  assert len(rows) == sum(len(t) - 1 for t in token_docs.values()) // 16
  seen = 0
  for i in range(len(rows)):
    row = rows[i]
    assert {k: v.shape for k, v in row.items()} == {k: (16,) for k in ('inputs', 'targets', 'segment_ids', 'positions')}
    for segment in np.unique(row['segment_ids']):
      at = row['segment_ids'] == segment
      positions = row['positions'][at]
      np.testing.assert_array_equal(positions, np.arange(positions[0], positions[0] + at.sum()))
      doc = by_first_token[int(row['inputs'][at][0])] if positions[0] == 0 else None
      if doc is not None:  # A document's own tokens, shifted inside the document only.
        np.testing.assert_array_equal(row['inputs'][at], doc[positions])
        np.testing.assert_array_equal(row['targets'][at], doc[positions + 1])
    assert row['segment_ids'].min() == 1  # Nothing padded.
    seen += 16
  assert seen == len(rows) * 16


def test_most_documents_per_row_counts_what_the_rows_hold():
  """From the index alone, equal to the segments the rows themselves carry; empty and one-token documents
  (no next-token pair) take no room, and a document starting exactly at a row boundary opens that row."""
  rng = np.random.default_rng(1)
  lengths = np.concatenate([rng.integers(0, 4, size=300), rng.integers(2, 40, size=100), [17, 17]])
  rng.shuffle(lengths)
  tokens = np.arange(lengths.sum(), dtype=np.int32)
  docs = data.documents.InMemoryDocuments(tokens, np.concatenate([[0], np.cumsum(lengths)[:-1]]), 'test')
  for seq_len in (8, 16, 64):
    rows = data.PackedRows(docs, seq_len)
    counts = [len(np.unique(rows[i]['segment_ids'])) for i in range(len(rows))]
    assert rows.most_documents_per_row() == (max(counts), counts.index(max(counts)))


def test_rows_with_more_documents_than_the_bound_fail_before_compile_naming_the_setting(tmp_path, token_docs):
  root = _prepare(tmp_path, token_docs)
  config = _config(source='array_record', path=str(root), packing=True, seq_len=64, max_documents_per_row=2)
  config.model.vocab_size = 300
  most, row = data.PackedRows(token_shards.load_documents(root, 'train'), 64).most_documents_per_row()
  assert most > 2
  with pytest.raises(UserError, match=rf'data.max_documents_per_row=2, but packed row {row} of the train split holds '
                                      rf'{most} documents. Set --config.data.max_documents_per_row={most} \(or more\)'):
    data.load_sources(config)
  config.data.max_documents_per_row = most
  assert len(data.load_sources(config).train) == len(data.PackedRows(token_shards.load_documents(root, 'train'), 64))


def test_array_record_source_trains_end_to_end_with_packing(tmp_path, launcher):
  text = {f'f{i}.txt': (f'document {i} ' * (40 + 9 * i)).encode() for i in range(20)}
  root = _prepare(tmp_path, text, '--glob=*.txt')
  workdir = tmp_path / 'run'
  result = launcher('--config=configs/tiny.py', f'--workdir={workdir}', '--config.data.source=array_record',
                    f'--config.data.path={root}', '--config.data.packing=True', '--config.train.steps=3')
  assert result.returncode == 0, result.stderr[-3000:]
  assert '20 train documents' in result.stderr and 'packed by document into rows of 32' in result.stderr
  records = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in records] == [1, 2, 3] and all(np.isfinite(r['loss']) for r in records)


def test_npz_images_and_labels_become_sharded_global_batches(tmp_path):
  images = np.arange(40 * 4 * 4 * 3, dtype=np.float32).reshape(40, 4, 4, 3)
  np.savez(tmp_path / 'set.npz', images=images, labels=np.arange(40) % 10)
  config = _config(source='arrays', path=str(tmp_path / 'set.npz'), eval_percent=10, image_shape=(4, 4, 3))
  sources = data.load_sources(config)
  assert len(sources.train) + len(sources.eval) == 40 and len(sources.eval) > 0
  mesh = mesh_lib.build_mesh(config.mesh)
  rules = sharding.rules_from_config(config.parallel)
  shardings = {'images': sharding.named_sharding(mesh, rules, ('batch', None, None, None)),
               'labels': sharding.named_sharding(mesh, rules, ('batch',))}
  batch = data.to_global(next(data.train_iterator(sources.train, config.data, 8, 0, 0, 1)), shardings, 1)
  assert batch['images'].shape == (8, 4, 4, 3) and batch['labels'].shape == (8,)
  assert len(batch['images'].sharding.device_set) == 8
  # Each label still belongs to its image: the row's first pixel value encodes the row index.
  rows = np.asarray(batch['images'])[:, 0, 0, 0].astype(int) // 48
  np.testing.assert_array_equal(np.asarray(batch['labels']), rows % 10)


def test_synthetic_tokens_have_the_configured_shape_and_repeat_exactly():
  config = _config(source='synthetic')
  batches = [next(data.train_iterator(data.load_sources(config).train, config.data, 8, 0, 0, 1)) for _ in range(2)]
  assert batches[0]['inputs'].shape == (8, 32) and batches[0]['inputs'].max() < config.model.vocab_size
  np.testing.assert_array_equal(batches[0]['inputs'], batches[1]['inputs'])
  np.testing.assert_array_equal(batches[0]['inputs'][:, 1:], batches[0]['targets'][:, :-1])


# ---- bad input: one UserError naming the file and the fix ------------------------------------------------


def _shards_error(config, load=lambda config: data.build(config.data, data.Needs.of(config.model, config.train), None,
                                                         0, 1)) -> str:
  with pytest.raises(UserError) as e:
    load(config)
  return str(e.value)


def test_missing_shard_folder(tmp_path):
  message = _shards_error(_config(source='array_record', path=str(tmp_path / 'nowhere')))
  assert f"data.path='{tmp_path}/nowhere' does not exist" in message and 'prepare_data.py' in message


def test_empty_shard_folder(tmp_path):
  message = _shards_error(_config(source='array_record', path=str(tmp_path)))
  assert f"'{tmp_path}/meta.json' is missing" in message and 're-run scripts/prepare_data.py' in message


@pytest.mark.parametrize('damage', ['truncate', 'garbage'])
def test_corrupt_or_truncated_shard(tmp_path, token_docs, damage):
  root = _prepare(tmp_path, token_docs)
  shard = root / 'train-00001-of-00003.array_record'
  content = shard.read_bytes()
  shard.write_bytes(content[:len(content) // 2] if damage == 'truncate' else b'not an array record' * 50)
  message = _shards_error(_config(source='array_record', path=str(root)))
  assert f"shard '{shard}' is corrupt or truncated" in message and 're-run scripts/prepare_data.py' in message


def test_documents_shorter_than_two_tokens(tmp_path):
  root = tmp_path / 'shards'
  root.mkdir()
  token_shards.write_shards(root, {'train': [np.arange(50), np.array([7]), np.arange(40)]}, 256, 'bytes', 2)
  message = _shards_error(_config(source='array_record', path=str(root)))
  assert f"'{root}/train-00001-of-00002.array_record' record 0 holds 1 token(s)" in message
  assert 'needs at least 2 tokens' in message


def test_dataset_smaller_than_one_global_batch(tmp_path):
  root = _prepare(tmp_path, {'a.npy': np.arange(100, dtype=np.int32)})
  config = _config(source='array_record', path=str(root), packing=True)
  message = _shards_error(config)
  assert 'makes 3 examples, fewer than one global batch (train.batch_size=8)' in message
  assert f'from {root}' in message and 'lower data.seq_len or train.batch_size' in message


def test_npz_with_mismatched_lengths(tmp_path):
  np.savez(tmp_path / 'set.npz', images=np.zeros((10, 2, 2, 1)), labels=np.zeros(9))
  message = _shards_error(_config(source='arrays', path=str(tmp_path / 'set.npz')), data.load_sources)
  assert f"'{tmp_path}/set.npz': images has 10 rows but labels has 9" in message and 'equal length' in message


def test_arrays_source_is_refused_for_the_language_model(tmp_path):
  np.savez(tmp_path / 'set.npz', images=np.zeros((10, 2, 2, 1)), labels=np.zeros(10))
  message = _shards_error(_config(source='arrays', path=str(tmp_path / 'set.npz')))
  assert "model.name='llama' is a language model" in message


def test_vocabulary_larger_than_the_model(tmp_path):
  root = _prepare(tmp_path, {'a.npy': np.arange(1000, dtype=np.int32)})
  message = _shards_error(_config(source='array_record', path=str(root)))
  assert 'vocabulary of 1000 tokens but model.vocab_size=256' in message and 'model.vocab_size=1000' in message


@pytest.mark.parametrize('args, expected', [
    (['--input={tmp}/none'], "--input='{tmp}/none' is not a folder"),
    (['--input={tmp}', '--tokenizer={tmp}/tok.model'], 'sentencepiece package is not installed'),
    (['--input={tmp}', '--tokenizer={tmp}/tok.tiktoken'], "--tokenizer='{tmp}/tok.tiktoken' is not a tiktoken BPE "
                                                            "file (a base64 token and its rank per line"),
    (['--input={tmp}', '--output={tmp}'], "--output='{tmp}' is not empty"),
])
def test_prepare_data_errors_name_the_flag(tmp_path, args, expected):
  for name in ('tok.model', 'tok.tiktoken', 'a.txt'):
    (tmp_path / name).write_text('hello world')
  args = [a.format(tmp=tmp_path) for a in args]
  if not any(a.startswith('--output') for a in args):
    args.append(f'--output={tmp_path}/out')
  result = run_python([sys.executable, str(REPO / 'scripts/prepare_data.py'), *args], timeout=600)
  assert result.returncode == 2 and result.stderr.startswith('prepare_data.py: error: '), result.stderr
  assert expected.format(tmp=tmp_path) in result.stderr
