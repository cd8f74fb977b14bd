"""Each optimizer trains the tiny LM, the same numbers under every strategy, with its state sharded.

In-process runs on the 8 fake CPU devices, float32, one log line per step (as
tests/test_strategies.py); 30 steps for each optimizer under jit on (2, 2, 2),
then under shard_map and pmap on (8, 1, 1) for the two with non-elementwise updates.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import read_metrics

from configs import tiny
from trainer.base.errors import UserError
from trainer.run import job as job_lib
from trainer.run import loop
from test_strategies import TEXT_DIR

OPTIMIZERS = ['adafactor', 'lion', 'muon', 'sgd']
STEPS = 30


def _config(optimizer, strategy='jit', mesh=(2, 2, 2)):
  c = tiny.get_config()
  c.train.optimizer = optimizer
  c.train.adafactor_min_dim_size_to_factor = 32 if optimizer == 'adafactor' else 128  # Factor the tiny matrices.
  c.train.learning_rate = 1e-2 if optimizer != 'sgd' else 0.3
  c.parallel.strategy = strategy
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  c.data.text_dir = str(TEXT_DIR)
  c.train.steps = STEPS
  c.train.compute_dtype = 'float32'
  c.train.eval_batches = 0
  c.log.every_steps = 1
  c.ckpt.every_steps = STEPS
  return c


@pytest.fixture(scope='module')
def jit_runs(tmp_path_factory):
  runs = {}
  for name in OPTIMIZERS:
    workdir = tmp_path_factory.mktemp(name)
    loop.run(_config(name), str(workdir))
    runs[name] = read_metrics(workdir)
  return runs


@pytest.mark.parametrize('name', OPTIMIZERS)
def test_loss_falls(name, jit_runs):
  losses = [r['loss'] for r in jit_runs[name]]
  assert len(losses) == STEPS
  assert np.mean(losses[-5:]) < 0.9 * np.mean(losses[:5]), losses


# The strategies compute the same float32 math with the batch's sums split and ordered differently over the devices, so
# they may differ by rounding, which 30 steps of training then carry and can grow (SGD at learning rate 0.3 grows it
# most: its grad_norm drifted 9.2e-6 between two jit layouts, where the other optimizers' stayed near 3e-7). How far
# rounding alone moves a run is measured, not assumed: the same jit step on (8, 1, 1) against (2, 2, 2), a change of
# layout and nothing else. A strategy may differ from jit by LAYOUT_NOISE_FACTOR times that: measured at 0.4-1.3 times
# (2-core CPU VM, 2026-11-26); a bug (a missing mean over devices, a moment sharded wrong) differs by 1e-3 or more.
LAYOUT_NOISE_FACTOR = 4
# Where the two layouts happen to agree to the bit: an 8-term float32 sum in another order is off by at most 7 eps
# (relative to its terms' magnitudes), and a step's metrics pass two such sums (the loss mean, the gradient's).
ROUNDING_FLOOR = 2 * 7 * float(np.finfo(np.float32).eps)


def _relative_drift(records, reference, key):
  a, b = np.array([r[key] for r in records]), np.array([r[key] for r in reference])
  return float(np.max(np.abs(a - b) / np.abs(b)))


@pytest.fixture(scope='module')
def layout_noise(jit_runs, tmp_path_factory):
  """Per optimizer and key: the largest relative drift of jit on (8, 1, 1) from jit on (2, 2, 2) over the run."""
  noise = {}
  for name in OPTIMIZERS:
    workdir = tmp_path_factory.mktemp(f'{name}-8x1x1')
    loop.run(_config(name, 'jit', (8, 1, 1)), str(workdir))
    noise[name] = {key: _relative_drift(read_metrics(workdir), jit_runs[name], key) for key in ('loss', 'grad_norm')}
  return noise


def test_the_layout_noise_is_rounding_sized(layout_noise):
  """The yardstick itself: two jit layouts agree to float32 rounding carried over 30 steps, not to a bug's 1e-3."""
  assert all(0 <= drift < 1e-4 for per_key in layout_noise.values() for drift in per_key.values()), layout_noise


