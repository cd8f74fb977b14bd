"""The step compiles exactly once per run, a relaunch hits the persistent cache, and the loop logs TFLOP/s."""

import json
import os
import re
import subprocess
import sys

from conftest import REPO

TINY = '--config=configs/tiny.py'
_XLA_COMPILE = re.compile(r'Finished XLA compilation of jit\(train_step\) in ([0-9.]+) sec')


def _run(workdir, cache_dir):
  # JAX_LOG_COMPILES makes jax log every compilation (with its time) at WARNING level, which the launcher shows.
  env = dict(os.environ, JAX_LOG_COMPILES='1')
  return subprocess.run([sys.executable, str(REPO / 'launch.py'), TINY, f'--workdir={workdir}',
                         '--config.train.steps=3', '--config.log.every_steps=1', '--config.train.z_loss_weight=1e-4',
                         f'--config.train.compilation_cache_dir={cache_dir}'],
                        cwd=REPO, capture_output=True, text=True, timeout=300, env=env)


def test_train_step_compiles_once_and_a_relaunch_loads_it_from_the_cache(tmp_path):
  cache = tmp_path / 'xla_cache'
  cold = _run(tmp_path / 'cold', cache)
  assert cold.returncode == 0, cold.stderr[-2000:]
  warm = _run(tmp_path / 'warm', cache)
  assert warm.returncode == 0, warm.stderr[-2000:]
  cold_times = [float(t) for t in _XLA_COMPILE.findall(cold.stderr)]
  warm_times = [float(t) for t in _XLA_COMPILE.findall(warm.stderr)]
  assert len(cold_times) == 1 and len(warm_times) == 1, (cold_times, warm_times)  # Once per run, steps 1..3.
  assert any(p.name.startswith('jit_train_step-') for p in cache.iterdir())
  assert "Persistent compilation cache hit for 'jit_train_step'" in warm.stderr
  assert warm_times[0] < 0.5 * cold_times[0], (cold_times, warm_times)

  records = [json.loads(line) for line in (tmp_path / 'cold' / 'metrics.jsonl').read_text().splitlines()]
  train = [r for r in records if 'loss' in r]
  assert [r['step'] for r in train] == [1, 2, 3]
  tokens = 8 * 32  # tiny: batch 8 x seq_len 32.
  for r in train:
    # TFLOP/s per device follows from the logged step time; no MFU on CPU, which has no peak in the table.
    assert r['tflops_per_device'] > 0 and 'mfu' not in r and 'mfu_6n' not in r
    assert 0 < r['z_loss'] < 1e-4 * 100  # 1e-4 * logsumexp^2, with logsumexp near log(256) at the start.
    flops_per_step = r['tflops_per_device'] * 1e12 * 8 * r['step_time_s']
    assert abs(flops_per_step / tokens - _tiny_traced_flops_per_token()) < 1e-6 * flops_per_step


def _tiny_traced_flops_per_token():
  """The analytic matmul count with causal attention unhalved: what the traced count is (tests/test_flops.py)."""
  from configs import tiny
  from trainer.observe import flops
  c = tiny.get_config()
  b, t = c.train.batch_size, c.data.seq_len
  return flops.step_flops(c.model, b, t).matmul_unmasked / (b * t)
