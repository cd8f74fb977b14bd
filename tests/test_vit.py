"""The ViT classifier: shapes and dtypes, logical names on every parameter, scanned == unrolled blocks, remat
changes nothing but memory, the base preset's size without allocating it, it learns synthetic images, and each
bad setting ends in one UserError naming the key."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import base, vit_base, vit_tiny
from parallel import mesh as mesh_lib
from trainer.base.errors import UserError
from trainer.data import arrays
from trainer.models import layer_scan, vit

RULE_NAMES = {name for name, _ in base.get_config().parallel.logical_axis_rules}


def _config(**model):
  """vit_tiny shrunk to a few thousand parameters on 8x8x3 images."""
  c = vit_tiny.get_config()
  c.data.image_shape = (8, 8, 3)
  c.model.update(dict(num_layers=2, d_model=16, num_heads=2, mlp_dim=32, num_classes=4, patch_size=4) | model)
  return c


def _build(config, seed=0):
  with nnx.use_eager_sharding(False):
    return vit.ViT(config, rngs=nnx.Rngs(seed))


def _abstract(config):
  with nnx.use_eager_sharding(False):
    return nnx.eval_shape(lambda: vit.ViT(config, rngs=nnx.Rngs(0)))


@pytest.fixture(scope='module')
def initial() -> dict:
  """One real initialization of the unrolled tiny model, as a pure dict: every init compiles for seconds, so the
  tests below load these values into the variants they compare instead of initializing each."""
  return nnx.to_pure_dict(nnx.state(_build(_config(scan_layers=False)), nnx.Param))


def _with_random_head(pure: dict) -> dict:
  """A copy with a nonzero head (it starts at zero), so gradients reach every block."""
  head = dict(pure['head'], kernel=jax.random.normal(jax.random.key(3), pure['head']['kernel'].shape) * 0.5)
  return dict(pure, head=head)


def _model(config, pure: dict):
  """The model `config` describes holding the unrolled parameters `pure` (stacked per layer when scanned)."""
  if layer_scan.scans(config.model):
    blocks = [pure['blocks'][i] for i in range(config.model.num_layers)]
    pure = dict(pure, blocks=jax.tree.map(lambda *rows: jnp.stack(rows), *blocks))
  graphdef, state = nnx.split(_abstract(config))
  nnx.replace_by_pure_dict(state, pure)
  return nnx.merge(graphdef, state)


def _images(config, batch=4, seed=1):
  return jax.random.uniform(jax.random.key(seed), (batch, *config.data.image_shape), jnp.float32)


LABELS = jnp.array([0, 1, 2, 3])


def _forward(model, images):
  """The model's logits, jitted: op-by-op eager dispatch of a whole ViT is far slower than one compile."""
  graphdef, state = nnx.split(model)
  return jax.jit(lambda state, images: nnx.merge(graphdef, state)(images))(state, images)


