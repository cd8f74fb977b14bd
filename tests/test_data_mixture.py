"""Weighted mixtures (data.source='mixture'): shares, stages, exact resume (also with changed weights and on
another mesh), and the one-line refusals of bad mixtures."""

import json
import shutil
import sys

import numpy as np
import pytest

from configs import tiny
from conftest import REPO
from parallel import mesh as mesh_lib
from parallel import sharding
from trainer import data
from trainer.base.errors import UserError
from trainer.data import mixture, pipeline, token_shards

sys.path.insert(0, str(REPO / 'scripts'))
import prepare_data  # noqa: E402

NAMES = ('web', 'code', 'math')
BAND = 80  # Source k's tokens lie in [k*BAND, (k+1)*BAND): every row says which source it came from.


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp('mixture')
  rng = np.random.default_rng(0)
  paths = []
  for k, name in enumerate(NAMES):
    docs = [rng.integers(k * BAND, (k + 1) * BAND, size=int(rng.integers(5, 60))) for _ in range(40 + 30 * k)]
    (root / name).mkdir()
    token_shards.write_shards(root / name, {'train': docs[4:], 'eval': docs[:4]}, 256, 'bytes', 2)
    paths.append(str(root / name))
  return paths


def _config(folders, weights=(0.7, 0.2, 0.1), stages=(), batch_size=8, **overrides):
  config = tiny.get_config()
  config.data.source = 'mixture'
  config.data.mixture = tuple(zip(folders, weights))
  config.data.mixture_stages = stages
  config.data.packing = True
  config.data.seq_len = 16
  config.data.prefetch = 0
  config.train.batch_size = batch_size
  config.data.update(overrides)
  return config


def _source_of(rows: np.ndarray) -> np.ndarray:
  bands = rows // BAND
  assert (bands == bands[:, :1]).all()  # A row never mixes sources.
  return bands[:, 0]


def _take(it, n):
  return [next(it) for _ in range(n)]


def _sources(batches) -> np.ndarray:
  return np.concatenate([_source_of(b['inputs']) for b in batches])


def test_shares_follow_the_weights_and_the_stages(folders):
  stage_step = 1250  # 10,000 rows at the first weights, then 4,000 at the second.
  config = _config(folders, stages=((stage_step, (0.1, 0.3, 0.6)),))
  it = data.train_iterator_for(config)
  drawn = _sources(_take(it, stage_step + 500))
  first, second = drawn[:stage_step * 8], drawn[stage_step * 8:]
  assert len(first) == 10_000
  np.testing.assert_allclose(np.bincount(first, minlength=3) / len(first), (0.7, 0.2, 0.1), atol=0.01)
  np.testing.assert_allclose(np.bincount(second, minlength=3) / len(second), (0.1, 0.3, 0.6), atol=0.01)
  # The running tally the accounting reads agrees with the rows drawn.
  assert it.source_rows().tolist() == np.bincount(drawn, minlength=3).tolist()


def _per_source_orders(config, folders):
  """Each source's own rows in its own shuffled, repeated order: what a mixture must take them in."""
  sources = data.load_sources(config).mixed
  return [pipeline.global_examples(s.train, config.train.seed + k) for k, s in enumerate(sources)]


