"""train.loss_chunks: the LM loss made a slice of positions at a time equals the whole-logits loss, in less memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny, vit_tiny
from trainer.base.errors import UserError
from trainer.run import job as job_lib
from trainer.training import task as task_lib
from trainer.training import validation


def _config(chunks: int, tie: bool = True, z_loss: float = 0.0, dtype: str = 'float32', packing: bool = False):
  c = tiny.get_config()
  c.model.vocab_size, c.model.num_layers = 512, 1  # One block: the loss is what differs.
  c.model.tie_embeddings = tie
  c.train.loss_chunks = chunks
  c.train.z_loss_weight = z_loss
  c.train.compute_dtype = dtype
  c.data.packing = packing
  return c


def _batch(config, seed=0):
  b, l = config.train.batch_size, config.data.seq_len
  tokens = jax.random.randint(jax.random.key(seed), (b, l + 1), 0, config.model.vocab_size, jnp.int32)
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}
  if config.data.packing:  # Two documents per row, then padding (segment 0) that the loss must not count.
    segment_ids = np.zeros((b, l), np.int32)
    segment_ids[:, :l // 2], segment_ids[:, l // 2:l - 5] = 1, 2
    positions = np.where(np.arange(l) < l // 2, np.arange(l), np.arange(l) - l // 2) * (segment_ids > 0)
    batch.update(segment_ids=jnp.asarray(segment_ids), positions=jnp.asarray(positions, jnp.int32))
  return batch


def _loss_metrics_grads(config, params, batch):
  task = task_lib.build_task(config)
  (loss, metrics), grads = jax.jit(jax.value_and_grad(task.loss, has_aux=True))(params, batch)
  return loss, metrics, grads


@pytest.mark.parametrize('tie,z_loss,packing', [(True, 0.0, False), (False, 1e-2, True)])
def test_chunked_loss_and_gradients_equal_the_whole_logits_ones(tie, z_loss, packing):
  whole = _config(1, tie, z_loss, packing=packing)
  params = jax.jit(task_lib.build_task(whole).model.init)(jax.random.key(1))
  batch = _batch(whole)
  expected = _loss_metrics_grads(whole, params, batch)
  got = _loss_metrics_grads(_config(4, tie, z_loss, packing=packing), params, batch)
  assert float(got[0]) == pytest.approx(float(expected[0]), rel=1e-6)
  assert set(got[1]) == set(expected[1]) == ({'loss', 'z_loss'} if z_loss else {'loss'})
  for key in expected[1]:
    assert float(got[1][key]) == pytest.approx(float(expected[1][key]), rel=1e-5)
  leaves = jax.tree.leaves_with_path(expected[2])
  assert any('head' in jax.tree_util.keystr(p) for p, _ in leaves) != tie  # The untied head gets its gradient.
  for (path, want), have in zip(leaves, jax.tree.leaves(got[2])):
    np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-5, atol=1e-7,
                               err_msg=jax.tree_util.keystr(path))


def test_a_brought_nnx_model_offering_its_head_and_accumulated_microbatches_give_the_same_numbers():
  from trainer.training import step as step_lib
  whole = _config(1)
  whole.model.name = 'tests.custom_models:MlpLMWithHead'
  task = task_lib.build_task(whole)
  params, batch = jax.jit(task.model.init)(jax.random.key(1)), _batch(whole)
  expected = _loss_metrics_grads(whole, params, batch)
  chunked = _config(4)
  chunked.model.name = whole.model.name
  got = _loss_metrics_grads(chunked, params, batch)
  assert float(got[0]) == pytest.approx(float(expected[0]), rel=1e-6)
  accumulated, _ = jax.jit(lambda p, b: step_lib.grads_and_metrics(
      p, b, task_lib.build_task(chunked), step_lib.StepOptions(grad_accum_steps=2)))(params, batch)
  for want, have, summed in zip(*map(jax.tree.leaves, (expected[2], got[2], accumulated))):
    np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(summed), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_chunked_loss_in_bfloat16_stays_within_bfloat16_of_the_whole_logits_one():
  whole = _config(1, tie=False, dtype='bfloat16')
  params = jax.jit(task_lib.build_task(whole).model.init)(jax.random.key(1))
  batch = _batch(whole)
  expected = _loss_metrics_grads(whole, params, batch)
  got = _loss_metrics_grads(_config(8, tie=False, dtype='bfloat16'), params, batch)
  assert float(got[0]) == pytest.approx(float(expected[0]), rel=1e-2)
  for want, have in zip(jax.tree.leaves(expected[2]), jax.tree.leaves(got[2])):
    scale = float(jnp.max(jnp.abs(want))) or 1.0
    assert float(jnp.max(jnp.abs(have - want))) <= 3e-2 * scale


def test_chunks_keep_the_logits_out_of_the_compiled_steps_memory():
  """Vocabulary-heavy toy: whole float32 logits are 8 x 256 x 8192 x 4 B = 64 MiB, and their gradient as much."""
  def temp_bytes(chunks):
    c = _config(chunks)
    c.model.vocab_size, c.data.seq_len, c.model.num_layers = 8192, 256, 1
    c.data.source = 'synthetic'
    compiled = job_lib.build_job(c, jax.devices()[:1]).compile_train_step()
    return compiled.memory_analysis().temp_size_in_bytes

  logits_bytes = 8 * 256 * 8192 * 4
  whole, chunked = temp_bytes(1), temp_bytes(8)
  assert whole > 2 * logits_bytes  # The logits and their gradient are both live in the whole-logits step.
  assert chunked < whole - logits_bytes, (whole, chunked)


def test_bad_chunk_settings_stop_before_compile_with_one_line():
  config = _config(5)
  with pytest.raises(UserError, match=r'train.loss_chunks=5 must divide data.seq_len=32; choose one of \[2, 4, 8, 16, '
                                      r'32\]'):
    validation.validate_config(config)
  config = _config(0)
  with pytest.raises(UserError, match='train.loss_chunks=0 must be an integer >= 1'):
    validation.validate_config(config)
  images = vit_tiny.get_config()
  images.train.loss_chunks = 2
  with pytest.raises(UserError, match="model.task='classifier' has none: set --config.train.loss_chunks=1"):
    validation.validate_config(images)


def test_a_model_that_cannot_hand_over_its_hidden_states_is_refused_by_name():
  config = _config(2)
  config.model.name = 'tests.custom_models:MlpLM'
  with pytest.raises(UserError, match=r"train.loss_chunks=2 needs a model whose __call__ takes hidden_and_head=True "
                                      r".*MlpLM \(model.name='tests.custom_models:MlpLM'\) does not"):
    task_lib.build_task(config)
  config.model.name = 'tests.custom_models:MlpLMWithOwnLoss'
  with pytest.raises(UserError, match="computes its own .* set --config.train.loss_chunks=1"):
    task_lib.build_task(config)
