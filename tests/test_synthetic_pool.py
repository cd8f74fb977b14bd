"""Synthetic train batches come from a pool drawn once (trainer/data/synthetic_pool.py): drawing costs nothing per
step, and the position resumes exactly like any other source's."""

import numpy as np
import pytest

from configs import tiny
from trainer import data
from trainer.base.errors import UserError
from trainer.data import arrays, synthetic_pool


class _CountingTokens(arrays.SyntheticTokens):
  draws = 0

  def __getitem__(self, index):
    type(self).draws += 1
    return super().__getitem__(index)


def _iterator(source):
  return synthetic_pool.pooled_train_iterator(source, 8, 0, 0, 1, {'source': 'synthetic'})


def test_examples_are_drawn_once_for_the_pool_then_batches_cycle():
  source = _CountingTokens(seq_len=16, vocab_size=256, seed=0)
  it = _iterator(source)
  batches = [next(it) for _ in range(3 * synthetic_pool.POOL_BATCHES)]
  assert _CountingTokens.draws == 8 * synthetic_pool.POOL_BATCHES  # 48 steps, 16 batches' worth of examples drawn.
  assert batches[0]['inputs'].shape == (8, 16)
  distinct = {b['inputs'].tobytes() for b in batches}
  assert len(distinct) == synthetic_pool.POOL_BATCHES
  assert np.array_equal(batches[5]['inputs'], batches[5 + synthetic_pool.POOL_BATCHES]['inputs'])


def test_resume_continues_at_the_same_batch_and_another_pool_is_refused():
  source = arrays.SyntheticTokens(seq_len=16, vocab_size=256, seed=0)
  it = _iterator(source)
  for _ in range(20):
    next(it)
  state = it.get_state()
  expected = [next(it)['inputs'] for _ in range(3)]
  resumed = _iterator(source)
  resumed.set_state(state)
  assert all(np.array_equal(a, next(resumed)['inputs']) for a in expected)
  unpooled = data.train_iterator(source, tiny.get_config().data, 8, 0, 0, 1, {'source': 'synthetic'})
  with pytest.raises(UserError, match=r'different data order \(pool_batches_max: checkpoint None vs now 16\)'):
    resumed.set_state(unpooled.get_state())


def test_the_launchers_synthetic_source_is_pooled():
  config = tiny.get_config()
  config.data.source = 'synthetic'
  it = data.train_iterator_for(config)
  assert it.get_state()['pool_batches_max'] == synthetic_pool.POOL_BATCHES
