"""The text pipeline: split, per-process shards, resume position, and the errors for bad folders."""

import numpy as np
import pytest

from configs import tiny
from trainer import data
from trainer.base.errors import UserError
from trainer.data import text


def _windows(corpus, config, batch_size, process_index, process_count, seed=0):
  source = data.TextWindows(corpus.train_tokens, config.seq_len)
  data.pipeline.check_enough(source, batch_size, 'the train text', 'add text, or lower data.seq_len or train.batch_size.')
  return data.train_iterator(source, config, batch_size, seed, process_index, process_count)


def _data_config(text_dir, **overrides):
  config = tiny.get_config().data
  config.text_dir = str(text_dir)
  config.update(overrides)
  return config


@pytest.fixture
def text_dir(tmp_path):
  rng = np.random.default_rng(0)
  for i in range(40):
    (tmp_path / f'file_{i}.py').write_bytes(bytes(rng.integers(32, 127, size=500, dtype=np.uint8)))
  return tmp_path


def test_split_is_by_file_and_stable(text_dir):
  a = data.load_text_corpus(_data_config(text_dir, eval_percent=20))
  b = data.load_text_corpus(_data_config(text_dir, eval_percent=20))
  assert a.num_train_files + a.num_eval_files == 40 and a.num_eval_files > 0
  assert a.train_tokens.size == 500 * a.num_train_files
  np.testing.assert_array_equal(a.eval_tokens, b.eval_tokens)


def test_default_text_is_the_standard_library():
  config = _data_config('x')
  config.text_dir = None
  corpus = data.load_text_corpus(config)
  assert (corpus.root / 'os.py').exists()
  assert corpus.num_train_files > 100 and corpus.num_eval_files > 0


@pytest.mark.parametrize('file_glob', ['**/*.py', '*.py', '**/sub/*.py', 'a/**/*.py', '**/a/**/*.py', '**/*'])
def test_listing_keeps_what_one_glob_finds_outside_installed_packages(tmp_path, file_glob):
  for relative in ['top.py', 'a/one.py', 'a/b/two.py', 'a/sub/three.py', 'a/x/a/four.py', 'sub/five.py', 'notes.txt',
                   'site-packages/pkg/six.py', 'a/dist-packages/seven.py', 'elsewhere/eight.py']:
    (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / relative).write_text('x = 1\n')
  (tmp_path / 'linked').symlink_to(tmp_path / 'elsewhere')
  expected = sorted(p for p in tmp_path.glob(file_glob)
                    if p.is_file() and 'site-packages' not in p.parts and 'dist-packages' not in p.parts)
  assert expected, file_glob
  assert text._matching_files(tmp_path, file_glob) == expected


def test_windows_are_shifted_by_one(text_dir):
  corpus = data.load_text_corpus(_data_config(text_dir))
  example = data.TextWindows(corpus.train_tokens, 32)[3]
  np.testing.assert_array_equal(example['inputs'][1:], example['targets'][:-1])
  np.testing.assert_array_equal(example['inputs'], corpus.train_tokens[96:128])


def test_process_shards_partition_the_global_batch(text_dir):
  config = _data_config(text_dir)
  corpus = data.load_text_corpus(config)
  whole = next(_windows(corpus, config, 8, 0, 1))['inputs']
  halves = [next(_windows(corpus, config, 8, i, 2))['inputs'] for i in range(2)]
  assert all(h.shape == (4, config.seq_len) for h in halves)
  rows = lambda a: sorted(map(bytes, a.astype(np.uint8)))
  assert rows(np.concatenate(halves)) == rows(whole)
  assert not set(rows(halves[0])) & set(rows(halves[1]))


def test_iterator_state_resumes_exactly(text_dir):
  config = _data_config(text_dir)
  corpus = data.load_text_corpus(config)
  it = _windows(corpus, config, 8, 0, 1)
  for _ in range(3):
    next(it)
  state = it.get_state()
  expected = [next(it)['inputs'] for _ in range(3)]
  resumed = _windows(corpus, config, 8, 0, 1)
  resumed.set_state(state)
  for want in expected:
    np.testing.assert_array_equal(next(resumed)['inputs'], want)


def test_missing_folder_names_the_path(tmp_path):
  with pytest.raises(UserError, match=r"data.text_dir='.*nowhere' does not exist"):
    data.load_text_corpus(_data_config(tmp_path / 'nowhere'))


def test_folder_without_matching_files(tmp_path):
  (tmp_path / 'notes.md').write_text('hello')
  with pytest.raises(UserError, match=r"has no files matching data.file_glob='\*\*/\*.py'"):
    data.load_text_corpus(_data_config(tmp_path))


def test_empty_files(tmp_path):
  (tmp_path / 'a.py').write_text('')
  with pytest.raises(UserError, match='are empty'):
    data.load_text_corpus(_data_config(tmp_path, eval_percent=0))


def test_too_little_text_for_one_batch(tmp_path):
  (tmp_path / 'a.py').write_text('x = 1\n' * 20)
  config = _data_config(tmp_path)
  config = tiny.get_config()
  config.data.text_dir, config.train.batch_size = str(tmp_path), 64
  with pytest.raises(UserError, match=r'the train split \(1 train files .* makes 3 examples, fewer than one global '
                                      r'batch \(train.batch_size=64\); add data, or lower data.seq_len'):
    data.build(config.data, data.Needs.of(config.model, config.train), None, 0, 1)
