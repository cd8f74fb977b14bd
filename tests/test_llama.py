"""The built-in Llama: grouped-query attention, tied embeddings, preset sizes, logical names, build() checks."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import configs.gpt2_124m
import configs.llama_1b
import configs.tiny
from parallel import mesh as mesh_lib
from trainer.base.errors import UserError
from trainer.models import layer_scan, llama
from trainer.run import job
from trainer.training import validation


def _config(**model):
  """configs/tiny.py with 4 heads of dim 8 (so there is room for 2 or 1 key/value heads) and `model` overrides."""
  c = configs.tiny.get_config()
  c.model.num_heads = 4
  for key, value in model.items():
    c.model[key] = value
  return c


def _init(model, seq_len: int = 16):
  """Random parameters of the model's shapes, and tokens: drawn with NumPy, since compiling init takes ~8 s on CPU."""
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 256, (2, seq_len)), jnp.int32)
  abstract = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), tokens))['params']
  params = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype), abstract)
  return params, tokens


def test_grouped_query_attention_is_multi_head_attention_with_each_kv_head_shared_by_its_group():
  gqa = llama.build(_config(num_kv_heads=2))
  params, tokens = _init(gqa)
  attention = params['layers']['attention']
  # 2 layers (scanned), d_model 32, 2 key/value heads of dim 8; queries keep all 4 heads.
  assert attention['key']['kernel'].shape == attention['value']['kernel'].shape == (2, 32, 2, 8)
  assert attention['query']['kernel'].shape == (2, 32, 4, 8)
  # The same weights as plain multi-head attention: query heads 0,1 read kv head 0 and heads 2,3 kv head 1.
  mha = llama.build(_config(num_kv_heads=0))
  mha_params = jax.tree.map(lambda x: x, params)
  for name in ('key', 'value'):
    mha_params['layers']['attention'][name]['kernel'] = jnp.repeat(attention[name]['kernel'], 2, axis=2)
  gqa_logits = jax.jit(gqa.apply)({'params': params}, tokens)
  mha_logits = jax.jit(mha.apply)({'params': mha_params}, tokens)
  assert gqa_logits.shape == (2, 16, 256) and gqa_logits.dtype == jnp.float32
  np.testing.assert_allclose(gqa_logits, mha_logits, atol=1e-5, rtol=1e-5)
  # With a mesh the key/value activations are constrained by 'kv_heads' (on the tensor axis): the same logits.
  config = _config(num_kv_heads=2)
  sizes = {'data': 2, 'fsdp': 2, 'tensor': 2}  # Every launcher axis present, as the default rules name them all.
  mesh = Mesh(np.array(jax.devices()[:8]).reshape([sizes.get(a, 1) for a in mesh_lib.AXES]), mesh_lib.AXES)
  sharded = llama.build(config, mesh, config.parallel.logical_axis_rules)
  np.testing.assert_allclose(jax.jit(sharded.apply)({'params': params}, tokens), gqa_logits, atol=1e-5, rtol=1e-5)
  # num_kv_heads == num_heads is plain multi-head attention: the parameters of num_kv_heads=0.
  same = _init(llama.build(_config(num_kv_heads=4)))[0]
  assert jax.tree.map(jnp.shape, same) == jax.tree.map(jnp.shape, mha_params)


def test_tied_embeddings_have_no_head_and_logits_are_hidden_times_table_transposed():
  tied = llama.build(_config(tie_embeddings=True, scan_layers=False))
  params, tokens = _init(tied)
  assert 'head' not in params and set(params) == {'embed', 'block_0', 'block_1', 'final_norm'}
  apply = jax.jit(lambda p, t: tied.apply(p, t, capture_intermediates=lambda m, _: m.name == 'final_norm'))
  logits, state = apply({'params': params}, tokens)
  hidden_BLD = state['intermediates']['final_norm']['__call__'][0]
  table_VD = params['embed']['embedding']
  assert logits.dtype == jnp.float32 and table_VD.shape == (256, 32)
  np.testing.assert_allclose(logits, hidden_BLD @ table_VD.T, atol=1e-5, rtol=1e-5)
  untied = _init(llama.build(_config()))[0]
  assert untied['head']['kernel'].shape == (32, 256)
  # A tied table starts at the untied head's scale, 0.4/sqrt(d_model): the first logits have stddev 0.4 at any width.
  for tie, stddev in ((True, 0.4 * 32 ** -0.5), (False, 1.0)):
    embed = llama.Embed(dataclasses.replace(tied.cfg, tie_embeddings=tie))
    table = nn.unbox(embed.init(jax.random.key(0), tokens))['params']['embedding']
    assert float(jnp.std(table)) == pytest.approx(stddev, rel=0.1)