def _check_no_repeat_or_skip(batches, orders):
  """The rows each source gave, in order, are exactly the first rows of that source's own order."""
  rows = [row for b in batches for row in b['inputs']]
  for k, order in enumerate(orders):
    mine = [r for r in rows if r[0] // BAND == k]
    assert [r.tobytes() for r in mine] == [order[i]['inputs'].tobytes() for i in range(len(mine))], NAMES[k]


@pytest.mark.parametrize('worker_count', [0, 1])
def test_resume_gives_the_batches_of_an_uninterrupted_run_across_a_stage(folders, worker_count):
  config = _config(folders, stages=((5, (0.2, 0.2, 0.6)), (9, (0.5, 0.5, 0.0))), worker_count=worker_count)
  whole = _take(data.train_iterator_for(config), 14)
  first = data.train_iterator_for(config)
  _take(first, 4)
  state = json.loads(json.dumps(first.get_state()))  # What the checkpoint's JSON item holds.
  first.close()
  resumed = data.train_iterator_for(config)
  resumed.set_state(state)
  later = _take(resumed, 10)
  resumed.close()
  for a, b in zip(whole[4:], later):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  _check_no_repeat_or_skip(whole, _per_source_orders(config, folders))


def test_changed_weights_on_relaunch_continue_each_source_where_it_stopped(folders):
  config = _config(folders)
  before = data.train_iterator_for(config)
  head = _take(before, 6)
  state = before.get_state()
  changed = _config(folders, weights=(0.1, 0.1, 0.8))
  after = data.train_iterator_for(changed)
  after.set_state(state)
  tail = _take(after, 30)
  assert after.segments[-1] == mixture.Segment(48, (0.1, 0.1, 0.8), tuple(before.source_rows().tolist()))
  np.testing.assert_allclose(np.bincount(_sources(tail), minlength=3) / 240, (0.1, 0.1, 0.8), atol=0.01)
  _check_no_repeat_or_skip(head + tail, _per_source_orders(config, folders))
  # And a further relaunch with those same new weights is exact again.
  again = data.train_iterator_for(changed)
  again.set_state(after.get_state())
  np.testing.assert_array_equal(next(again)['inputs'], next(after)['inputs'])


def test_the_next_global_batch_is_the_same_on_another_mesh_and_process_split(folders):
  """Saved on a mesh with data=8, resumed with data=2 x fsdp=4 and with two processes: the same global batch."""
  config = _config(folders, stages=((3, (0.3, 0.3, 0.4)),))
  mesh_a = mesh_lib.build_mesh(config.mesh)
  config_b = _config(folders)
  config_b.mesh.data, config_b.mesh.fsdp = 2, 4
  mesh_b = mesh_lib.build_mesh(config_b.mesh)
  assert mesh_a.shape['data'] == 8 and mesh_b.shape['data'] == 2

  def global_batch(mesh, batch):
    rules = sharding.rules_from_config(config.parallel)
    shardings = {k: sharding.named_sharding(mesh, rules, ('batch', None)) for k in batch}
    return {k: np.asarray(v) for k, v in data.to_global(batch, shardings, 1).items()}

  it = data.train_iterator_for(config)
  _take(it, 2)
  state = it.get_state()
  expected = [global_batch(mesh_a, b) for b in _take(it, 3)]
  resumed = data.train_iterator_for(config)
  resumed.set_state(state)
  got = [global_batch(mesh_b, b) for b in _take(resumed, 3)]
  halves = [data.train_iterator_for(config, i, 2) for i in range(2)]
  for h in halves:
    h.set_state(state)
  split = [np.concatenate([next(h)['inputs'] for h in halves]) for _ in range(3)]
  for e, g, s in zip(expected, got, split):
    np.testing.assert_array_equal(e['inputs'], g['inputs'])
    assert sorted(r.tobytes() for r in s) == sorted(r.tobytes() for r in e['inputs'])


def test_the_data_line_gives_size_weight_and_epochs(folders):
  config = _config(folders, stages=((50, (0.5, 0.5, 0.0)),))
  config.train.steps = 100
  description = data.load_sources(config).description
  sources = data.load_sources(config).mixed
  web_rows = len(sources[0].train)
  # Steps 1-50 give web 0.7 of 400 rows, steps 51-100 half of 400: 480 rows.
  assert f'web ({folders[0]}: {web_rows} rows' in description
  assert f'weight 0.7, 0.5 from step 50; {480 / web_rows:.2f} epochs in 100 steps)' in description
  assert f'math ({folders[2]}' in description and 'weight 0.1, 0 from step 50' in description


@pytest.mark.parametrize('change, expected', [
    (dict(weights=(0.5, -0.1, 0.6)), 'data.mixture: weights (0.5, -0.1, 0.6) include a negative'),
    (dict(weights=(0, 0, 0)), 'data.mixture: weights (0, 0, 0) sum to 0'),
    (dict(stages=((10, (0.0, 0.0, 0.0)),)), 'data.mixture_stages step 10: weights (0.0, 0.0, 0.0) sum to 0'),
    (dict(stages=((10, (0.5, 0.5)),)), 'data.mixture_stages step 10: (0.5, 0.5) must be 3 numbers'),
    (dict(stages=((10, (1, 1, 1)), (5, (1, 1, 1)))), 'steps > 0 and increasing'),
])
def test_bad_weights_are_one_line_before_reading(folders, change, expected):
  with pytest.raises(UserError, match=expected.replace('(', r'\(').replace(')', r'\)')):
    data.check_config(_config(folders, **change).data)


def test_bad_sources_are_one_line(folders, tmp_path):
  (tmp_path / 'empty').mkdir()
  with pytest.raises(UserError, match=f"data.mixture source '{tmp_path}/empty': '{tmp_path}/empty/meta.json' is "
                                      f"missing"):
    data.load_sources(_config([folders[0], folders[1], str(tmp_path / 'empty')]))
  other = tmp_path / 'other'
  other.mkdir()
  token_shards.write_shards(other, {'train': [np.arange(300) % 290]}, 290, 'sentencepiece:x.model', 1)
  with pytest.raises(UserError, match='prepared with different tokenizers or vocabularies .*other: '
                                      r'sentencepiece:x.model \(290 tokens\)\); prepare every source'):
    data.load_sources(_config([folders[0], folders[1], str(other)]))
  with pytest.raises(UserError, match=r"names folders \['web', 'web', 'math'\]"):
    data.check_config(_config([folders[0], folders[0], folders[2]]).data)


def test_one_tokenizer_read_from_two_paths_mixes(tmp_path):
  """Sources prepared with copies of the same tokenizer.json at different paths mix; another tokenizer does not."""
  fixture = REPO / 'tests/fixtures/hf/tokenizer'
  copy = tmp_path / 'copy'
  shutil.copytree(fixture, copy)
  outs = []
  for name, tokenizer in (('one', fixture), ('two', copy)):
    (tmp_path / f'in_{name}').mkdir()
    (tmp_path / f'in_{name}' / 'a.txt').write_text('the quick brown fox jumps over the lazy dog ' * 30)
    prepare_data.main([f'--input={tmp_path / f"in_{name}"}', f'--output={tmp_path / name}', f'--tokenizer={tokenizer}',
                       '--eval_percent=0'])
    outs.append(str(tmp_path / name))
  config = _config(outs, weights=(0.5, 0.5))
  assert len(data.load_sources(config).mixed) == 2
  meta = json.loads((tmp_path / 'two' / 'meta.json').read_text())
  meta['tokenizer_sha256'] = '0' * 64  # Another tokenizer's files.
  (tmp_path / 'two' / 'meta.json').write_text(json.dumps(meta))
  with pytest.raises(UserError, match='prepared with different tokenizers or vocabularies'):
    data.load_sources(config)
