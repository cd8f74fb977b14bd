"""The shapes in which public models failed to come in, each now trained or refused in one line.

The JAX AI Stack tutorial's NamedSharding metadata (initializes, placed and split); a constructor flax
refuses (a plain list of layers: exit 2, not retried, under the supervisor); a
model file in a flax checkout's examples/ (its own line blamed, not the
launcher); nanodo's names that split nothing over fsdp/tensor (a warning with
the rule). The decoding-call model sampled under 'auto' is in
test_brought_models.py (its decoding_runs train under 'auto').
"""

import json
import sys
import sysconfig
import textwrap

import jax
import numpy as np
import pytest

from conftest import REPO, launcher_env, run_python
from configs import tiny
from parallel import param_names, sharding
from trainer.base import frames
from trainer.base.errors import UserError
from trainer.run import job, loop  # loop: a launcher module, for frames.owner.

# A model as flax's examples write one, placed (by the tests) in a folder .../flax/examples/lm1b/.
FLAX_EXAMPLE = textwrap.dedent('''\
    import jax.numpy as jnp
    from flax import nnx


    class ListOfLayers(nnx.Module):
      def __init__(self, config, *, rngs):
        self.layers = [nnx.Linear(4, 4, rngs=rngs)]  # flax 0.12 refuses a plain list: nnx.List(...).

      def __call__(self, tokens):
        return tokens


    class WrongReshape(nnx.Module):
      def __init__(self, config, *, rngs):
        self.embed = nnx.Embed(config.model.vocab_size, 8, rngs=rngs)

      def __call__(self, tokens):
        return self.embed(tokens).reshape(tokens.shape[0], -1, 3)  # The model's own mistake, found when traced.
    ''')


def _example_dir(root, module: str):
  folder = root / 'flax' / 'examples' / 'lm1b'
  folder.mkdir(parents=True)
  (folder / f'{module}.py').write_text(FLAX_EXAMPLE)
  return folder


def _config(name: str, mesh=(2, 2, 2)):
  c = tiny.get_config()
  c.model.name = name
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  c.data.source = 'synthetic'
  c.train.steps, c.train.warmup_steps, c.train.compute_dtype = 2, 0, 'float32'
  c.train.eval_batches, c.log.every_steps, c.ckpt.every_steps = 0, 1, 100
  return c


def _specs(built) -> dict[str, tuple]:
  return {sharding.path_name(p): tuple(s.spec) for p, s in
          jax.tree_util.tree_flatten_with_path(built.shardings.params)[0]}


def test_named_sharding_metadata_gives_its_specs_names_and_a_bias_with_its_kernels_spec_initializes():
  built = job.build_job(_config('tests.custom_models:NnxTutorialLM'))  # Its train step traced, too.
  specs = _specs(built)  # 'model' is a public name: over 'tensor' with no rule.
  assert specs == {'embed/embedding': (None, 'tensor'), 'hidden/kernel': (None, 'tensor'),
                   'hidden/bias': ('tensor',), 'out/kernel': ('tensor', None)}
  assert built.task.param_notes == {'hidden/bias': '2 names for 1 dims: the last 1 taken'}
  params = jax.jit(built.task.model.init, out_shardings=built.shardings.params)(jax.random.key(0))
  assert params['hidden']['bias'].sharding.shard_shape((64,)) == (32,)  # Placed on the launcher's mesh, split.
  assert np.isfinite(float(built.task.loss(params, _batch(built))[0]))


def _batch(built) -> dict:
  return {k: np.ones(s.shape, s.dtype) for k, s in built.abstract_batch.items()}


def test_frames_are_told_apart_by_package_not_by_a_flax_in_the_path(tmp_path):
  user_file = str(_example_dir(tmp_path, 'owned') / 'owned.py')
  assert frames.owner('owned', user_file) == 'user'
  assert frames.owner('flax.nnx.module', sys.modules['flax.nnx.module'].__file__) == 'library'
  assert frames.owner('trainer.run.loop', loop.__file__) == 'launcher'
  assert frames.owner('tests.custom_models', str(REPO / 'tests' / 'custom_models.py')) == 'user'
  installed = f'{sysconfig.get_paths()["purelib"]}/my_models/lm.py'  # A user's model package, pip-installed.
  assert frames.owner('my_models.lm', installed) == 'library'
  assert frames.owner('my_models.lm', installed, frames.model_package('my_models.lm:LM')) == 'user'
  assert frames.model_package('llama') is None and frames.model_package('trainer.models.llama:build') is None


def test_a_model_in_a_flax_checkouts_examples_is_blamed_for_its_own_error(tmp_path, monkeypatch):
  folder = _example_dir(tmp_path, 'flax_example_traced')
  monkeypatch.syspath_prepend(str(folder))
  with pytest.raises(UserError) as refused:
    job.build_job(_config('flax_example_traced:WrongReshape'))
  message = str(refused.value)
  assert f'(raised at {folder / "flax_example_traced.py"}:18)' in message, message
  assert 'change the model where it raised' in message and 'please report' not in message and '\n' not in message


def test_a_constructor_flax_refuses_is_one_line_exit_2_and_not_retried_by_the_supervisor(tmp_path):
  folder = _example_dir(tmp_path, 'models')  # Imported from the current directory, as lm1b's models.py.
  workdir = tmp_path / 'run'
  result = run_python([sys.executable, str(REPO / 'launch.py'), f'--config={REPO / "configs" / "tiny.py"}',
                       f'--workdir={workdir}', '--config.model.name=models:ListOfLayers',
                       '--config.data.source=synthetic', '--max_restarts=2', '--restart_backoff_s=0'],
                      env=launcher_env(LAUNCH_MAX_RESTARTS='2'), cwd=folder)
  assert result.returncode == 2, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith('launch.py: error:')]
  assert len(errors) == 1 and 'restarting' not in result.stderr and 'Traceback' not in result.stderr, result.stderr
  assert (f"model.name='models:ListOfLayers': building it (abstractly, before any step) raised ValueError: Found data "
          in errors[0])
  assert f'(raised at {folder / "models.py"}:7)' in errors[0] and 'please report' not in errors[0]
  attempts = [json.loads(line) for line in (workdir / 'attempts.jsonl').read_text().splitlines()]
  assert [(a['cause'], a['retried']) for a in attempts] == [('user error', False)]


def test_names_that_split_nothing_over_fsdp_or_tensor_are_one_line_with_the_rule_that_does():
  config = _config('tests.third_party.vocab_models:linen_nanodo', mesh=(1, 4, 2))  # nanodo names its axis 'data'.
  config.parallel.extra_axis_rules = ()

  def note(built):
    return param_names.unsplit_note(built.task.model.abstract_boxed, built.shardings.params, dict(built.mesh.shape),
                                    built.task.param_notes, config.model.name)

  built = job.build_job(config)
  assert not any('fsdp' in s or 'tensor' in s for s in _specs(built).values())
  line = note(built)
  assert line.startswith("mesh.fsdp=4 x mesh.tensor=2 splits none of the 7 parameters model.name="), line
  rule = '(' + line.split('--config.parallel.extra_axis_rules="(')[1].split('"')[0]
  assert rule == "(('data', 'fsdp'),)"
  config.parallel.extra_axis_rules = eval(rule)  # The rule the line gives splits them.
  built = job.build_job(config)
  assert sum('fsdp' in s for s in _specs(built).values()) == 7 and note(built) is None
