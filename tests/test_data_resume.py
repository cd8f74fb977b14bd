"""Exact resume of the data position (through a real checkpoint, with workers and prefetch, across process counts),
the packed-batch contract in the model and loss, and the data-wait warning."""

import hashlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import logging as absl_logging

from configs import tiny
from trainer import data
from trainer.training import checkpoint
from conftest import ApplyTask
from trainer.base.errors import UserError
from trainer.models.llama import build as build_model


def _hash(batch) -> str:
  return hashlib.sha256(b''.join(batch[k].tobytes() for k in sorted(batch))).hexdigest()


@pytest.fixture(scope='module')
def source():
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 256, size=40_000, dtype=np.uint8)
  starts = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 40_000), size=60, replace=False))])
  return data.PackedRows(data.documents.InMemoryDocuments(tokens, starts, 'test'), seq_len=32)


def _iterator(source, process_index=0, process_count=1, batch_size=8, **overrides):
  config = tiny.get_config().data
  config.update(overrides)
  return data.train_iterator(source, config, batch_size, 0, process_index, process_count)


def _take(it, n):
  return [next(it) for _ in range(n)]


@pytest.mark.parametrize('worker_count, prefetch', [(0, 0), (1, 2)])
def test_resume_from_a_checkpoint_sees_exactly_the_same_batches(source, tmp_path, worker_count, prefetch):
  it = _iterator(source, worker_count=worker_count, prefetch=prefetch)
  _take(it, 3)  # Steps 1..3; workers and the prefetch thread have read further ahead than that.
  ckpt = checkpoint.Checkpointer(str(tmp_path), tiny.get_config().ckpt)
  state = {'w': jnp.arange(4.0)}
  ckpt.save(3, state, it, {'model': {}}, force=True)
  expected = [_hash(b) for b in _take(it, 5)]  # Steps 4..8 of the uninterrupted run.
  resumed = _iterator(source, worker_count=worker_count, prefetch=prefetch)
  ckpt.restore(3, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state), resumed)
  ckpt.close()
  assert [_hash(b) for b in _take(resumed, 5)] == expected


def _rows(batches) -> list[bytes]:
  return [row.tobytes() for b in batches for row in b['inputs']]


