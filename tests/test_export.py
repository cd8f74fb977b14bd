"""scripts/export_params.py: a parameters-only checkpoint that plain Orbax reads without this project."""

import os
import re
import subprocess
import sys

import jax
import numpy as np

from configs import tiny
from conftest import REPO, run_python
from trainer import data
from trainer.run import job as job_lib
from trainer.training import checkpoint
from trainer.training import manifest as manifests

READER = '''
import json, sys
import jax, numpy as np, orbax.checkpoint as ocp
try:
  import trainer
  sys.exit('the project is importable here; the test would prove nothing')
except ImportError:
  pass
path = sys.argv[1]
meta = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
params = ocp.PyTreeCheckpointer().restore(
    path, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta))
flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
np.savez(sys.argv[2], **flat)
'''


def test_export_writes_params_only_readable_by_plain_orbax(tmp_path):
  text_dir = tmp_path / 'text'
  text_dir.mkdir()
  (text_dir / 'a.py').write_bytes(bytes(np.random.default_rng(0).integers(32, 127, 20000, dtype=np.uint8)))
  config = tiny.get_config()
  config.data.text_dir = str(text_dir)
  config.mesh.fsdp = 4  # Saved sharded 4 ways: the export must not depend on the layout.
  job = job_lib.build_job(config)
  state = job.init_state(3)
  ckpt = checkpoint.Checkpointer(str(tmp_path / 'run'), config.ckpt)
  iterator = data.train_iterator_for(config)
  ckpt.save(6, state, iterator, manifests.run_manifest(config, job.abstract, job.mesh), force=True)
  ckpt.close()
  expected = {jax.tree_util.keystr(p): np.asarray(v)
              for p, v in jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]}

  out = tmp_path / 'exported'
  export = run_python([sys.executable, str(REPO / 'scripts/export_params.py'), '--config=configs/tiny.py',
                       '--config.mesh.fsdp=4', f'--config.data.text_dir={text_dir}',
                       f'--workdir={tmp_path / "run"}', f'--output={out}'], timeout=600)
  assert export.returncode == 0, export.stderr[-3000:]
  assert 'Exported the parameters of step 6' in export.stderr
  # Only this project's INFO lines (Orbax logs dozens per restore and save): each names a file of this repository.
  own = {p.name for part in ('trainer', 'parallel', 'scripts', 'configs') for p in (REPO / part).glob('**/*.py')}
  info = re.findall(r'^I\d{4} [^\]]* (\S+?):\d+\]', export.stderr, re.M)
  assert info and set(info) <= own, sorted(set(info) - own)

  # -I: no PYTHONPATH, no user site; cwd outside the repo: only the installed packages (orbax, jax, numpy).
  env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'XLA_FLAGS')}
  read = subprocess.run([sys.executable, '-I', '-c', READER, str(out), str(tmp_path / 'read.npz')],
                        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
  assert read.returncode == 0, read.stderr[-3000:]
  got = dict(np.load(tmp_path / 'read.npz'))
  assert got.keys() == expected.keys()  # The parameter tree alone: no opt_state, step or rng.
  for key, value in expected.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)

  again = run_python([sys.executable, str(REPO / 'scripts/export_params.py'), '--config=configs/tiny.py',
                      f'--workdir={tmp_path / "run"}', f'--output={out}'], timeout=600)
  assert again.returncode == 2 and f'--output={out} exists' in again.stderr