def _loss_and_grads(model, images, labels=LABELS):
  graphdef, params = nnx.split(model, nnx.Param)

  def loss(params):
    logits = nnx.merge(graphdef, params)(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = jax.jit(jax.value_and_grad(loss))(params)
  return loss, nnx.to_pure_dict(grads)


def _params(model) -> dict:
  """Every nnx.Param as path -> Variable."""
  return {'/'.join(map(str, path)): v for path, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}


def test_forward_gives_float32_logits_per_image(initial):
  config = _config(scan_layers=True)
  logits = _forward(_model(config, initial), _images(config))
  assert logits.shape == (4, 4) and logits.dtype == jnp.float32
  # The head starts at zero, so every class starts at equal odds.
  np.testing.assert_allclose(np.asarray(logits), 0.0, atol=1e-6)


def test_bfloat16_compute_still_gives_float32_logits(initial):
  config = _config(scan_layers=True)
  config.train.compute_dtype = 'bfloat16'
  model = _model(config, _with_random_head(initial))
  assert model.blocks.attention.query.dtype == jnp.bfloat16
  logits = np.asarray(_forward(model, _images(config)))
  assert logits.dtype == np.float32 and np.all(np.isfinite(logits)) and np.ptp(logits) > 0


@pytest.mark.parametrize('scan_layers', [False, True])
def test_every_param_has_logical_names_from_the_rules(scan_layers):
  params = _params(_abstract(_config(scan_layers=scan_layers)))
  assert len(params) == (2 * 16 + 7 if not scan_layers else 16 + 7)
  for path, param in params.items():
    names = param.get_metadata().get('out_sharding')
    assert names is not None and len(names) == param.ndim, (path, names, param.shape)
    assert set(names) <= RULE_NAMES, (path, names)
  if scan_layers:  # Stacked block parameters lead with the 'layers' axis, one row per block.
    assert params['blocks/attention/query/kernel'].get_metadata()['out_sharding'] == (
        'layers', 'embed', 'heads', 'head_dim')
    assert params['blocks/attention/query/kernel'].shape == (2, 16, 2, 8)
  else:
    assert params['blocks/1/mlp/down/kernel'].get_metadata()['out_sharding'] == ('mlp', 'embed')
  assert params['patch_embed/kernel'].get_metadata()['out_sharding'] == ('patch', 'embed')
  assert params['head/kernel'].get_metadata()['out_sharding'] == ('embed', 'classes')


@pytest.fixture(scope='module')
def scanned_reference(initial):
  """Loss and gradients of the scanned model without remat."""
  config = _config(scan_layers=True)
  return _loss_and_grads(_model(config, _with_random_head(initial)), _images(config))


def test_scanned_blocks_match_unrolled_blocks_forward_and_backward(initial, scanned_reference):
  params, images = _with_random_head(initial), _images(_config())
  scanned, unrolled = _model(_config(scan_layers=True), params), _model(_config(scan_layers=False), params)
  np.testing.assert_allclose(np.asarray(_forward(scanned, images)), np.asarray(_forward(unrolled, images)), atol=1e-6)
  (loss_s, grads_s), (loss_u, grads_u) = scanned_reference, _loss_and_grads(unrolled, images)
  np.testing.assert_allclose(loss_s, loss_u, rtol=1e-6)
  assert loss_s > 0.1  # A real loss, so the gradients compared below are not all zero.
  for i in range(2):
    for a, b in zip(jax.tree.leaves(jax.tree.map(lambda a: a[i], grads_s['blocks'])),
                    jax.tree.leaves(grads_u['blocks'][i])):
      np.testing.assert_allclose(a, b, atol=1e-5)
      assert np.abs(np.asarray(b)).max() > 0
  np.testing.assert_allclose(grads_s['patch_embed']['kernel'], grads_u['patch_embed']['kernel'], atol=1e-5)


@pytest.mark.parametrize('policy', list(vit.REMAT_POLICIES))
def test_remat_policies_give_the_same_loss_and_gradients(policy, initial, scanned_reference):
  config = _config(scan_layers=True)
  config.train.remat_policy = policy
  loss, grads = _loss_and_grads(_model(config, _with_random_head(initial)), _images(config))
  loss_ref, grads_ref = scanned_reference
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_remat_wraps_each_unrolled_block(initial):
  config = _config(scan_layers=False)
  config.train.remat_policy = 'full'
  graphdef, params = nnx.split(_model(config, _with_random_head(initial)), nnx.Param)
  images = _images(config)
  jaxpr = str(jax.make_jaxpr(lambda p: nnx.merge(graphdef, p)(images))(params))
  assert jaxpr.count('remat2[') == 2  # One checkpoint per block; the numbers are checked scanned, above.


def test_on_a_2x2x2_mesh_parameters_shard_by_name_and_logits_match(initial):
  config = _config(scan_layers=True)
  config.mesh.update(data=2, fsdp=2, tensor=2)
  mesh, rules = mesh_lib.build_mesh(config.mesh), tuple(config.parallel.logical_axis_rules)
  images = _images(config, batch=8)
  expected = _forward(_model(config, initial), images)
  with nnx.use_eager_sharding(False):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: vit.ViT(config, rngs=nnx.Rngs(0), mesh=mesh, rules=rules)))
  nnx.replace_by_pure_dict(state, nnx.to_pure_dict(nnx.state(_model(config, initial))))
  state = jax.tree.map(
      lambda v: v.replace(jax.device_put(v[...], NamedSharding(mesh, nn.logical_to_mesh_axes(
          v.get_metadata()['out_sharding'], rules)))), state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  assert state['blocks']['attention']['query']['kernel'][...].sharding.spec == P(None, 'fsdp', 'tensor', None)
  images = jax.device_put(images, NamedSharding(mesh, P(('data', 'fsdp'))))
  logits = jax.jit(lambda state, images: nnx.merge(graphdef, state)(images))(state, images)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5)