@pytest.mark.parametrize('name,expected,target', [('gpt2_124m', 123_587_328, 124e6),
                                                  ('llama_1b', 1_235_814_400, 1.24e9)])
def test_preset_parameter_counts_from_abstract_shapes(name, expected, target):
  """Counted by jax.eval_shape, so nothing is allocated; every parameter carries logical names for each axis."""
  config = getattr(configs, name).get_config()
  config.train.remat_policy = 'full'  # The presets' 'auto' is resolved by the launcher before a model is built.
  model = llama.build(config)
  boxed = jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((1, 8), jnp.int32))['params']
  leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  unnamed = [x for x in leaves if not isinstance(x, nn.LogicallyPartitioned) or len(x.names) != x.value.ndim]
  assert not unnamed
  count = sum(int(np.prod(x.value.shape)) for x in leaves)
  print(f'{name}: {count:,} parameters')
  assert count == expected and count == pytest.approx(target, rel=0.01)
  assert 'head' not in boxed  # Both presets tie the embeddings.
  if name == 'llama_1b':
    assert boxed['layers']['attention']['key']['kernel'].names == ('layers', 'embed', 'kv_heads', 'head_dim')
    assert boxed['layers']['attention']['key']['kernel'].value.shape == (16, 2048, 8, 64)


@pytest.mark.parametrize('overrides,message', [
    ({'model.d_model': 30}, 'model.d_model=30 must divide by model.num_heads=4 (or set model.head_dim).'),
    ({'model.d_model': 12}, 'the head dim 3 (model.head_dim, or model.d_model/model.num_heads) must be even for RoPE'),
    ({'model.head_dim': -2}, 'model.head_dim=-2 must be a width in channels'),
    ({'model.num_kv_heads': 3}, 'model.num_kv_heads=3 must divide model.num_heads=4'),
    ({'model.num_kv_heads': -1}, 'model.num_kv_heads=-1 must divide model.num_heads=4'),
    ({'model.vocab_size': 100}, 'model.vocab_size=100 is too small for byte-level text; use at least 256.'),
    ({'train.remat_policy': 'some'}, "train.remat_policy='some': choose one of ('none', 'full',"),
])
def test_build_refuses_a_model_it_cannot_build(overrides, message):
  config = _config()
  for path, value in overrides.items():
    section, key = path.split('.')
    config[section][key] = value
  with pytest.raises(UserError) as error:
    llama.build(config)
  assert message in str(error.value)


def test_kv_heads_are_checked_against_the_mesh_and_vocab_only_for_byte_text():
  config = _config(num_kv_heads=1)
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
  # One kv head cannot split over tensor=2: the launcher's one divisibility check for every parameter says so.
  with pytest.raises(UserError, match=r"parameter layers/attention/key/kernel .*its 'kv_heads' dimension of 1 does "
                                      r"not divide over mesh.tensor=2"):
    job.build_job(config)
  llama.build(config)  # The model itself builds: the mesh is not its business.
  config = _config(vocab_size=100)
  config.data.source = 'synthetic'  # Token ids of any vocabulary: 100 is fine.
  assert llama.build(config).cfg.vocab_size == 100


@pytest.mark.parametrize('layers, value, scanned', [(2, 'auto', False), (4, 'auto', False), (5, 'auto', True),
                                                     (2, True, True), (16, False, False)])
def test_scan_layers_auto_scans_only_deep_models_and_the_model_follows(layers, value, scanned):
  config = _config(num_layers=layers, scan_layers=value)
  assert layer_scan.scans(config.model) is scanned
  params = jax.eval_shape(llama.build(config).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))['params']
  assert ('layers' in params) is scanned and ('block_0' in params) is not scanned


@pytest.mark.parametrize('value', ['yes', 1, None])
def test_a_bad_scan_layers_value_is_one_line_naming_the_choices(value):
  config = _config(scan_layers=value)
  # The one table of every key's choices says it (trainer/base/config_schema.py), before the model's own check.
  with pytest.raises(UserError, match=r"model.scan_layers=.* must be one of True, False, 'auto'"):
    validation.validate_config(config)
