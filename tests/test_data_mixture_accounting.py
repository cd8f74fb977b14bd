"""Per-source accounting of a mixture in a real launch: the training loss, tokens and tokens seen per source, and
the eval loss on each source's held-out rows, each checked against a reference computed here by hand (numpy log
softmax over the checkpointed parameters and the rows the data iterator gives)."""

import pathlib

import jax
import numpy as np
import pytest

from configs import tiny
from conftest import read_metrics, run_launcher
from parallel import sharding
from trainer import data
from trainer.data import PackedRows, token_shards
from trainer.run import job as job_lib
from trainer.training import checkpoint

NAMES = ('web', 'code', 'math')
BAND = 80  # Source k's tokens lie in [k*BAND, (k+1)*BAND).
STEPS, BATCH, SEQ = 4, 8, 16


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
  root = tmp_path_factory.mktemp('accounting')
  rng = np.random.default_rng(3)
  paths = []
  for k, name in enumerate(NAMES):
    docs = [rng.integers(k * BAND, (k + 1) * BAND, size=int(rng.integers(8, 50))) for _ in range(60)]
    (root / name).mkdir()
    token_shards.write_shards(root / name, {'train': docs[12:], 'eval': docs[:12]}, 256, 'bytes', 2)
    paths.append(str(root / name))
  return paths


def _overrides(folders, workdir, stages='((3, (0.2, 0.2, 0.6)),)'):
  mixture = tuple(zip(folders, (0.5, 0.3, 0.2)))
  return [f'--workdir={workdir}', '--config=configs/tiny.py', '--config.data.source=mixture',
          f'--config.data.mixture={mixture!r}', f'--config.data.mixture_stages={stages}',
          '--config.data.packing=True', f'--config.data.seq_len={SEQ}', f'--config.train.batch_size={BATCH}',
          f'--config.train.steps={STEPS}', '--config.log.every_steps=1', f'--config.train.eval_every_steps={STEPS}',
          '--config.train.eval_batches=2', '--config.ckpt.every_steps=1', f'--config.ckpt.max_to_keep={STEPS}',
          '--config.train.compute_dtype=float32']


def _config(folders):
  config = tiny.get_config()
  config.data.source, config.data.mixture = 'mixture', tuple(zip(folders, (0.5, 0.3, 0.2)))
  config.data.mixture_stages = ((3, (0.2, 0.2, 0.6)),)
  config.data.packing, config.data.seq_len, config.data.prefetch = True, SEQ, 0
  config.train.batch_size, config.train.steps, config.train.compute_dtype = BATCH, STEPS, 'float32'
  config.train.eval_batches = 2
  config.ckpt.max_to_keep = STEPS
  for key in config.mesh:
    config.mesh[key] = 1
  config.parallel.strategy = 'jit'
  return config


def _token_losses(job, params, batch) -> np.ndarray:
  """Cross entropy of every target token, by hand: log softmax in numpy over the model's logits."""
  logits = np.asarray(jax.jit(job.task.outputs)(params, {k: np.asarray(v) for k, v in batch.items()}), np.float64)
  logits -= logits.max(-1, keepdims=True)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return -np.take_along_axis(log_probs, batch['targets'][..., None].astype(np.int64), -1)[..., 0]


