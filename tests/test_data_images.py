"""Data for classifiers: learnable synthetic images, .npz images checked against the config and given as float32,
and the source refused when it does not fit model.task."""

import numpy as np
import pytest

from configs import tiny, vit_tiny
from parallel import mesh as mesh_lib
from parallel import sharding
from trainer import data
from trainer.base.errors import UserError
from trainer.data import arrays
from trainer.run import job
from trainer.training import objectives


def _classifier(**data_overrides):
  config = vit_tiny.get_config()
  config.train.batch_size = 8
  config.train.eval_batches = 2
  config.data.update(data_overrides)
  return config


def _sharding(config):
  """The per-key batch shardings the Job gives a classifier's images and labels."""
  rules = sharding.rules_from_config(config.parallel)
  objective = objectives.for_config(config.model, config.data, config.train)
  return job.batch_shardings(mesh_lib.build_mesh(config.mesh), rules, objective.batch_shapes())


def _error(config, load=lambda config: data.build(config.data, data.Needs.of(config.model, config.train), None, 0,
                                                  1)) -> str:
  with pytest.raises(UserError) as e:
    load(config)
  return str(e.value)


def test_synthetic_images_are_a_pure_function_of_seed_and_index():
  source = arrays.SyntheticImages((6, 5, 3), 7, seed=0, template_seed=0)
  a, b = source[12], arrays.SyntheticImages((6, 5, 3), 7, seed=0, template_seed=0)[12]
  assert a['images'].shape == (6, 5, 3) and a['images'].dtype == np.float32 and a['labels'].dtype == np.int32
  np.testing.assert_array_equal(a['images'], b['images'])
  assert a['labels'] == b['labels']
  assert not np.array_equal(source[13]['images'], a['images'])
  held_out = arrays.SyntheticImages((6, 5, 3), 7, seed=1, template_seed=0)
  assert not np.array_equal(held_out[12]['images'], a['images'])
  labels = np.array([source[i]['labels'] for i in range(700)])
  assert labels.min() == 0 and labels.max() == 6 and np.bincount(labels).min() > 60  # Roughly uniform.


def test_synthetic_images_carry_their_class_in_both_splits():
  """Nearest class template (a mean over many examples) recovers the label on held-out images: learnable."""
  train = arrays.SyntheticImages((8, 8, 3), 5, seed=0, template_seed=0)
  held_out = arrays.SyntheticImages((8, 8, 3), 5, seed=1, template_seed=0)
  examples = [train[i] for i in range(500)]
  means = np.stack([np.mean([e['images'] for e in examples if e['labels'] == c], axis=0) for c in range(5)])
  np.testing.assert_allclose(means, np.stack([train.template(c) for c in range(5)]), atol=0.25)
  test = [held_out[i] for i in range(200)]
  guesses = [np.argmin(((means - e['images']) ** 2).sum(axis=(1, 2, 3))) for e in test]
  assert np.mean(np.array(guesses) == np.array([e['labels'] for e in test])) > 0.9


def test_classifier_with_synthetic_source_builds_image_batches():
  config = _classifier(source='synthetic')
  inputs = data.build(config.data, data.Needs.of(config.model, config.train), _sharding(config), 0, 1)
  batch = next(inputs.train)
  assert set(batch) == {'images', 'labels'}
  assert batch['images'].shape == (8, 32, 32, 3) and batch['images'].dtype == np.float32
  assert batch['labels'].shape == (8,) and batch['labels'].dtype == np.int32 and batch['labels'].max() < 10
  assert len(inputs.eval_batches) == 2 and inputs.eval_batches[0]['images'].shape == (8, 32, 32, 3)
  assert len(inputs.eval_batches[0]['images'].sharding.device_set) == 8
  assert 'synthetic images (32x32x3, 10 classes' in inputs.description
  # The held-out split is other examples of the same classes.
  assert not np.array_equal(np.asarray(inputs.eval_batches[0]['images']), batch['images'])


def test_uint8_npz_images_are_scaled_to_float32_in_unit_range(tmp_path):
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, size=(100, 32, 32, 3), dtype=np.uint8)
  images[:, 0, 0, 0] = np.arange(100)  # The row index, to check each label stays with its image.
  np.savez(tmp_path / 'set.npz', images=images, labels=np.arange(100) % 10)
  config = _classifier(source='arrays', path=str(tmp_path / 'set.npz'), eval_percent=20)
  inputs = data.build(config.data, data.Needs.of(config.model, config.train), _sharding(config), 0, 1)
  batch = next(inputs.train)
  assert batch['images'].dtype == np.float32 and batch['images'].shape == (8, 32, 32, 3)
  assert 0.0 <= batch['images'].min() and batch['images'].max() <= 1.0
  rows = np.rint(batch['images'][:, 0, 0, 0] * 255).astype(int)
  np.testing.assert_array_equal(batch['labels'], rows % 10)
  np.testing.assert_allclose(batch['images'][:, 1:, 1:], images[rows][:, 1:, 1:] / 255, rtol=1e-6)


# ---- bad input: one UserError naming the setting and the fix ------------------------------------------------


def test_images_of_another_shape_than_data_image_shape(tmp_path):
  np.savez(tmp_path / 'set.npz', images=np.zeros((20, 28, 28, 1), np.uint8), labels=np.zeros(20))
  message = _error(_classifier(source='arrays', path=str(tmp_path / 'set.npz')))
  assert 'holds images of shape (28, 28, 1) but data.image_shape=(32, 32, 3)' in message
  assert '--config.data.image_shape="(28, 28, 1)"' in message


@pytest.mark.parametrize('bad_label, shown', [(10, 'from 0 to 10'), (-1, 'from -1 to 9')])
def test_labels_outside_the_model_classes(tmp_path, bad_label, shown):
  labels = np.arange(20) % 10
  labels[3] = bad_label
  np.savez(tmp_path / 'set.npz', images=np.zeros((20, 32, 32, 3), np.float32), labels=labels)
  message = _error(_classifier(source='arrays', path=str(tmp_path / 'set.npz')))
  assert f'holds labels {shown} but model.num_classes=10 needs them in [0, 10)' in message


def test_language_model_refuses_arrays(tmp_path):
  np.savez(tmp_path / 'set.npz', images=np.zeros((10, 2, 2, 1)), labels=np.zeros(10))
  config = tiny.get_config()
  config.data.update(source='arrays', path=str(tmp_path / 'set.npz'))
  message = _error(config)
  assert "data.source='arrays' gives images and labels for classification, but model.task='lm'" in message
  assert "model.name='llama' is a language model" in message and "data.source='text'" in message


@pytest.mark.parametrize('source', ['text', 'array_record'])
def test_classifier_refuses_token_sources(source):
  message = _error(_classifier(source=source))
  assert f"data.source='{source}' gives tokens, but model.task='classifier'" in message
  assert '--config.data.source=arrays' in message and '--config.data.source=synthetic' in message


def test_classifier_needs_a_three_number_image_shape():
  message = _error(_classifier(source='synthetic', image_shape=(32, 32)))
  assert 'data.image_shape=(32, 32) must be 3 positive integers' in message


def test_language_model_batch_keys_are_unchanged():
  config = tiny.get_config()
  assert data.batch_keys(config.data) == ('inputs', 'targets')
  config.data.packing = True
  assert data.batch_keys(config.data) == ('inputs', 'targets', 'segment_ids', 'positions')
