"""Train a config: `python launch.py --config=configs/default.py --workdir=DIR [--config.train.steps=N ...]`.

Flags in, the processes joined (parallel/distributed.py; a no-op for one process),
one run out; everything a user can get wrong ends in one line on stderr and
exit code 2.
"""

import os
import re
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file, e.g. configs/default.py.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Folder for checkpoints, metrics and TensorBoard logs.')
flags.mark_flags_as_required(['config'])  # --workdir too, except with --plan (checked in main).
# Plan mode; see trainer/plan.py.
_PLAN = flags.DEFINE_bool('plan', False, 'Compile the step ahead of time and print its memory and FLOPs; no training.')
_PLAN_MEMORY_GB = flags.DEFINE_float('plan_memory_gb', None, 'With --plan: fail unless the step fits in this many '
                                     'GiB per device, naming config changes that would fit.')
_TOPOLOGY = flags.DEFINE_string('topology', None, 'With --plan: compile for a TPU slice such as v5p:4x4x4 '
                                '(needs requirements-tpu-plan.txt).')
# Multi-process runs; see parallel/distributed.py. Unset under SLURM or on a TPU pod, where jax detects them.
_COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'HOST:PORT of process 0, the same on every process.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes in the run, all hosts together.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, "This process's index, 0 .. num_processes-1.")
_TIMEOUT = flags.DEFINE_integer('distributed_timeout_s', 300, 'Seconds to wait for every process to join.')
_START_OVER = flags.DEFINE_bool('start_over', False, 'Train from step 0 in a --workdir that holds a run: its '
                                'checkpoints and logs are moved to WORKDIR/previous_run_<time>/, never deleted.')


def _fail(message: str, exit_code: int = 2) -> None:
  print(f'launch.py: error: {" ".join(message.split())}', file=sys.stderr)
  sys.exit(exit_code)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing, with config_flags' errors (tracebacks for unknown keys) turned into one line."""
  try:
    argv = flags.FLAGS(argv)
    _CONFIG.value.keys()  # config_flags defers a failed file load to the first access.
    return argv
  except flags.Error as e:
    _fail(str(e))
  except OSError as e:
    _fail(f'cannot load the --config file: {str(e).strip().splitlines()[-1].strip()}')
  except (AttributeError, KeyError) as e:  # config_flags raises these for an override key that does not exist.
    text = str(e).replace('\\n', ' ').replace('\\', '').strip('\'"')
    bad = re.search(r'instead of "(\w+)"', text) or re.search(r'(\w+)', text)
    overrides = [a.lstrip('-').split('=')[0] for a in argv[1:] if a.lstrip('-').startswith('config.')]
    culprit = next((o for o in overrides if bad and bad.group(1) in o.split('.')), 'a --config override')
    hint = text[text.find('Did you mean'):] if 'Did you mean' in text else ''
    _fail(f'unknown config key --{culprit}. {hint} Every key is declared in configs/base.py.')


def main(argv):
  if len(argv) > 1:
    _fail(f'unexpected arguments: {" ".join(argv[1:])}')
  if not _PLAN.value and (_PLAN_MEMORY_GB.value is not None or _TOPOLOGY.value):
    _fail('--plan_memory_gb and --topology only apply with --plan.')
  if not _PLAN.value and not _WORKDIR.value:
    _fail('flag --workdir must have a value (a folder for checkpoints and logs); only --plan runs without one.')
  if _PLAN.value:  # XLA's error-level 'Constant folding / Very slow compile' alarms read as failures; plan mode
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')  # hides them (set before jax loads; see trainer/plan.py).
  from parallel import distributed  # After flag parsing, so --help does not wait for jax.
  from trainer import console, loop
  from trainer.errors import UserError
  console.quiet_library_info()
  try:
    if _PLAN.value:
      from trainer import plan
      plan.run(_CONFIG.value, _PLAN_MEMORY_GB.value, _TOPOLOGY.value)
      return
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _TIMEOUT.value)
    loop.run(_CONFIG.value, _WORKDIR.value, start_over=_START_OVER.value)
  except UserError as e:
    _fail(str(e), getattr(e, 'exit_code', 2))  # 3: stopped on a non-finite loss (trainer/guardrails.py).


if __name__ == '__main__':
  app.run(main, flags_parser=_parse_flags)
