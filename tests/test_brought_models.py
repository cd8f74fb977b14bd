"""Third-party-style models (tests/third_party/) train by import path, with every setting applied or refused.

In-process on the 8 fake CPU devices: a jit run on a (2, 2, 2) mesh per model;
the other strategies either train or refuse in one line before any compile;
bf16 reaches every model; the alignment probe catches a model that shifts its
own inputs.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_text_dir, read_metrics
from configs import tiny
from parallel import mesh as mesh_lib
from parallel import sharding
from tests.third_party import glue
from scripts import sample
from trainer import data
from trainer.base.errors import UserError
from trainer.run import job, loop
from trainer.training import task as task_lib

MODELS = ('meshy', 'prefix', 'gemma_style', 'do')


def _config(builder: str, strategy='jit', mesh=(2, 2, 2), steps=3):
  c = tiny.get_config()
  c.model.name = f'tests.third_party.glue:{builder}'
  c.parallel.extra_axis_rules = glue.RULES[builder.replace('_as_published', '')]
  c.parallel.strategy = strategy
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  c.data.source = 'synthetic'
  c.train.steps, c.train.warmup_steps, c.train.compute_dtype = steps, 0, 'float32'
  c.train.eval_batches, c.log.every_steps, c.ckpt.every_steps = 0, 1, 100
  return c


@pytest.mark.parametrize('builder', MODELS)
def test_trains_under_jit_on_a_2x2x2_mesh(builder, tmp_path):
  loop.run(_config(builder), str(tmp_path))
  records = [r for r in read_metrics(tmp_path) if 'loss' in r]
  losses = [r['loss'] for r in records]
  assert len(losses) == 3 and all(np.isfinite(losses))
  # Counted from the traced step (trainer/observe/flops.py).
  assert all(r['tflops_per_device'] > 0 for r in records[1:])
  assert abs(losses[0] - np.log(256)) < 1.0, losses  # Near ln(vocab) at init: logits line up with targets.
  table = (tmp_path / 'sharding.txt').read_text()
  assert 'names' in table.splitlines()[0]
  # Sampled from its checkpoint on one CPU device, inside the same context its constraints need.
  tokens = sample.sample(str(tmp_path), '1 2 3', 4, 0.8, 0, 'latest').split()  # Synthetic data: token ids.
  assert tokens[:3] == [b'1', b'2', b'3'] and len(tokens) == 7 and all(0 <= int(t) < 256 for t in tokens)


def test_mesh_axis_names_map_onto_the_launchers_mesh_and_unnamed_norms_follow_the_default():
  built = job.build_job(_config('meshy'))
  specs = {sharding.path_name(p): tuple(s.spec) for p, s in
           jax.tree_util.tree_flatten_with_path(built.shardings.params)[0]}
  assert specs['Embed_0/embedding'] == ('tensor', 'data')  # ('model', 'data'): an extra rule, and a mesh axis.
  assert specs['Block_0/LayerNorm_0/scale'] == (None,)  # Unnamed and small: replicated.
  assert built.task.param_notes['Block_0/LayerNorm_0/scale'] == 'unnamed: replicated (small)'


def test_fewer_names_than_dimensions_leave_the_trailing_ones_whole():
  built = job.build_job(_config('prefix'))
  specs = {sharding.path_name(p): tuple(s.spec) for p, s in
           jax.tree_util.tree_flatten_with_path(built.shardings.params)[0]}
  q_kernel = specs['DecoderLayer_0/DenseGeneral_0/kernel']  # (embed, heads, head_dim) named ('embed', 'kv').
  assert q_kernel == ('fsdp', 'tensor', None)
  assert '2 names for 3 dims' in built.task.param_notes['DecoderLayer_0/DenseGeneral_0/kernel']


def test_a_large_unnamed_parameter_is_split_over_fsdp_under_auto():
  from parallel import param_names
  shape = jax.ShapeDtypeStruct((1024, 512), jnp.float32)
  named, notes = param_names.name_params({'w': shape, 'b': jax.ShapeDtypeStruct((512,), jnp.float32)}, (),
                                         {'fsdp': 4}, 'auto', 'm', 'nnx')
  assert named['w'].names == ('fsdp', None) and named['b'].names == (None,)
  assert notes == {'w': 'unnamed: dim 0 over fsdp', 'b': 'unnamed: replicated (small)'}
  named, _ = param_names.name_params({'w': shape}, (), {'fsdp': 3}, 'auto', 'm', 'nnx')
  assert named['w'].names == (None, None)  # No dimension divides by 3.


@pytest.mark.parametrize('builder,strategy,mesh,message', [
    ('meshy', 'shard_map', (4, 2, 1), r"cannot run under parallel.strategy='shard_map' on mesh .*"
     r"pins activation shardings.*--config.parallel.strategy=jit"),
    ('meshy', 'pmap', (8, 1, 1), r"parameter .* is split over the mesh .* parallel.strategy='pmap' keeps every"),
    ('gemma_style', 'shard_map', (4, 2, 1), r"cannot run under parallel.strategy='shard_map'.*strategy=jit"),
    ('gemma_style', 'pmap', (8, 1, 1), r"cannot run under parallel.strategy='pmap'.*strategy=jit"),
])
def test_a_strategy_that_cannot_run_the_model_is_one_line_before_compile(builder, strategy, mesh, message, tmp_path):
  with pytest.raises(UserError, match=message) as refused:
    loop.run(_config(builder, strategy, mesh), str(tmp_path))
  assert '\n' not in str(refused.value)
  assert not list(tmp_path.glob('checkpoints/[0-9]*'))


def test_dense_general_kernels_named_for_the_launchers_mesh_train_per_device_and_pmap_says_the_rule(tmp_path):
  """nn.DenseGeneral boxes its flat 2-D kernel with 4 names: traced under an abstract mesh this failed everywhere."""
  config = _config('do', 'shard_map', (4, 2, 1), steps=2)
  config.train.eval_batches = 1  # Its metrics vary over data and fsdp only: a pmean over 'tensor' too was refused.
  loop.run(config, str(tmp_path / 'shard_map'))
  records = read_metrics(tmp_path / 'shard_map')
  assert len([r for r in records if 'loss' in r]) == 2
  assert [np.isfinite(r['eval_loss']) for r in records if 'eval_loss' in r] == [True]
  assert (tmp_path / 'shard_map' / 'checkpoints' / '2').is_dir()
  with pytest.raises(UserError, match=r"keeps every parameter whole on every device") as refused:
    loop.run(_config('do', 'pmap', (8, 1, 1), steps=2), str(tmp_path / 'pmap'))
  config = _config('do', 'pmap', (8, 1, 1), steps=2)
  config.parallel.extra_axis_rules = eval(re.search(r'extra_axis_rules="(.*)"', str(refused.value)).group(1))
  job.build_job(config)  # The rule the message gives is one that works: train and eval steps trace under 'pmap'.


@pytest.mark.parametrize('strategy,mesh', [('shard_map', (4, 2, 1)), ('pmap', (8, 1, 1))])
def test_a_model_without_constraints_trains_under_the_per_device_strategies(strategy, mesh, tmp_path):
  config = _config('lm1b', strategy, mesh, steps=2)  # Logical names; shifts its rows itself.
  config.model.unshifted_inputs = True
  loop.run(config, str(tmp_path))
  assert len([r for r in read_metrics(tmp_path) if 'loss' in r]) == 2


def test_the_final_step_is_saved_before_the_final_eval_and_a_lost_eval_is_said(tmp_path, monkeypatch):
  """A failed final eval: the step saved, one line (exit 2), recorded; one an attempt died in: said on relaunch."""
  from trainer.run import evaluation

  def failing_eval(*args):
    raise RuntimeError('eval went\nwrong')

  monkeypatch.setattr(evaluation, 'held_out', failing_eval)
  config = _config('lm1b', mesh=(8, 1, 1), steps=2)
  config.model.unshifted_inputs, config.train.eval_batches = True, 1
  with pytest.raises(UserError, match=r'^The final eval at step 2 failed \(RuntimeError: eval went wrong\); step 2 '
                                      r'is saved in .*metrics.jsonl records eval_failed at step 2'):
    loop.run(config, str(tmp_path))
  assert sorted(p.name for p in (tmp_path / 'checkpoints').iterdir()) == ['2']
  assert [r.get('eval_failed') for r in read_metrics(tmp_path) if r['step'] == 2] == [1.0]
  loop.run(config, str(tmp_path))  # Finished, its failure recorded: nothing to say again.
  # An attempt that died inside the final eval (an abort, a hang killed) leaves no record of step 2 at all.
  metrics = tmp_path / 'metrics.jsonl'
  metrics.write_text(''.join(line + '\n' for line in metrics.read_text().splitlines() if '"step": 2,' not in line))
  with pytest.raises(UserError, match=r'^The final eval of step 2 is not in .*metrics.jsonl: the attempt that '
                                      r'trained step 2 ended during it'):
    loop.run(config, str(tmp_path))
  assert [r for r in read_metrics(tmp_path) if r['step'] == 2] == [{'step': 2, 'missing_final_eval': 1.0}]
  loop.run(config, str(tmp_path))  # Said once.


def test_packed_rows_need_the_keywords_and_say_so(tmp_path):
  config = _config('prefix')
  config.data.source, config.data.text_dir, config.data.packing = 'text', str(make_text_dir(tmp_path)), True
  with pytest.raises(UserError, match=r"cannot train on packed rows: data.packing=True calls it with segment_ids= and "
                                      r"positions=, and its __call__ takes no (positions|segment_ids)= .*"
                                      r"--config.data.packing=False, or make it packable") as refused:
    job.build_job(config)
  assert 'packed_kwarg_names' not in str(refused.value)  # It has no keywords of its own to name.
  config.model.name = 'tests.third_party.glue:lm1b'  # It has them, under its own names: those are suggested.
  with pytest.raises(UserError, match=r"its __call__ takes inputs_segmentation= and inputs_positions=: .*"
                                      r"--config.model.packed_kwarg_names=\"\('inputs_segmentation', "
                                      r"'inputs_positions'\)\""):
    job.build_job(config)


@pytest.mark.parametrize('builder', MODELS[:3])  # 'do' takes dtype= as meshy does.
def test_bf16_reaches_the_model(builder):
  """Logits at init, float32 vs bfloat16: apart by a bfloat16-sized amount (2^-8 relative), never equal.

  Logits, not the loss: at init they are small, so the loss sits at ln(vocab) whatever the precision
  (meshy's differed by 3e-7 relative).
  """
  outputs = {}
  for dtype in ('float32', 'bfloat16'):
    config = _config(builder, mesh=(8, 1, 1))
    config.train.compute_dtype = dtype
    task = _task(config)
    params = jax.jit(task.model.init)(jax.random.key(0))
    batch = next(data.train_iterator_for(config))
    outputs[dtype] = np.asarray(jax.jit(task.outputs)(params, batch), np.float32)
  gap = np.abs(outputs['bfloat16'] - outputs['float32']).max() / np.abs(outputs['float32']).max()
  assert 1e-4 < gap < 5e-2, gap


def test_remat_reaches_a_model_that_takes_it_and_is_a_warning_for_one_that_does_not(caplog):
  config = _config('gemma_style', mesh=(8, 1, 1))
  jaxprs = {}
  for policy in ('none', 'full'):
    config.train.remat_policy = policy
    task = _task(config)
    params, batch = jax.jit(task.model.init)(jax.random.key(0)), next(data.train_iterator_for(config))
    jaxprs[policy] = str(jax.make_jaxpr(jax.grad(lambda p: task.loss(p, batch)[0]))(params))
  # Under 'full' the backward pass recomputes each block's forward: its matmuls appear twice (51 -> 65 here).
  count = {k: v.count('dot_general[') for k, v in jaxprs.items()}
  assert count['full'] > count['none'], count
  config = _config('prefix', mesh=(8, 1, 1))
  config.train.remat_policy = 'full'
  with caplog.at_level('WARNING'):
    _task(config)
  assert any("train.remat_policy='full' does not apply to model.name='tests.third_party.glue:prefix'" in r.message
             for r in caplog.records)


def _task(config) -> task_lib.Task:
  """The task as build_job makes it, with the mesh (two of the models pin activations to it), nothing else."""
  return task_lib.build_task(config, mesh_lib.build_mesh(config.mesh), sharding.rules_from_config(config.parallel))


def test_a_model_that_shifts_its_own_inputs_is_refused_before_compile(tmp_path):
  """It trains (the loss falls), but two tokens ahead: the probe sees logits[p] ignore inputs[p]."""
  with pytest.raises(UserError, match=r"logits at position 16 do not depend on inputs\[16\], so it shifts its inputs "
                                      r"itself.*Remove the model's own shift"):
    loop.run(_config('prefix_as_published'), str(tmp_path))
  assert not list(tmp_path.glob('checkpoints/[0-9]*')) and not (tmp_path / 'metrics.jsonl').exists()


def test_plan_proposes_remat_only_to_a_model_that_takes_it():
  from trainer.run import plan
  mesh_shape = {'data': 2, 'fsdp': 2, 'tensor': 2}
  flags = {b: ' '.join(f for f, _ in plan._candidates(_config(b), mesh_shape)) for b in ('prefix', 'gemma_style')}
  assert 'remat' not in flags['prefix'] and 'mesh.fsdp=4' in flags['prefix']
  assert '--config.train.remat_policy=full' in flags['gemma_style']


def _lm1b_packed(tmp_path, positions: str):
  config = _config('lm1b', steps=2)
  config.data.source, config.data.text_dir, config.data.packing = 'text', str(make_text_dir(tmp_path)), True
  config.data.packed_positions = positions  # 2000-byte documents: offsets within one run to 1999, past max_len 32.
  config.model.packed_kwarg_names = ('inputs_segmentation', 'inputs_positions')
  config.model.unshifted_inputs = True  # It shifts right itself: fed the targets, its logits[t] score targets[t].
  return config


def test_an_lm1b_style_model_trains_on_packed_rows_with_its_own_keywords_and_row_positions(tmp_path):
  loop.run(_lm1b_packed(tmp_path, 'row'), str(tmp_path / 'run'))
  losses = [r['loss'] for r in read_metrics(tmp_path / 'run') if 'loss' in r]
  assert len(losses) == 2 and all(np.isfinite(losses)) and abs(losses[0] - np.log(256)) < 1.0, losses
  # Sampled from its checkpoint, fed the way it was trained (the window shifted left one).
  text = sample.sample(str(tmp_path / 'run'), 'def ', 3, 0.8, 0, 'latest')
  assert text.startswith(b'def ') and len(text) == 7


def test_document_positions_past_a_learned_table_say_so_when_the_loss_is_not_finite(tmp_path):
  from trainer.safety import guardrails
  with pytest.raises(guardrails.NonFiniteError, match=r'step 1: non-finite loss.*Packing is on: positions= are '
                                                      r'offsets within each document.*data.packed_positions=row'):
    loop.run(_lm1b_packed(tmp_path, 'document'), str(tmp_path / 'run'))


def test_packed_rows_positions_restart_in_each_rows_piece_of_a_document():
  docs = data.documents.InMemoryDocuments(np.arange(100, dtype=np.int32), np.array([0, 50]), 'test')
  by_document, by_row = (data.PackedRows(docs, 16, positions=p)[3] for p in ('document', 'row'))
  # Row 3 holds pairs 48..63: document 0's last pair (its 49th), then document 1's first 15.
  assert by_document['positions'].tolist() == [48] + list(range(15))
  assert by_row['positions'].tolist() == [0] + list(range(15))
  assert by_row['segment_ids'].tolist() == by_document['segment_ids'].tolist() == [1] + [2] * 15


def _vit(strategy='jit', mesh=(2, 2, 2)):
  config = _config('vit', strategy, mesh, steps=2)
  config.model.task, config.data.image_shape = 'classifier', (8, 8, 3)
  config.model.num_classes, config.model.patch_size = 4, 4
  config.train.eval_batches = 1
  return config


def test_a_required_call_keyword_is_named_with_the_key_that_passes_it(tmp_path):
  with pytest.raises(UserError, match=r"its call requires train=.*"
                                      r"--config.model.call_kwargs=\"\(\('train', True\),\)\"") as e:
    job.build_job(_vit())
  assert '\n' not in str(e.value)


# Not 'shard_map': its eval over a batch not split over 'tensor' is the 'do' model's test above.
@pytest.mark.parametrize('strategy,mesh', [('jit', (2, 2, 2)), ('pmap', (8, 1, 1))])
def test_a_vit_style_model_with_a_required_train_keyword_trains(strategy, mesh, tmp_path):
  config = _vit(strategy, mesh)
  config.model.call_kwargs, config.model.eval_call_kwargs = (('train', True),), (('train', False),)
  loop.run(config, str(tmp_path))
  records = read_metrics(tmp_path)
  assert len([r for r in records if 'loss' in r]) == 2
  assert [0 <= r['eval_accuracy'] <= 1 for r in records if 'eval_accuracy' in r] == [True]


def test_eval_calls_the_model_with_its_own_keywords():
  from trainer.models import call_convention
  config = _vit()
  config.model.call_kwargs = (('train', True), ('depth', 2))
  config.model.eval_call_kwargs = (('train', False),)
  train = call_convention.CallConvention.from_config(config.model)
  evaluating = call_convention.CallConvention.from_config(config.model, evaluating=True)
  seen = []
  train.wrap(lambda x, **kw: seen.append(kw))(0, segment_ids=1, positions=2)
  evaluating.wrap(lambda x, **kw: seen.append(kw))(0)
  assert seen == [{'segment_ids': 1, 'positions': 2, 'train': True, 'depth': 2}, {'train': False, 'depth': 2}]
  config.model.packed_kwarg_names = ('inputs_segmentation', 'inputs_positions')
  call_convention.CallConvention.from_config(config.model).wrap(lambda x, **kw: seen.append(kw))(0, segment_ids=1,
                                                                                                 positions=2)
  assert seen[-1] == {'inputs_segmentation': 1, 'inputs_positions': 2, 'train': True, 'depth': 2}


def test_the_log_says_remat_and_bf16_reach_a_model_through_its_own_keywords(caplog):
  config = _config('gemma_style', mesh=(8, 1, 1))
  config.train.remat_policy, config.train.compute_dtype = 'full', 'bfloat16'
  with caplog.at_level('INFO'):
    _task(config)
  messages = [r.getMessage() for r in caplog.records]
  name = 'tests.third_party.glue:gemma_style'
  assert (f"train.remat_policy='full': applied by model.name='{name}' itself (passed as its builder's remat_policy= "
          f"keyword; the launcher does not rematerialize it again).") in messages
  assert (f"train.compute_dtype=bfloat16: model.name='{name}' computes in bfloat16 (passed as its builder's dtype= "
          f"keyword; parameters stay float32).") in messages


@pytest.mark.parametrize('strategy,mesh', [('jit', (2, 2, 2)), ('shard_map', (4, 2, 1)), ('pmap', (8, 1, 1))])
def test_a_model_written_for_explicit_mesh_axes_is_told_what_to_remove(strategy, mesh, tmp_path):
  with pytest.raises(UserError) as refused:
    loop.run(_config('gemma_explicit', strategy, mesh), str(tmp_path))
  message = str(refused.value)
  assert ("the launcher's mesh axes are Auto (Manual inside 'shard_map'): remove those out_sharding= arguments"
          in message), message
  assert 'fix the model' not in message and '\n' not in message
  assert '(raised at ' in message and 'nnx_lm.py:' in message  # Where: the model's own line.


# Parameters named in the vocabularies of public Flax code (tests/third_party/vocab_models.py) need no
# extra_axis_rules: each is split as docs/brought_models.md's table says (parallel/vocabularies.py).
_QKV = {'q': ('fsdp', 'tensor', None), 'k': ('fsdp', 'tensor', None), 'v': ('fsdp', 'tensor', None)}
VOCABULARY_SPLITS = {
    'flax_examples': {'embedding': ('tensor', 'fsdp'), **_QKV, 'o': ('tensor', None, 'fsdp'),
                      'wi': ('fsdp', 'tensor'), 'wo': ('tensor', 'fsdp'), 'scale': ('fsdp',)},
    't5x': {'embedding': ('tensor', 'fsdp'), 'q': ('fsdp', 'tensor'), 'k': ('fsdp', 'tensor'), 'v': ('fsdp', 'tensor'),
            'o': ('tensor', 'fsdp'), 'wi': ('fsdp', None, 'tensor'), 'wo': ('tensor', 'fsdp'), 'scale': ('fsdp',)},
    'maxtext': {'embedding': ('tensor', 'fsdp'), 'q_a': ('fsdp', None), 'kv_a': ('fsdp', None), **_QKV,
                'o': ('tensor', None, 'fsdp'), 'wi': ('fsdp', None, 'tensor'), 'wo': ('tensor', 'fsdp'),
                'wi_exp': ('expert', 'fsdp', 'tensor'), 'wo_exp': ('expert', 'tensor', 'fsdp'), 'scale': (None,)},
    'tunix': {'embedding': ('tensor', 'fsdp'), 'q': ('tensor', 'fsdp', None), 'k': ('tensor', 'fsdp', None),
              'v': ('tensor', 'fsdp', None), 'o': ('tensor', None, 'fsdp'), 'wi': ('fsdp', 'tensor'),
              'wo': ('tensor', 'fsdp'), 'scale': ('tensor',)},
    'nanodo': {'embedding': (None, 'data'), 'q': ('data', None, None), 'k': ('data', None, None),
               'v': ('data', None, None), 'o': (None, None, 'data'), 'wi': ('data', None), 'wo': (None, 'data'),
               'scale': (None,)},
    'big_vision': {'embedding': (None, None), 'q': (None, None, None), 'k': (None, None, None),
                   'v': (None, None, None), 'o': (None, None, None), 'wi': (None, None), 'wo': (None, None),
                   'scale': (None,)},  # Unnamed and small: parallel.unnamed_params='auto' replicates them.
}


def _vocabulary_config(builder: str, steps=2):
  c = _config('do', steps=steps)
  c.model.name = f'tests.third_party.vocab_models:{builder}'
  c.parallel.extra_axis_rules = ()
  return c


def _splits(config) -> dict[str, tuple]:
  """{parameter: its PartitionSpec, one entry per dimension} of the Job `config` builds."""
  built = job.build_job(config)
  return {sharding.path_name(path).split('/')[-1]: tuple(s.spec) + (None,) * (len(leaf.shape) - len(s.spec))
          for (path, s), leaf in zip(jax.tree_util.tree_flatten_with_path(built.shardings.params)[0],
                                     jax.tree.leaves(built.abstract.params))}


@pytest.mark.parametrize('framework', ['linen', 'nnx'])
@pytest.mark.parametrize('vocabulary', list(VOCABULARY_SPLITS))
def test_public_vocabularies_need_no_rule_and_split_as_the_table_promises(vocabulary, framework):
  assert _splits(_vocabulary_config(f'{framework}_{vocabulary}')) == VOCABULARY_SPLITS[vocabulary]


@pytest.mark.parametrize('builder', ['linen_flax_examples', 'linen_t5x', 'linen_maxtext', 'nnx_maxtext', 'nnx_tunix',
                                     'linen_nanodo', 'linen_big_vision'])
def test_public_vocabularies_train_on_a_2x2x2_mesh_with_no_extra_rules(builder, tmp_path, caplog):
  with caplog.at_level('WARNING'):
    loop.run(_vocabulary_config(builder), str(tmp_path))
  unsplit = [r.getMessage() for r in caplog.records if 'splits none of the' in r.getMessage()]
  # nanodo names its axis 'data': nothing over fsdp or tensor, said in one line (test_brought_model_failures.py).
  assert len(unsplit) == (builder == 'linen_nanodo'), unsplit
  losses = [r['loss'] for r in read_metrics(tmp_path) if 'loss' in r]
  assert len(losses) == 2 and all(np.isfinite(losses)) and abs(losses[0] - np.log(256)) < 1.0, losses


def test_a_user_rule_still_wins_and_an_unknown_name_is_still_refused():
  config = _vocabulary_config('linen_t5x')
  config.parallel.extra_axis_rules = (('joined_kv', None),)
  assert _splits(config)['q'] == ('fsdp', None)
  config.model.name = 'tests.test_brought_models:linen_unknown_name'
  with pytest.raises(UserError, match=r"names axis 'qkv_joint', which is neither a mesh axis .*extra_axis_rules"):
    job.build_job(config)


def linen_unknown_name(config):
  """t5x's model with its query kernel named ('embed', 'qkv_joint'): a name in no vocabulary."""
  from tests.third_party import vocab_models
  m = config.model
  vocab_models.VOCABULARIES.setdefault('unknown', {**vocab_models.VOCABULARIES['t5x'],
                                                   'q': ('DJ', ('embed', 'qkv_joint'))})
  return vocab_models.LinenLM('unknown', m.vocab_size, m.d_model, m.num_heads, m.mlp_dim)


def test_docs_table_lists_every_public_name_with_its_axis():
  from conftest import REPO
  from parallel import vocabularies
  text = (REPO / 'docs' / 'brought_models.md').read_text()
  for name, axis, _, _ in vocabularies.PUBLIC_NAMES:
    shown = 'None' if axis is None else repr(axis).replace("'", '')
    assert f'| `{name}` | `{shown}` |' in text, name


# The decoding call convention, model(tokens, positions, cache, attention_mask) -> (logits, cache), of flax's Gemma
# example and tunix's Llama 3 (copies in their style: tests/third_party/gemma_nnx.py, tunix_llama3.py).
DECODING = ('gemma', 'tunix_llama')


@pytest.fixture(scope='module')
def decoding_runs(tmp_path_factory):
  """Each decoding-convention model trained 10 steps on text on a (2, 2, 2) mesh, 4 heads sharing 2 kv heads."""
  root = tmp_path_factory.mktemp('decoding')
  (root / 'text').mkdir()
  make_text_dir(root / 'text', num_files=4)
  runs = {}
  for builder in DECODING:
    c = _config(builder, steps=10)
    c.data.source, c.data.text_dir = 'text', str(root / 'text')
    c.model.num_heads, c.model.num_kv_heads, c.train.learning_rate, c.ckpt.every_steps = 4, 2, 1e-2, 10
    c.train.compute_dtype = 'auto'  # As configs/base.py has it: sample.py resolves it (the cache's dtype) as training.
    loop.run(c, str(root / builder))
    runs[builder] = root / builder
  return runs


@pytest.mark.parametrize('builder', DECODING)
def test_decoding_convention_models_train_by_import_path_losses_falling(builder, decoding_runs):
  losses = [r['loss'] for r in read_metrics(decoding_runs[builder]) if 'loss' in r]
  assert len(losses) == 10 and np.mean(losses[-3:]) < losses[0] - 0.3, losses


def test_the_launcher_gives_a_decoding_model_positions_and_the_causal_segment_mask():
  from trainer.models import call_convention
  seen = {}

  class Model:
    def __call__(self, input_tokens, positions, cache, attention_mask):
      seen.update(positions=positions, cache=cache, mask=attention_mask)
      return input_tokens.astype(jnp.float32)[..., None], cache

  assert call_convention.takes_decoding_call(Model)
  wrapped = call_convention.CallConvention(decoding=True).wrap(Model())
  logits = wrapped(jnp.array([[5, 6, 7, 8]]), segment_ids=jnp.array([[1, 1, 2, 2]]), positions=jnp.array([[0, 1, 0, 1]]))
  assert logits.shape == (1, 4, 1) and seen['cache'] is None
  np.testing.assert_array_equal(seen['positions'], [[0, 1, 0, 1]])
  np.testing.assert_array_equal(seen['mask'][0], [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]])
  wrapped(jnp.array([[5, 6, 7]]))  # Unpacked: positions 0..L-1 and the plain causal mask.
  np.testing.assert_array_equal(seen['positions'], [[0, 1, 2]])
  np.testing.assert_array_equal(seen['mask'][0], np.tril(np.ones((3, 3))))


