"""A launch's start: it imports no kernel it may never run (splash attention for TPUs and the Triton grouped matmul load
on first use), and its garbage collector runs rarely, its imports left out.

The kernels' imports took 0.2 and 0.18 s of CPU after jax's own 0.8 s (benchmarks/bench_launch_imports.py), on every
launch, on every host, whatever the model. Run in a fresh interpreter: this test process has imported everything
already.
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


def test_a_launch_collects_rarely_and_leaves_its_imports_out_of_every_collection(tmp_path):
  """trainer/run/collector.py's settings reach a real launch: read as it exits, after jax and the trainer loaded.

  The config fails where the Job is built, after the imports, so the launch costs its imports and no trace.
  """
  import conftest
  from trainer.run import collector
  code = ('import atexit, gc, runpy, sys\n'
          'atexit.register(lambda: print("GC", gc.get_threshold(), gc.get_freeze_count(), flush=True))\n'
          f'sys.argv = ["launch.py", "--config=configs/tiny.py", "--workdir={tmp_path / "run"}", '
          '"--config.model.num_experts=4", "--config.model.experts_per_token=5"]\n'
          'runpy.run_path("launch.py", run_name="__main__")\n')
  result = subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=conftest.launcher_env())
  assert result.returncode == 2 and 'model.experts_per_token=5' in result.stderr, result.stderr[-2000:]
  threshold, frozen = result.stdout.split('GC ', 1)[1].rsplit(' ', 1)
  assert threshold == str(collector.THRESHOLD)
  assert int(frozen) > 100_000  # jax, flax, optax, Orbax, grain and the trainer: 189,799 objects at the pins.