@pytest.mark.parametrize('strategy', ['shard_map', 'pmap'])
@pytest.mark.parametrize('name', ['adafactor', 'muon', 'lion', 'sgd'])
def test_strategies_agree(name, strategy, jit_runs, layout_noise, tmp_path):
  """Every optimizer the issue names, beyond AdamW (tests/test_strategies.py): the same losses on (8, 1, 1) under
  shard_map and pmap as under jit on (2, 2, 2), to what rounding alone moves them. Adafactor's factored moments and
  Muon's per-matrix orthogonalization are where a strategy could differ; Lion's and SGD's updates are elementwise, and
  run here too (6 s a run)."""
  loop.run(_config(name, strategy, (8, 1, 1)), str(tmp_path))
  records, reference = read_metrics(tmp_path), jit_runs[name]
  assert [r['step'] for r in records] == [r['step'] for r in reference]
  for key in ('loss', 'grad_norm'):
    rtol = max(LAYOUT_NOISE_FACTOR * layout_noise[name][key], ROUNDING_FLOOR)
    np.testing.assert_allclose([r[key] for r in records], [r[key] for r in reference], rtol=rtol, err_msg=key)


def _opt_leaves(job):
  specs = dict(jax.tree_util.tree_leaves_with_path(jax.tree.map(lambda s: s.spec, job.shardings.opt_state,
                                                                 is_leaf=lambda s: hasattr(s, 'spec'))))
  return {jax.tree_util.keystr(p): (leaf.shape, specs[p])
          for p, leaf in jax.tree_util.tree_leaves_with_path(job.abstract.opt_state)}


def _find(leaves, *parts):
  found = [v for k, v in leaves.items() if all(p in k for p in parts)]
  assert len(found) == 1, (parts, found)
  return found[0]


def test_adafactor_state_is_factored():
  """A factored matrix keeps a row and a column vector per layer; the unfactored ones a full moment."""
  leaves = _opt_leaves(job_lib.build_job(_config('adafactor')))
  # mlp up (layers=2, embed=32, mlp=64): factored over its last two dimensions, the layers axis kept.
  # Sharded as the parameter's (layers, embed -> fsdp, mlp -> tensor) without the reduced axis.
  assert _find(leaves, '.v_row', "['mlp']['up']") == ((2, 32), P(None, 'fsdp'))
  assert _find(leaves, '.v_col', "['mlp']['up']") == ((2, 64), P(None, 'tensor'))
  assert _find(leaves, '.v[', "['mlp']['up']") == ((1,), P())
  # Norm scales (2, 32) are not factored (one dimension per layer): a full second moment like the param.
  assert _find(leaves, '.v[', "['mlp_norm']") == ((2, 32), P(None, None))


def test_muon_state_splits_matrices_from_the_rest():
  job = job_lib.build_job(_config('muon'))
  leaves = _opt_leaves(job)
  muon = {k for k in leaves if "inner_states['muon']" in k and '.mu[' in k}
  adam = {k for k in leaves if "inner_states['adam']" in k and '.mu[' in k}
  assert {k.split('.mu')[1] for k in muon} == {
      f"['layers']['{m}']['{w}']['kernel']" for m, ws in
      (('attention', ('key', 'out', 'query', 'value')), ('mlp', ('down', 'gate', 'up'))) for w in ws}
  assert {k.split('.mu')[1] for k in adam} == {
      "['embed']['embedding']", "['head']['kernel']", "['final_norm']['scale']",
      "['layers']['attention_norm']['scale']", "['layers']['mlp_norm']['scale']"}
  # Momentum is sharded exactly like its parameter.
  params = dict(zip((jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(job.abstract.params)),
                    jax.tree_util.tree_leaves(job.shardings.params)))
  for key in muon | adam:
    assert leaves[key][1] == params[key.split('.mu')[1]].spec, key


def test_other_optimizers_key_is_refused():
  c = _config('lion')
  c.train.sgd_momentum = 0.5
  with pytest.raises(UserError, match=r"train.sgd_momentum=0.5 applies only to train.optimizer=sgd, not 'lion'"):
    job_lib.build_job(c)


@pytest.mark.parametrize('optimizer', ['lion', 'sgd', 'adafactor'])
def test_a_presets_bfloat16_first_moment_does_not_block_switching_optimizer(optimizer, caplog):
  """configs/llama_1b.py sets adam_mu_dtype='bfloat16': switching it to another optimizer by one flag must build."""
  c = _config(optimizer)
  c.train.adam_mu_dtype = 'bfloat16'
  with caplog.at_level('INFO'):
    job = job_lib.build_job(c)
  dtypes = {str(leaf.dtype) for leaf in jax.tree.leaves(job.abstract.opt_state) if leaf.ndim >= 2}
  if optimizer == 'adafactor':  # No first moment: the factored second moments stay float32, and the log says why.
    assert dtypes == {'float32'}
    assert "train.adam_mu_dtype='bfloat16' is unused: train.optimizer='adafactor' keeps no first moment" in caplog.text
  else:  # Lion's and SGD's momentum (every matrix-shaped state leaf) in bfloat16.
    assert dtypes == {'bfloat16'}
