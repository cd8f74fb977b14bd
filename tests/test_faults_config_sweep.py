"""Every bad value of the keys added by MoE, the context axis, Hugging Face import, optimizers, schedules, storage and
the supervisor: one line naming the key, exit 2, and no retry, from a supervised launch (issue 39, item 4).

Each row of ROWS is a real launch (configs/tiny.py, 8 fake CPU devices, --max_restarts=2), so a value that slipped
past the checks would show here as a traceback, a crash retried by the supervisor, or a run that trains.

The rows of CHECKED_AFTER_JAX fail where the launch builds its Job (hf_load.configure, then build_job), after jax
loaded: 2 s of CPU each as a launch. They are checked in this process, on the config the launch's own flag parsing
builds: the UserError must name the key. launch.py turns every UserError into one line and exit 2, never retried,
which the launched rows prove, one of them of this kind (a MoE key) as a launch. Each key alone (its type and range,
issue 54) is refused before anything starts, the whole table in tests/test_config_schema.py.
"""

import json
import re
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from conftest import REPO, launcher_env, run_python

NONE_CONFIG = 'def get_config():\n  c = None\n  return c\n'

# (flags, words the one line must hold). The workdir is added unless a row gives its own.
ROWS = [
    # Checked after jax loads, as a launch (the others of their kind are in CHECKED_AFTER_JAX).
    (['--config.model.num_experts=3', '--config.mesh.expert=2', '--config.mesh.data=4'],
     'model.num_experts=3 must be a multiple of mesh.expert=2'),
    # A name outside its choices: refused with every key's range, before jax (trainer/base/config_schema.py).
    (['--config.train.optimizer=adamx'], "train.optimizer='adamx'"),
    # Storage.
    (['--workdir=gs://tb/run'], "'tb' cannot be a Cloud Storage bucket"),
    (['--workdir=gs://My_Bucket/run'], "'My_Bucket' cannot be a Cloud Storage bucket"),
    (['--workdir=gs://google-runs/run'], 'reserves'),
    (['--workdir=gs://192.168.1.1/run'], 'IP address'),
    (['--config.ckpt.storage_deadline_s=-1'], 'ckpt.storage_deadline_s=-1'),
    # The supervisor.
    (['--max_restarts=-1'], '--max_restarts=-1 is not a count of restarts'),
    (['--restart_backoff_s=-1'], '--restart_backoff_s=-1'),
    (['--config.train.hang_timeout_s=-5'], 'train.hang_timeout_s=-5'),
    (['--config.train.straggler_warn_fraction=-1'], 'train.straggler_warn_fraction=-1'),
    (["--config.train.preemption_signals=('SIGKILL',)"], 'train.preemption_signals'),
    (['LAUNCH_MAX_RESTARTS=-1'], "LAUNCH_MAX_RESTARTS='-1' is not a count"),
    # The config file itself.
    (['CONFIG_RETURNS_NONE'], 'get_config() returned None'),
    # Every key's type and range, before anything starts (issue 54; the whole table: tests/test_config_schema.py).
    (['--config.train.steps=100000000000000000000'], 'train.steps=100000000000000000000 must be an integer >= 1 '
                                                      'and <= 2147483647 (--config file configs/tiny.py'),
    (['--config.train.learning_rate=inf'], 'train.learning_rate=inf must be a number > 0 and <= 3.4e+38'),
    (['--config.log.wandb_mode=sometimes'], "log.wandb_mode='sometimes' must be one of 'online', 'offline'"),
    (['--config.model.d_model=1000000000'], "model.d_model=1000000000 makes the stacked layers' attention weights"),
    # get_config() raising or returning something else: the file, the line and the error in its own words.
    (['CONFIG_EXITS_0'], 'line 2: the file raised SystemExit(0) instead of returning a config; nothing was started'),
    (['CONFIG_EXITS_3'], 'line 2: the file raised SystemExit(3) instead of returning a config'),
    (['CONFIG_RAISES_VALUE_ERROR'], 'line 2: get_config() raised ValueError: no preset named x; fix the file.'),
    (['CONFIG_RETURNS_DICT'], 'get_config() returned a dict, not an ml_collections ConfigDict'),
]
# The config files of the rows named CONFIG_*.
CONFIG_FILES = {
    'CONFIG_RETURNS_NONE': NONE_CONFIG,
    'CONFIG_EXITS_0': 'def get_config():\n  raise SystemExit(0)\n',
    'CONFIG_EXITS_3': 'def get_config():\n  raise SystemExit(3)\n',
    'CONFIG_RAISES_VALUE_ERROR': 'def get_config():\n  raise ValueError("no preset named x")\n',
    'CONFIG_RETURNS_DICT': 'from configs import tiny\n\ndef get_config():\n  return tiny.get_config().to_dict()\n',
}

