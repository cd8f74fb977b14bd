"""Every key configs/base.py declares has a type and range in trainer/base/config_schema.py, and every hostile value
of every type is refused naming the key (issue 54, config rows).

In process and cheap: the table is pure Python. The launched rows of tests/test_faults_config_sweep.py show the
same refusals as one line and exit 2 from a supervised launch, before anything starts.
"""

import copy
import importlib
import math
import pathlib

import pytest

from configs import base
from trainer.base import config_keys, config_schema
from trainer.base.errors import UserError

DECLARED = config_keys._paths(base.get_config())  # pylint: disable=protected-access
# Values no key takes, one of every type: non-finite floats, an int past int64, a negative one past every range,
# bytes, a mapping and a bare object. A row that took one of them would be no check.
HOSTILE = (math.nan, math.inf, -math.inf, -10**20, b'bytes', {'a': 1}, object())
CONFIGS = sorted(p.stem for p in (pathlib.Path(__file__).parent.parent / 'configs').glob('*.py') if p.stem != '__init__')


DEFAULTS = base.get_config().to_dict()


def _with(path, value) -> dict:
  config = copy.deepcopy(DEFAULTS)
  section, key = path.split('.')
  config[section][key] = value
  return config


def test_every_declared_key_has_a_row_and_every_row_a_declared_key():
  assert sorted(set(DECLARED) - set(config_schema.SCHEMA)) == []
  assert sorted(set(config_schema.SCHEMA) - set(DECLARED)) == []


@pytest.mark.parametrize('name', CONFIGS)
def test_every_config_passes_its_own_checks(name):
  assert config_schema.problems(importlib.import_module(f'configs.{name}').get_config()) == []


def test_every_declared_key_refuses_a_hostile_value_of_every_type_naming_the_key():
  let_through = [(path, value) for path in DECLARED for value in HOSTILE
                 if not any(p.startswith(f'{path}=') for p in config_schema.problems(_with(path, value)))]
  assert let_through == []


def test_integers_stop_at_int32_and_choices_at_their_names():
  refused = []
  for path, check in config_schema.SCHEMA.items():
    default = base.get_config()[path.split('.')[0]][path.split('.')[1]]
    if type(default) is int and check.accepts(default):  # pylint: disable=unidiomatic-typecheck
      refused.append(not check.accepts(10**20) and not check.accepts(2**31))
    if isinstance(default, str) and check.expected.startswith('one of'):
      refused.append(not check.accepts('sometimes') and not check.accepts(default.upper()))
  assert len(refused) > 60 and all(refused)


@pytest.mark.parametrize('path, value, said', [
    ('train.steps', 10**20, 'train.steps=100000000000000000000 must be an integer >= 1 and <= 2147483647'),
    ('train.learning_rate', math.inf, 'train.learning_rate=inf must be a number > 0 and <= 3.4e+38'),
    ('train.learning_rate', math.nan, 'train.learning_rate=nan must be a number > 0 and <= 3.4e+38'),
    ('train.learning_rate', 1e39, 'train.learning_rate=1e+39 must be a number > 0 and <= 3.4e+38'),  # inf in float32.
    ('log.wandb_mode', 'sometimes', "log.wandb_mode='sometimes' must be one of 'online', 'offline'"),
    ('train.adam_b1', 1.5, 'train.adam_b1=1.5 must be in [0, 1)'),
    ('model.scan_layers', 1, "model.scan_layers=1 must be one of True, False, 'auto'"),  # 1 is not True here.
    ('train.sgd_nesterov', 'yes', "train.sgd_nesterov='yes' must be one of True, False"),
    ('train.weight_decay_exclude', ('(',), "train.weight_decay_exclude=('(',) must be a tuple of items each a "
                                          'regular expression'),
    ('data.image_shape', (32, 32), 'data.image_shape=(32, 32) must be a tuple of 3 items each an integer >= 1 and <= 2147483647'),
    ('mesh.fsdp', -2, 'mesh.fsdp=-2 must be one of -1 or an integer >= 1 and <= 2147483647'),
])
def test_the_one_line_names_the_key_its_value_and_what_it_must_be(path, value, said):
  with pytest.raises(UserError) as raised:
    config_schema.check(_with(path, value))
  assert str(raised.value) == f'{said}.'


def test_sizes_whose_product_no_array_can_hold_are_refused_naming_every_factor():
  config = _with('model.d_model', 10**9)
  [said] = config_schema.problems(config)
  assert said.startswith('model.num_layers=4 x model.d_model=1000000000 x model.d_model=1000000000 makes the stacked '
                         "layers' attention weights 4e+18 elements")
  config = _with('train.batch_size', 2**30)
  config['data']['seq_len'] = 2**30
  assert any("a batch's logits" in p for p in config_schema.problems(config))
  assert config_schema.problems(base.get_config()) == []


def test_a_config_from_before_a_key_skips_its_row():
  config = base.get_config().to_dict()
  del config['train']['loss_chunks'], config['model']['num_experts']
  assert config_schema.problems(config) == []


def test_the_choices_are_those_of_the_modules_that_read_the_keys():
  from parallel import mesh
  from trainer import data
  from trainer.attention import choice, context
  from trainer.models import layer_scan, llama
  from trainer.observe import progress, trackers
  from trainer.safety import guardrails
  from trainer.training import objectives, optimizer, strategy
  owners = {'train.optimizer': optimizer.OPTIMIZERS, 'train.schedule': optimizer.SCHEDULES,
            'train.decay_shape': optimizer.DECAY_SHAPES, 'train.on_nonfinite': guardrails.MODES,
            'train.remat_policy': ('auto', 'none', *llama.REMAT_POLICIES), 'parallel.strategy': strategy.STRATEGIES,
            'log.progress_bar': progress.MODES, 'data.source': data.SOURCES, 'model.task': objectives.TASKS,
            'model.rope_scaling': llama.ROPE_SCALINGS, 'model.scan_layers': layer_scan.VALUES,
            'model.attention': choice.KERNELS, 'model.context_scheme': context.SCHEMES}
  for path, names in owners.items():
    check = config_schema.SCHEMA[path]
    assert all(check.accepts(n) for n in names) and not check.accepts('not-a-choice'), path
    assert check.expected == config_schema.one_of(*names).expected, path
  assert config_schema.SCHEMA['log.trackers'].expected == config_schema.sequence(
      config_schema.one_of(*trackers.CHOICES)).expected
  assert len(mesh.AXES) + 3 == len([p for p in config_schema.SCHEMA if p.startswith('mesh.')])
