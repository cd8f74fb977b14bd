"""Device memory before the first step: the pre-flight refusal, remat 'auto', and the choice kept across relaunches.

One small model on ONE fake CPU device (each compile is cheap there), whose
compiled footprints differ by policy: ~16 MB with remat 'none', ~7 MB with
'full'. The CPU reports no memory limit, so train.device_memory_gb sets it.
"""

import hashlib
import re
import logging
import pathlib
import sys

import jax
import pytest

from configs import tiny
from conftest import REPO, launcher_env, make_text_dir, run_python, xla_flags
from trainer.base.errors import UserError
from trainer.memory import footprint, remat
from trainer.run import loop, plan

GIB = footprint.GIB


def _config(text_dir, **train):
  c = tiny.get_config()
  c.data.seq_len = 128  # Activations, which remat trades, dominate the ~100 KB of parameters and Adam state.
  c.data.text_dir = str(text_dir)
  c.train.steps, c.ckpt.every_steps, c.log.every_steps, c.log.progress_bar = 2, 2, 1, 'off'
  c.train.remat_policy = 'auto'
  c.train.update(train)
  return c


def _need(config, policy, accum=1):
  return remat.step_bytes(plan.with_overrides(config, {'train.remat_policy': policy, 'train.grad_accum_steps': accum}),
                          jax.devices()[:1], plan.total_or_refused)[0]


