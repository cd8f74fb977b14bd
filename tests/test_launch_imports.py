"""A launch imports no kernel it may never run: splash attention (TPU) and the Triton grouped matmul load on first use.

Their imports took 0.2 and 0.18 s of CPU after jax's own 0.8 s (benchmarks/bench_launch_imports.py), on every launch,
on every host, whatever the model. Run in a fresh interpreter: this test process has imported everything already.
"""

import subprocess
import sys

from conftest import REPO

LAZY = ('jax.experimental.pallas.ops.tpu.splash_attention', 'jax.experimental.pallas.triton')


def test_the_launch_modules_leave_the_kernels_unimported():
  code = ('import sys; import trainer.run.loop, trainer.run.plan, trainer.hf.load, parallel.distributed; '
          f'print([m for m in {LAZY!r} if m in sys.modules])')
  result = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=True)
  assert result.stdout.strip() == '[]', result.stdout


def test_the_kernels_load_when_first_used():
  code = ('import sys; from trainer.attention import splash; from trainer.models import grouped_matmul; '
          'splash.block_sizes(512); grouped_matmul._pallas(); '
          f'print([m for m in {LAZY!r} if m in sys.modules])')
  result = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=True)
  assert result.stdout.strip() == repr(list(LAZY)), result.stdout
