"""Training with rows split over `mesh.context` gives the numbers of unsplit rows, and checkpoints move across it.

In-process `trainer.run.loop.run` on the fake CPU devices, float32, a loss per step in metrics.jsonl: grouped-query
attention (4 query heads, 2 key/value heads) and packed rows (several documents a row), so attention across the
split, the balanced order, RoPE positions and document masks are all exercised.
"""

import os
import pathlib
import shutil

import jax
import pytest

from conftest import read_metrics

from configs import tiny
from trainer.base.errors import UserError
from trainer.models import contract
from trainer.run import job as job_lib
from trainer.run import loop
from trainer.training import checkpoint

RTOL = 1e-5
TEXT_DIR = pathlib.Path(os.__file__).parent / 'email'


def _config(data=8, fsdp=1, context=1, tensor=1, steps=10, strategy='jit'):
  c = tiny.get_config()
  c.parallel.strategy = strategy
  c.mesh.data, c.mesh.fsdp, c.mesh.context, c.mesh.tensor = data, fsdp, context, tensor
  c.data.text_dir = str(TEXT_DIR)
  c.data.packing = True
  c.model.num_heads, c.model.num_kv_heads = 4, 2
  c.train.steps = steps
  c.train.compute_dtype = 'float32'
  c.train.eval_every_steps = 0
  c.train.eval_batches = 0
  c.train.accept_schedule_change = True
  c.log.every_steps = 1
  c.ckpt.every_steps = 4
  return c


def _train(workdir, config) -> list[dict]:
  devices = jax.devices()[:config.mesh.data * config.mesh.fsdp * config.mesh.context * config.mesh.tensor]
  loop.run(config, str(workdir), devices=devices)
  return read_metrics(workdir)


def _assert_same(records, reference, steps=range(1, 11)):
  assert [r['step'] for r in records] == list(steps)
  by_step = {r['step']: r for r in reference}
  worst = max(abs(r[k] - by_step[r['step']][k]) / abs(by_step[r['step']][k])
              for r in records for k in ('loss', 'grad_norm'))
  print(f'max relative difference {worst:.2e}')
  assert worst <= RTOL


def _run_dir(tmp_path_factory, name, config) -> tuple[pathlib.Path, list[dict]]:
  workdir = tmp_path_factory.mktemp(name)
  return workdir, _train(workdir, config)


@pytest.fixture(scope='module')
def unsplit_run(tmp_path_factory):
  """10 steps with whole rows on every device (data=8), checkpoints at 4 and 8 kept."""
  return _run_dir(tmp_path_factory, 'unsplit', _config())


@pytest.fixture(scope='module')
def split4_run(tmp_path_factory):
  """The same 10 steps with every row split over 4 devices."""
  return _run_dir(tmp_path_factory, 'split4', _config(1, 1, 4, 1))


@pytest.fixture(scope='module')
def unsplit(unsplit_run):
  return unsplit_run[1]


def test_rows_split_over_four_devices_train_the_numbers_of_whole_rows(split4_run, unsplit):
  _assert_same(split4_run[1], unsplit)
  _, manifest = checkpoint.newest_manifest(str(split4_run[0]))  # The run records how attention crossed the split.
  assert manifest['mesh']['context'] == 4 and manifest['attention']['kernel'] == 'xla'
  assert manifest['attention']['reason'].startswith(  # 'auto' on CPU: the ring (trainer/attention/context.py).
      "ring of keys/values over mesh.context=4, balanced (zig-zag) row order (model.context_scheme='auto'): faster")


def test_the_all_gather_scheme_trains_the_numbers_of_whole_rows(unsplit, tmp_path):
  """model.context_scheme='all-gather' at context 4 (what 'auto' picks on TPU, with splash), with XLA blocks here;
  the other split runs in this file take 'auto', the ring on CPU."""
  config = _config(2, 1, 4, 1)
  config.model.context_scheme = 'all-gather'
  _assert_same(_train(tmp_path, config), unsplit)
  _, manifest = checkpoint.newest_manifest(str(tmp_path))
  assert manifest['attention']['kernel'] == 'xla'
  assert manifest['attention']['reason'].startswith("all-gather of keys/values over mesh.context=4, balanced "
                                                    "(zig-zag) row order (model.context_scheme='all-gather')")