def _tree_digest(root: pathlib.Path) -> dict[str, str]:
  return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else 'dir'
          for p in sorted(root.rglob('*'))}


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A 2-step run whose limit lies halfway between the 'full' and 'none' footprints: (workdir, config, log)."""
  root = tmp_path_factory.mktemp('memory')
  (root / 'text').mkdir()
  config = _config(make_text_dir(root / 'text'))
  full, none = _need(config, 'full'), _need(config, 'none')
  assert full < 0.7 * none  # The premise: remat matters for this model.
  config.train.device_memory_gb = (full + none) / 2 / GIB
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  absl_logger = logging.getLogger('absl')
  level = absl_logger.level
  absl_logger.addHandler(handler)
  absl_logger.setLevel(logging.INFO)  # The choice and the pre-flight verdict are INFO lines.
  try:
    loop.run(config, str(root / 'work'), devices=jax.devices()[:1])
  finally:
    absl_logger.removeHandler(handler)
    absl_logger.setLevel(level)
  return root / 'work', config, [r.getMessage() for r in records], (full, none)


def test_auto_picks_a_policy_between_full_and_none_trains_and_records_it(trained):
  workdir, config, log, (full, none) = trained
  choice = next(line for line in log if line.startswith("remat 'auto': "))
  chosen = choice.split("'")[3]
  assert chosen not in ('none', 'full') and chosen in remat.RECOMPUTE_ORDER, choice
  assert 'none (' in choice.split('did not fit')[1]  # Named among the candidates that did not fit.
  assert full < _need(config, chosen) <= (full + none) / 2 * (1 - footprint.MARGIN)
  manifest = remat.previous_choice(str(workdir))
  assert manifest['remat_policy'] == chosen and manifest['grad_accum_steps'] == 1
  assert f'"remat_policy": "{chosen}"' in (workdir / 'config.json').read_text()  # What ran, not 'auto'.
  assert any(line.startswith('Pre-flight: Fits:') for line in log)


def test_relaunch_keeps_the_choice_without_compiling_candidates(trained, monkeypatch):
  workdir, config, _, _ = trained
  first = remat.previous_choice(str(workdir))
  monkeypatch.setattr(plan, 'total_or_refused', lambda *a: pytest.fail('compiled a candidate'))
  resolved, choice = remat.resolve(config, jax.devices()[:1], workdir=str(workdir))
  assert (choice.remat_policy, choice.grad_accum_steps) == (first['remat_policy'], first['grad_accum_steps'])
  assert 'as chosen when this run started' in choice.summary
  assert resolved.train.remat_policy == first['remat_policy']
  changed = plan.with_overrides(config, {'data.seq_len': 64})  # A memory-relevant change: chosen afresh.
  limit = footprint.device_limit(changed.train.device_memory_gb, jax.devices()[:1])
  assert remat.fingerprint(changed, jax.devices()[:1], limit) != first['fingerprint']


def test_auto_raises_grad_accum_when_no_policy_fits_the_batch(trained):
  _, config, _, (full, _) = trained
  config = plan.with_overrides(config, {'train.device_memory_gb': full / GIB})  # Under 'full' with the margin.
  resolved, choice = remat.resolve(config, jax.devices()[:1], measure_fn=plan.total_or_refused)
  assert resolved.train.grad_accum_steps == choice.grad_accum_steps == 2
  assert choice.needed_bytes <= full * (1 - footprint.MARGIN)
  # 'full' at one microbatch (the least memory it has, with the loss in slices where that is tried) did not fit.
  assert re.search(r"did not fit with .*full( with loss_chunks=\d+)? \(", choice.summary), choice.summary


def test_auto_without_a_known_limit_is_none_and_says_why(tmp_path):
  config = _config(tmp_path)
  resolved, choice = remat.resolve(config, jax.devices()[:1])
  assert resolved.train.remat_policy == 'none' and choice.needed_bytes is None
  assert 'train.device_memory_gb is unset' in choice.summary
  config.model.name = 'tests.custom_models:MlpLM'  # A brought model whose builder takes no remat_policy.
  assert "takes no remat policy" in remat.resolve(config, jax.devices()[:1])[1].summary
  from trainer.run import job as job_lib
  job = job_lib.build_job(_config(tmp_path), jax.devices()[:1])  # Building the Job makes the choice.
  assert job.config.train.remat_policy == 'none' and job.memory.summary == choice.summary
  with pytest.raises(UserError, match="remat_policy='auto' is chosen by compiling candidates when the Job is built"):
    from trainer.training import validation
    validation.validate_config(_config(tmp_path))


def test_over_budget_launch_exits_2_with_fixes_and_leaves_the_workdir_untouched(trained):
  workdir, config, _, (full, _) = trained
  half = _need(plan.with_overrides(config, {'train.remat_policy': 'full'}), 'full', accum=2)
  limit_gb = (full + half) / 2 / GIB  # 'full' does not fit; 'full' over 2 microbatches does.
  before = _tree_digest(workdir)
  env = launcher_env(XLA_FLAGS=xla_flags(1))
  result = run_python(
      [sys.executable, str(REPO / 'launch.py'), '--config=configs/tiny.py', f'--workdir={workdir}', '--start_over',
       '--config.data.seq_len=128', f'--config.data.text_dir={config.data.text_dir}',
       '--config.train.remat_policy=full', f'--config.train.device_memory_gb={limit_gb}'], env=env, timeout=300)
  assert result.returncode == 2, result.stderr[-3000:]
  error = [line for line in result.stderr.splitlines() if line.startswith('launch.py: error:')]
  assert len(error) == 1, result.stderr[-3000:]
  assert f'the compiled train step needs {footprint.gib(full)} per device, over the {footprint.gib(limit_gb * GIB)} ' \
         f'available (train.device_memory_gb=' in error[0]
  assert 'Changes that fit: ' in error[0] and '--config.train.grad_accum_steps=2' in error[0]
  assert 'no step was run and no checkpoint was written' in error[0]  # What it says is what happened:
  # --start_over moved nothing, no config.json/metrics/sharding.txt written; the launch's own lock file (taken before
  # anything else, trainer/safety/lock.py) stays behind empty, released.
  after = _tree_digest(workdir)
  assert after.pop('launch.lock') == hashlib.sha256(b'').hexdigest()
  assert after == before


def test_limit_comes_from_the_setting_else_the_devices_reported_bytes_limit():
  class Gpu:
    process_index, device_kind, platform = 0, 'NVIDIA H100 80GB HBM3', 'gpu'

    def __init__(self, limit):
      self.limit = limit

    def memory_stats(self):
      return {'bytes_limit': self.limit}

  limit = footprint.device_limit(None, [Gpu(80 * GIB), Gpu(79 * GIB)])  # train.device_memory_gb unset.
  assert limit.bytes == 79 * GIB and 'reported bytes_limit' in limit.source  # The smallest local device.
  assert footprint.device_limit(40, [Gpu(80 * GIB)]).bytes == 40 * GIB  # The setting holds memory back.
  assert footprint.device_limit(None, jax.devices()[:1]).bytes is None  # The CPU reports none.
  assert footprint.verdict(97 * GIB, footprint.Limit(100 * GIB, 'x')).startswith('Fits with little margin')
  assert footprint.verdict(90 * GIB, footprint.Limit(100 * GIB, 'x')).startswith('Fits: 90.00 GiB of 100.00 GiB')
  assert footprint.verdict(101 * GIB, footprint.Limit(100 * GIB, 'x')).startswith('Does not fit: 101.00 GiB')


def test_auto_takes_a_chunked_loss_when_it_lets_a_faster_policy_fit(tmp_path):
  """Logits that dominate (vocab 4096 on d_model 32): 'none' fits only with the loss in slices, which beats 'full'."""
  config = _config(tmp_path, device_memory_gb=None)
  config.model.vocab_size = 4096
  config.data.source = 'synthetic'
  one = jax.devices()[:1]
  need = lambda policy, chunks: remat.step_bytes(plan.with_overrides(config, {
      'train.remat_policy': policy, 'train.grad_accum_steps': 1, 'train.loss_chunks': chunks}), one,
      plan.total_or_refused)[0]
  chunks = 8  # What measure.loss_chunks_worth_trying offers for seq_len 128.
  none_whole, none_sliced = need('none', 1), need('none', chunks)
  assert none_sliced < 0.8 * none_whole  # The premise: the logits are a large share of the step.
  config.train.device_memory_gb = (none_sliced / (1 - footprint.MARGIN) + 1024) / GIB
  resolved, choice = remat.resolve(config, one, log_fn=lambda line: None, measure_fn=plan.total_or_refused)
  assert (choice.remat_policy, choice.loss_chunks) == ('none', chunks), choice
  assert resolved.train.loss_chunks == chunks and resolved.train.remat_policy == 'none'
  assert f"'none' with grad_accum_steps=1 and train.loss_chunks={chunks} (the logits in slices)" in choice.summary
  assert choice.record()['loss_chunks'] == chunks


def test_plan_and_remat_do_not_import_each_other():
  import ast
  def imports(path):
    tree = ast.parse((REPO / path).read_text())
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names} | {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
  remat = imports('trainer/memory/remat.py')
  assert 'plan' not in remat and 'trainer.run.plan' not in remat