@pytest.mark.parametrize('preset, expected', [(vit_tiny, 1_205_642), (vit_base, 86_566_120)])
def test_preset_parameter_counts_without_allocating(preset, expected):
  leaves = jax.tree.leaves(nnx.state(_abstract(preset.get_config()), nnx.Param))
  assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
  assert sum(leaf.size for leaf in leaves) == expected  # ViT-B/16 without a class token: 86.6M.


def _synthetic_batch(source, start, size):
  examples = [source[i] for i in range(start, start + size)]
  return tuple(jnp.asarray(np.stack([e[key] for e in examples])) for key in ('images', 'labels'))


def test_a_few_adam_steps_learn_synthetic_images_and_generalize(initial):
  graphdef, params = nnx.split(_model(_config(scan_layers=True), initial))
  train = arrays.SyntheticImages((8, 8, 3), 4, seed=0, template_seed=0)
  held_out = arrays.SyntheticImages((8, 8, 3), 4, seed=1, template_seed=0)
  optimizer = optax.adam(1e-2)

  @jax.jit
  def step(params, opt_state, images, labels):
    def loss_fn(params):
      logits = nnx.merge(graphdef, params)(images)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, losses = optimizer.init(params), []
  for i in range(40):  # Fresh examples every step: the model learns the classes, not the examples.
    params, opt_state, loss = step(params, opt_state, *_synthetic_batch(train, 16 * i, 16))
    losses.append(float(loss))
  assert losses[0] == pytest.approx(np.log(4), rel=1e-3)
  assert np.mean(losses[-5:]) < 0.4 * losses[0], losses
  images, labels = _synthetic_batch(held_out, 0, 64)
  accuracy = float(np.mean(np.argmax(np.asarray(_forward(nnx.merge(graphdef, params), images)), -1) == labels))
  assert accuracy > 0.75, accuracy  # Chance is 0.25.


# ---- bad settings: one UserError naming the key and the fix ------------------------------------------------


@pytest.mark.parametrize('change, expected', [
    (lambda c: c.model.update(num_heads=3), ['model.d_model=16 does not divide by model.num_heads=3',
                                             '--config.model.num_heads=2']),
    (lambda c: c.model.update(patch_size=3), ['data.image_shape=(8, 8, 3)', 'model.patch_size=3']),
    (lambda c: c.model.update(num_classes=1), ['model.num_classes=1 must be at least 2']),
    (lambda c: c.data.update(image_shape=(8, 8)), ['data.image_shape=(8, 8) must be 3 positive integers']),
    (lambda c: c.train.update(remat_policy='save_qkv_proj'), ["train.remat_policy='save_qkv_proj'", 'Llama']),
    (lambda c: c.train.update(remat_policy='everything'), ["train.remat_policy='everything' is unknown"]),
])
def test_bad_settings_raise_one_user_error(change, expected):
  config = _config()
  change(config)
  with pytest.raises(UserError) as e:
    _build(config)
  for text in expected:
    assert text in str(e.value)


def test_images_of_another_shape_than_configured_are_refused():
  graphdef, state = nnx.split(_abstract(_config()))
  with pytest.raises(UserError, match=r'data.image_shape=\(8, 8, 3\) but got images of shape \(12, 12, 3\)'):
    jax.eval_shape(lambda state, images: nnx.merge(graphdef, state)(images), state, jnp.zeros((2, 12, 12, 3)))