# context=8 alone: every device holds two chunks of 2 tokens of each 32-token row, the finest split tiny allows.
@pytest.mark.parametrize('mesh', [(1, 1, 2, 1), (2, 1, 2, 2), (1, 2, 4, 1), (1, 1, 8, 1)],
                         ids=lambda m: 'data{}_fsdp{}_context{}_tensor{}'.format(*m))
def test_split_rows_train_the_numbers_of_whole_rows(mesh, unsplit, tmp_path):
  _assert_same(_train(tmp_path, _config(*mesh)), unsplit)


def test_loss_chunks_and_grad_accum_follow_the_split(unsplit, tmp_path):
  config = _config(2, 1, 4, 1)
  config.train.loss_chunks = 4
  config.train.grad_accum_steps = 2
  _assert_same(_train(tmp_path, config), unsplit)


def test_checkpoints_move_between_context_sizes(unsplit_run, split4_run, unsplit, tmp_path):
  """Step 8 saved at context=4 resumes at context=1, and step 8 saved at context=1 resumes at context=4 (data=2):
  steps 9 and 10 are the unsplit run's."""
  for (saved, _), mesh in ((split4_run, (8, 1, 1, 1)), (unsplit_run, (2, 1, 4, 1))):
    workdir = tmp_path / f'from_{saved.name}'
    shutil.copytree(saved, workdir)
    shutil.rmtree(workdir / 'checkpoints' / '10')  # Resume from step 8.
    records = _train(workdir, _config(*mesh))
    _assert_same(records[10:], unsplit, steps=range(9, 11))  # metrics.jsonl keeps the first run's 1-10 before.


@pytest.mark.parametrize('strategy', ['shard_map', 'pmap'])
def test_per_device_strategies_refuse_the_split_before_compile(strategy, tmp_path):
  with pytest.raises(UserError, match=rf"parallel.strategy='{strategy}' cannot split sequences \(mesh.context=2\)"):
    loop.run(_config(4, 1, 2, 1, strategy=strategy), str(tmp_path))
  assert not (tmp_path / 'checkpoints').exists()


def test_seq_len_that_cannot_be_split_is_refused(tmp_path):
  config = _config(1, 1, 8, 1)
  config.data.seq_len = 24
  with pytest.raises(UserError, match=r'data.seq_len=24 must be a multiple of 16 \(2 x mesh.context=8'):
    loop.run(config, str(tmp_path))


def test_brought_model_with_attention_of_its_own_is_refused_and_one_calling_the_launchers_is_not():
  """Its own attention would see only each device's part of a row: refused in one line, before compile."""
  config = _config(4, 1, 2, 1)
  config.data.packing, config.model.check_alignment = False, False
  config.model.name = 'tests.custom_models:own_attention_lm'
  with pytest.raises(UserError, match=r"model.name='tests.custom_models:own_attention_lm' under mesh.context=2: its "
                                      r"step gathers nothing over the context axis"):
    job_lib.build_job(config)
  config.model.name = 'tests.custom_models:launcher_attention_lm'
  job = job_lib.build_job(config)
  assert job.mesh.shape['context'] == 2
  contract.check_alignment(job, 0)  # Its logits, in row order again, read no later input.



def test_a_mixture_of_experts_trains_the_same_with_rows_and_experts_split(tmp_path):
  """The two new axes together: a top-2-of-4 MoE on (data=2, expert=2, context=2) gives the losses of whole rows and
  whole experts on data=8 (the balanced row order reaches the router, which sees every token once either way)."""
  def moe(data=8, context=1, expert=1):
    c = _config(data=data, context=context, steps=5)
    c.model.num_experts, c.model.experts_per_token, c.mesh.expert = 4, 2, expert
    return c
  reference = _train(tmp_path / 'whole', moe())
  loop.run(moe(data=2, context=2, expert=2), str(tmp_path / 'split'), devices=jax.devices()[:8])
  _assert_same(read_metrics(tmp_path / 'split'), reference, steps=range(1, 6))