@pytest.mark.parametrize('before, after', [(2, 1), (1, 2), (2, 4)])
def test_another_process_count_continues_without_repeating_or_skipping(source, before, after):
  k, n = 3, 4
  saved = [_iterator(source, i, before) for i in range(before)]
  first_rows = [_rows(_take(it, k)) for it in saved]
  states = [it.get_state() for it in saved]
  assert all(s == states[0] for s in states) and states[0]['examples_consumed'] == k * 8
  resumed = [_iterator(source, i, after) for i in range(after)]
  for it in resumed:
    it.set_state(states[0])
  later_rows = [_rows(_take(it, n)) for it in resumed]
  uninterrupted = _rows(_take(_iterator(source), k + n))
  # Global batch j is the same set of rows whichever processes read it.
  for j in range(k):
    assert sorted(r for p in first_rows for r in p[j * 8 // before:(j + 1) * 8 // before]) == \
        sorted(uninterrupted[j * 8:(j + 1) * 8])
  for j in range(n):
    assert sorted(r for p in later_rows for r in p[j * 8 // after:(j + 1) * 8 // after]) == \
        sorted(uninterrupted[(k + j) * 8:(k + j + 1) * 8])


def test_a_position_from_another_data_order_is_refused(source):
  it = _iterator(source)
  state = dict(it.get_state(), seed=1)
  with pytest.raises(UserError, match=r'different data order \(seed: checkpoint 1 vs now 0\); resume with the data'):
    it.set_state(state)


@pytest.fixture(scope='module')
def model():
  """The tiny LM in float32, its parameters and one jitted apply shared by the tests (all calls are (2, 32))."""
  config = tiny.get_config()
  config.train.compute_dtype = 'float32'
  llama = build_model(config)
  params = jax.jit(llama.init)(jax.random.key(0), jnp.zeros((2, 32), jnp.int32))
  return llama, params, jax.jit(llama.apply)


def test_packed_documents_do_not_see_each_other(model):
  """Logits of a document inside a packed row equal those of the document run alone."""
  _, params, apply = model
  rng = np.random.default_rng(1)
  doc_a, doc_b = rng.integers(0, 256, 11), rng.integers(0, 256, 21)
  row = np.concatenate([doc_a, doc_b])
  packed = apply(params, jnp.asarray([row, row]), segment_ids=jnp.asarray([[1] * 11 + [2] * 21] * 2),
                 positions=jnp.asarray([np.concatenate([np.arange(11), np.arange(21)])] * 2))[0]
  # Each document alone at the start of a row (the rest is filler a causal model cannot see); then the row unmasked.
  alone_a, alone_b = apply(params, jnp.asarray([np.pad(doc_a, (0, 21)), np.pad(doc_b, (0, 11))]))
  np.testing.assert_allclose(packed[11:], alone_b[:21], atol=1e-4)
  np.testing.assert_allclose(packed[:11], alone_a[:11], atol=1e-4)
  # Without the mask, document b would see document a: the test can tell the difference.
  unmasked = apply(params, jnp.asarray([row, row]))[0]
  assert np.abs(unmasked[11:] - alone_b[:21]).max() > 1e-2


def test_padding_is_left_out_of_the_loss(model):
  llama, params, apply = model
  loss_fn = jax.jit(ApplyTask(llama.apply).loss)
  tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 32)), jnp.int32)
  segments = jnp.asarray([[1] * 20 + [0] * 12, [1] * 32], jnp.int32)
  batch = {'inputs': tokens, 'targets': jnp.roll(tokens, -1, 1), 'segment_ids': segments,
           'positions': jnp.broadcast_to(jnp.arange(32), (2, 32))}
  loss, _ = loss_fn(params['params'], batch)
  changed = dict(batch, targets=batch['targets'].at[0, 20:].set(0))  # Padding targets cannot matter.
  assert float(loss_fn(params['params'], changed)[0]) == pytest.approx(float(loss), rel=1e-6)
  logits = apply(params, tokens, segment_ids=segments, positions=batch['positions'])
  per_token = -jax.nn.log_softmax(logits)[jnp.arange(2)[:, None], jnp.arange(32)[None], batch['targets']]
  assert float(loss) == pytest.approx(float(per_token[segments != 0].mean()), rel=1e-5)


def test_data_wait_warning_names_the_knobs(caplog, monkeypatch):
  caplog.set_level(logging.WARNING)
  # absl logs it at most once per 300 s per call site: a run earlier in this test process may have used that up.
  monkeypatch.setattr(absl_logging, '_log_timer_per_token', {})
  assert not data.warn_if_stalled(10, {'data_wait_s': 0.009, 'step_time_s': 0.1})  # 9%: under the share.
  assert not data.warn_if_stalled(1, {'data_wait_s': 0.5, 'step_time_s': 1.0})  # Step 1 starts the workers.
  # The tiny config's steps on a loaded machine: 26% of a 29 ms step, but 7.7 ms that no data.* knob wins back.
  assert not data.warn_if_stalled(10, {'data_wait_s': 0.0077, 'step_time_s': 0.0289})
  assert not data.warn_if_stalled(10, {'data_wait_s': 0.019, 'step_time_s': 0.03})
  # The busy machine of issue 55: 82% of a 28 ms step, for batches the device feed had ready: the host, not the data.
  assert not data.warn_if_stalled(10, {'data_wait_s': 0.023, 'step_time_s': 0.028}, ready_share=0.9)
  assert data.warn_if_stalled(10, {'data_wait_s': 0.05, 'step_time_s': 0.2}, ready_share=0.1)
  [message] = [r.getMessage() for r in caplog.records if 'waiting for input' in r.getMessage()]
  assert 'took 25% of the step time (50.0 ms of 200.0 ms)' in message
  assert all(knob in message for knob in ('data.worker_count', 'data.prefetch', 'data.num_threads'))


@pytest.mark.parametrize('override, expected', [
    ({'worker_count': -1}, 'data.worker_count=-1 must be an integer >= 0'),
    ({'source': 'parquet'}, "data.source='parquet': choose one of"),
    ({'source': 'synthetic', 'packing': True}, "data.packing=True packs documents of tokens; data.source='synthetic'"),
])
def test_bad_data_settings_name_the_key(override, expected):
  config = tiny.get_config().data
  config.update(override)
  with pytest.raises(UserError, match=expected.replace('(', r'\(').replace(')', r'\)')):
    data.check_config(config)