@pytest.mark.parametrize('builder', DECODING)
def test_sample_decodes_a_decoding_model_with_its_own_cache(builder, decoding_runs):
  from trainer.base import storage
  run = storage.path(str(decoding_runs[builder]))
  config = sample.load_run_config(run)
  assert config.train.compute_dtype == 'auto'  # Passed on to the model's own init_cache as float32 (on CPU).
  _, bind, params = sample.restore_model(config, run, 'latest')
  assert sample.DecodingCallLogits.fits(bind.task)
  seq_len = config.data.seq_len
  window = sample.WindowLogits(bind, params, seq_len)
  cached = sample.DecodingCallLogits(bind.task, params, seq_len, config.train.compute_dtype)
  text = np.random.default_rng(1).integers(0, 256, 12).tolist()
  for n in range(3, len(text) + 1):  # Prefill at 3 tokens, then one token at a time against the cache.
    np.testing.assert_allclose(np.asarray(cached(text[:n])), np.asarray(window(text[:n])), rtol=0, atol=1e-4)
  # Greedy past the window: the cached path starts a new text, steps, then prefills the last seq_len tokens.
  prompt = text[:5]
  reference = sample.generate(window, prompt, seq_len + 4, temperature=0.0, seed=0)
  assert sample.generate(cached, prompt, seq_len + 4, temperature=0.0, seed=0) == reference
  out = sample.sample(str(run), 'def ', 6, 0.0, 0, 'latest')  # The whole script, on its cached path.
  assert out.startswith(b'def ') and len(out) == 10
