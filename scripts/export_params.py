"""Write the parameters of a run's checkpoint as a plain Orbax checkpoint that needs nothing of this project.

  .venv/bin/python scripts/export_params.py --config=configs/default.py --workdir=DIR --output=/abs/path/params
      [--step=N] [--params=raw|ema]

--config (and any --config.x=y overrides) must describe the model the run
trained, as for a relaunch: the checkpoint's manifest is checked against it and
a different model is refused. The newest intact checkpoint is exported unless
--step is given. The parameters are restored straight into the config's
shardings and written shard by shard (nothing is gathered on one host); the
output is the parameter tree alone, {'embed': {'embedding': ...}, 'block_0':
...}, with no optimizer state, step or data position. Read it anywhere with
only orbax-checkpoint installed, e.g. as NumPy arrays:

  import numpy as np, orbax.checkpoint as ocp
  meta = ocp.PyTreeCheckpointer().metadata(path).item_metadata.tree
  params = ocp.PyTreeCheckpointer().restore(
      path, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta))

or as jax.Arrays in your own shardings with
`ocp.StandardCheckpointer().restore(path, target)`.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from trainer.safety import startup_signals  # noqa: E402  (first: a signal in any phase is one line, 128 + it)
if __name__ == '__main__':  # Not in a test that imports it.
  startup_signals.install_for_tool('export_params.py')
from trainer.base import interpreter  # noqa: E402
interpreter.require_packages('export_params.py')
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'The config the run was trained with.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'The run folder (or gs:// URL) holding checkpoints/.')
_OUTPUT = flags.DEFINE_string('output', None, 'Folder to create for the exported parameters (must not exist).')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step to export; default: the newest intact one.')
_PARAMS = flags.DEFINE_enum('params', 'raw', ['raw', 'ema'], "'raw': the parameters as trained; 'ema': their "
                            'average, in the parameters\' dtypes (runs trained with train.ema_decay > 0).')
flags.mark_flags_as_required(['config', 'workdir', 'output'])


def export(config, workdir: str, output: str, step: int | None = None, params: str = 'raw') -> int:
  """Exports the params of checkpoint `step` (default newest intact) of `workdir` to `output`; returns the step.

  `params`: 'raw', or 'ema' for the run's parameter average (trainer/training/state.py `params_of`).
  """
  import orbax.checkpoint as ocp

  from trainer.training import checkpoint
  from trainer.base import storage
  from trainer.run import job as job_lib
  from trainer.training import state as state_lib
  from trainer.base.errors import UserError
  from trainer.safety import tool_outputs
  tool_outputs.refuse_existing('--output', output)
  if storage.path(output).exists():  # A local folder or a gs:// URL, like the workdir.
    raise UserError(f'--output={output} exists; choose a new folder (nothing is overwritten).')
  step, state = checkpoint.restore_for_tool(job_lib.build_job(config), workdir, step)
  with tool_outputs.written_whole(output) as partial:  # Renamed to --output once Orbax has finished it.
    with ocp.StandardCheckpointer() as writer:
      writer.save(storage.path(partial), state_lib.params_of(state, params))
  output_path = storage.path(output)
  logging.info('Exported the parameters of step %d of %s to %s', step, workdir, output_path)
  return step


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  from trainer.observe import console
  from trainer.base.errors import UserError
  from parallel import platforms
  platforms.skip_absent_tpu()  # No libtpu start-up lines where no TPU chip is (parallel/platforms.py).
  console.quiet_library_info()  # Orbax's dozens of INFO lines per save and restore; --verbosity=1 shows them.
  try:
    export(_CONFIG.value, _WORKDIR.value, _OUTPUT.value, _STEP.value, _PARAMS.value)
  except UserError as e:
    print(f'export_params.py: error: {e}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  from trainer.observe import console
  app.run(main, flags_parser=console.one_line_flag_errors('export_params.py'))  # Flag errors: one line, exit 2.