CHECKED_AFTER_JAX = [
    # Mixtures of experts.
    (['--config.model.num_experts=4', '--config.model.experts_per_token=5'], 'model.experts_per_token=5'),
    (['--config.model.num_experts=-2'], 'model.num_experts=-2'),
    (['--config.model.num_experts=4', '--config.model.moe_layers=3'], 'model.moe_layers=3'),
    (['--config.model.num_experts=4', '--config.model.expert_capacity_factor=-1'], 'model.expert_capacity_factor'),
    (['--config.model.num_experts=4', '--config.model.router_aux_loss_weight=-1'], 'model.router_aux_loss_weight=-1'),
    # The context axis.
    (['--config.mesh.context=2', '--config.mesh.data=4', '--config.data.seq_len=30'], 'data.seq_len=30'),
    (['--config.mesh.context=2', '--config.mesh.data=4', '--config.parallel.strategy=pmap'], 'mesh.context=2'),
    (['--config.model.context_scheme=bogus'], 'model.context_scheme'),
    # Hugging Face import.
    (['--config.model.init_from=hf:/nonexistent-issue-39'], 'model.init_from'),
    (['--config.model.init_from=/nonexistent-issue-39'], "give 'hf:'"),
    # Optimizers and schedules.
    (['--config.train.adam_b1=1.5'], 'train.adam_b1=1.5 must be in [0, 1)'),
    (['--config.train.optimizer=lion', '--config.train.lion_b1=2'], 'train.lion_b1=2'),
    (['--config.train.optimizer=muon', '--config.train.muon_beta=-1'], 'train.muon_beta=-1'),
    (['--config.train.optimizer=sgd', '--config.train.sgd_momentum=-1'], 'train.sgd_momentum=-1'),
    (['--config.train.optimizer=adafactor', '--config.train.adafactor_decay_rate=-1'], 'train.adafactor_decay_rate'),
    (['--config.train.weight_decay=-1'], 'train.weight_decay=-1'),
    (['--config.train.schedule=cosinus'], "train.schedule='cosinus'"),
    (['--config.train.end_learning_rate_ratio=-1'], 'train.end_learning_rate_ratio=-1'),
    (['--config.train.schedule=wsd', '--config.train.decay_fraction=1.5'], 'train.decay_fraction=1.5'),
    (['--config.train.ema_decay=1.5'], 'train.ema_decay=1.5'),
]


@pytest.mark.parametrize('flags, expected', ROWS, ids=[' '.join(r[0])[:60] for r in ROWS])
def test_a_bad_value_is_one_line_exit_2_and_never_retried(tmp_path, flags, expected):
  env = launcher_env(LAUNCH_MAX_RESTARTS='2')
  config = 'configs/tiny.py'
  if flags[0] in CONFIG_FILES:
    config = tmp_path / 'config_file.py'
    config.write_text(CONFIG_FILES[flags[0]])
    flags = []
  if flags and flags[0].startswith('LAUNCH_MAX_RESTARTS='):
    env['LAUNCH_MAX_RESTARTS'], flags = flags[0].split('=', 1)[1], []
  workdir = tmp_path / 'run'
  if not any(f.startswith('--workdir=') for f in flags):
    flags = [*flags, f'--workdir={workdir}']
  result = run_python([sys.executable, str(REPO / 'launch.py'), f'--config={config}', '--config.train.steps=4',
                       '--restart_backoff_s=0', *flags], env=env,
                      timeout=300)
  assert result.returncode == 2, result.stderr[-3000:]
  # Only absl INFO lines ("I1126 ...") may come before the one line: no warning, traceback or restart.
  lines = [l for l in result.stderr.splitlines() if l.strip() and not re.match(r'I\d{4} ', l)]
  assert len(lines) == 1, lines
  assert lines[0].startswith('launch.py: error: ') and expected in lines[0], lines[0]
  attempts = workdir / 'attempts.jsonl'
  if attempts.exists():  # Refused in the child: one attempt, recorded as not retried.
    [record] = [json.loads(l) for l in attempts.read_text().splitlines()]
    assert (record['exit_code'], record['cause'], record['retried']) == (2, 'user error', False)
  assert not (workdir / 'checkpoints').exists() or not any((workdir / 'checkpoints').iterdir())


def test_a_keyboard_interrupt_raised_by_the_config_file_is_one_line_and_exit_130(tmp_path):
  """Ctrl-C's exit code, which the supervisor does not retry: a real Ctrl-C is answered before it could raise one
  (trainer/safety/startup_signals.py), so this is almost always the file's own, but the line says both."""
  config = tmp_path / 'config_file.py'
  config.write_text('def get_config():\n  raise KeyboardInterrupt\n')
  result = run_python([sys.executable, str(REPO / 'launch.py'), f'--config={config}', f'--workdir={tmp_path / "run"}'],
                      env=launcher_env(LAUNCH_MAX_RESTARTS='2'), timeout=300)
  assert result.returncode == 130, result.stderr[-3000:]
  lines = [l for l in result.stderr.splitlines() if l.strip() and not re.match(r'I\d{4} ', l)]
  assert lines == [f'launch.py: interrupted: --config file {config}, line 2: KeyboardInterrupt while the file ran (a '
                   f'Ctrl-C, or raised by the file); nothing was started.'], lines
  assert not (tmp_path / 'run').exists()


@pytest.mark.filterwarnings('ignore:the load_module')  # config_flags loads the config file as launch.py's does.
@pytest.mark.parametrize('overrides, expected', CHECKED_AFTER_JAX,
                         ids=[' '.join(r[0])[:60] for r in CHECKED_AFTER_JAX])
def test_a_bad_value_checked_after_jax_loads_is_a_user_error_naming_the_key(overrides, expected):
  from trainer.base.errors import UserError
  from trainer.hf import load as hf_load
  from trainer.run import job as job_lib
  argv = ['launch.py', f'--config={REPO / "configs/tiny.py"}', '--config.train.steps=4', *overrides]
  parsed = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, flag_values=parsed, sys_argv=argv)
  parsed(argv)
  with pytest.raises(UserError) as raised:  # What launch.py runs up to the Job, in its order.
    config = hf_load.configure(parsed.config, config_flags.get_override_values(parsed['config']))
    job_lib.build_job(config)
  assert expected in str(raised.value), raised.value