def test_losses_and_tokens_per_source_match_a_hand_reference(folders, tmp_path):
  result = run_launcher(*_overrides(folders, tmp_path / 'run'), timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  records = {r['step']: r for r in read_metrics(tmp_path / 'run') if 'step' in r}
  config = _config(folders)
  job = job_lib.build_job(config, devices=jax.devices('cpu')[:1])

  def params_at(step):
    ckpt = checkpoint.Checkpointer(str(tmp_path / 'run'), config.ckpt, move_damaged=False)
    state = ckpt.restore_state(step, sharding.with_shardings(job.abstract, job.shardings))
    ckpt.close()
    return state.params

  batches = [next(it) for it in [data.train_iterator_for(config)] for _ in range(STEPS)]
  seen = np.zeros(3)
  for step, batch in enumerate(batches, start=1):
    source = batch['inputs'][:, 0] // BAND
    seen += np.bincount(source, minlength=3) * SEQ
    record = records[step]
    assert [record[f'tokens_seen/{n}'] for n in NAMES] == seen.tolist()
    assert [record[f'tokens/{n}'] for n in NAMES] == (np.bincount(source, minlength=3) * SEQ).tolist()
  # The training loss of step 3 per source: the parameters after step 2 on batch 3, the tokens of that source.
  losses = _token_losses(job, params_at(2), batches[2])
  source = batches[2]['inputs'][:, 0] // BAND
  for k, name in enumerate(NAMES):
    assert (source == k).any()
    assert records[3][f'loss/{name}'] == pytest.approx(losses[source == k].mean(), rel=2e-5), name
  # Eval per source at the last step: the first 2 batches of each source's held-out rows, unshuffled, averaged per
  # batch as every eval is.
  final = params_at(STEPS)
  for k, (name, folder) in enumerate(zip(NAMES, folders)):
    rows = PackedRows(token_shards.load_documents(pathlib.Path(folder), 'eval'), SEQ)
    means = []
    for b in range(2):
      picked = [rows[i] for i in range(b * BATCH, (b + 1) * BATCH)]
      batch = {key: np.stack([r[key] for r in picked]) for key in picked[0]}
      batch['source_ids'] = np.full_like(batch['inputs'], k + 1)
      means.append(_token_losses(job, final, batch).mean())
    assert records[STEPS][f'eval_loss/{name}'] == pytest.approx(np.mean(means), rel=2e-5), name
  assert records[STEPS]['eval_loss'] == pytest.approx(np.mean([records[STEPS][f'eval_loss/{n}'] for n in NAMES]),
                                                      rel=1e-5)


def test_a_relaunch_on_another_data_axis_continues_with_the_same_batches(folders, tmp_path):
  """Steps 1-2 on data=8, then a relaunch to step 4 on data=2 x fsdp=4 (changed weights at step 3 as planned):
  per step the same rows per source as an uninterrupted run, and the same losses to float rounding."""
  whole = run_launcher(*_overrides(folders, tmp_path / 'whole'), timeout=600)
  assert whole.returncode == 0, whole.stderr[-3000:]
  first = run_launcher(*_overrides(folders, tmp_path / 'split'), '--config.train.steps=2', timeout=600)
  assert first.returncode == 0, first.stderr[-3000:]
  again = run_launcher(*_overrides(folders, tmp_path / 'split'), '--config.mesh.data=2', '--config.mesh.fsdp=4',
                       timeout=600)
  assert again.returncode == 0, again.stderr[-3000:]
  expected = {r['step']: r for r in read_metrics(tmp_path / 'whole') if 'step' in r}
  got = {r['step']: r for r in read_metrics(tmp_path / 'split') if 'step' in r}
  assert [r['step'] for r in read_metrics(tmp_path / 'split') if 'loss' in r] == [1, 2, 3, 4]  # Resumed at 3.
  assert 'Restored' in again.stderr or 'resum' in again.stderr.lower()
  for step in (3, 4):
    for name in NAMES:
      assert got[step][f'tokens/{name}'] == expected[step][f'tokens/{name}']
      assert got[step][f'tokens_seen/{name}'] == expected[step][f'tokens_seen/{name}']
      assert got[step][f'loss/{name}'] == pytest.approx(expected[step][f'loss/{name}'], rel=1e-4)
    assert got[step]['loss'] == pytest.approx(expected[step]['loss'], rel=1e-4)


def test_a_bad_mixture_stops_the_launch_in_one_line_before_compiling(folders, tmp_path):
  result = run_launcher(*_overrides(folders, tmp_path / 'bad', stages='((3, (0, 0, 0)),)'), timeout=300)
  assert result.returncode == 2, result.stderr[-3000:]
  assert 'data.mixture_stages step 3: weights (0, 0, 0) sum to 0' in result.stderr.strip().splitlines()[-1]
  assert 'FLOPs per step' not in result.stderr and 'compil' not in result.stderr.lower()
