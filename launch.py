"""Train a config: `.venv/bin/python launch.py --config=configs/default.py --workdir=DIR [--config.x=y ...]`.

Flags in, the processes joined (parallel/distributed.py; a no-op for one process),
one run out; everything a user can get wrong ends in one line on stderr and
exit code 2.
"""

import logging
import os
import re
import sys
import threading
import time
import traceback

from trainer.base import interpreter
interpreter.require_packages('launch.py')  # The system python3 has no absl: one line, not a ModuleNotFoundError.
from absl import app, flags  # noqa: E402
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file, e.g. configs/default.py.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Folder (or gs://bucket/run) for checkpoints, metrics and TensorBoard '
                                'logs.')
flags.mark_flags_as_required(['config'])  # --workdir too, except with --plan (checked in main).
# Plan mode; see trainer/run/plan.py.
_PLAN = flags.DEFINE_bool('plan', False, 'Compile the step ahead of time and print its memory and FLOPs; no training.')
_PLAN_MEMORY_GB = flags.DEFINE_float('plan_memory_gb', None, 'With --plan: fail unless the step fits in this many '
                                     'GiB per device, naming config changes that would fit.')
_TOPOLOGY = flags.DEFINE_string('topology', None, 'With --plan: compile for a TPU slice such as v5p:4x4x4, '
                                'or several joined by DCN such as 2xv5p:4x4x4 (needs requirements-tpu-plan.txt), or for GPUs such as h100:8, 8 H100s on one '
                                'host (needs requirements-gpu-plan.txt).')
# Multi-process runs; see parallel/distributed.py. Unset under SLURM or on a TPU pod, where jax detects them.
_COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'HOST:PORT of process 0, the same on every process.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes in the run, all hosts together.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, "This process's index, 0 .. num_processes-1.")
_TIMEOUT = flags.DEFINE_integer('distributed_timeout_s', 300, 'Seconds to wait for every process to join.')
# Elastic continuation; see trainer/supervision/elastic.py and docs/supervisor.md.
_ELASTIC_FULL = flags.DEFINE_integer('elastic_full_processes', None, 'The process count the config is written for: '
                                     'with fewer, the mesh shrinks and gradient accumulation rises so each step takes '
                                     'the same global batch; a process missing at the join exits 76 (the launcher '
                                     'starts a smaller job). Set by the launcher (scripts/launch_local.py '
                                     '--elastic_min_processes).')
# The supervisor; see trainer/supervision/supervisor.py.


def _restarts_from_environment() -> int:
  """$LAUNCH_MAX_RESTARTS (unset or empty: 3); anything but a count ends the launch in one line."""
  value = os.environ.get('LAUNCH_MAX_RESTARTS', '').strip() or '3'
  if not value.isdigit():
    print(f'launch.py: error: LAUNCH_MAX_RESTARTS={value!r} is not a count of restarts; set it to 0 or more, or '
          f'unset it for the default 3.', file=sys.stderr)
    sys.exit(2)
  return int(value)


_MAX_RESTARTS = flags.DEFINE_integer('max_restarts', _restarts_from_environment(),
                                     'Restarts after a retryable failure (lost peer, crash, hang, saved preemption) '
                                     'before the run stops; 0 runs training in this process, unsupervised. Default: '
                                     '$LAUNCH_MAX_RESTARTS, else 3.')
_RESTART_BACKOFF_S = flags.DEFINE_float('restart_backoff_s', 10.0, 'Seconds before a restart, doubling while '
                                        'attempts keep failing at the same step (at most 300).')
_START_OVER = flags.DEFINE_bool('start_over', False, 'Train from step 0 in a --workdir that holds a run: its '
                                'checkpoints and logs are moved to WORKDIR/previous_run_<time>/, never deleted.')


def _fail(message: str, exit_code: int = 2, kind: str = 'error') -> None:
  print(f'launch.py: {kind}: {" ".join(message.split())}', file=sys.stderr)
  sys.exit(exit_code)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing, with config_flags' errors (tracebacks for unknown keys, bad files) turned into one line."""
  given = list(argv)
  from trainer.observe import console
  console.help_if_asked(argv)  # -h and --help: exit 0 (absl's --help exits 1 and knows no -h).
  # config_flags logs its own version of the errors below (get_config() returning None, a failed load) before
  # absl's logging is set up, two lines ahead of ours: the one line below says it, with the fix.
  said = []
  quiet = logging.Filter()
  quiet.filter = lambda record: said.append(record.getMessage()) if record.pathname.endswith('config_flags.py') else 1
  logging.getLogger('absl').addFilter(quiet)
  # What get_config() returned, kept as it is parsed: a dict fails in the overrides before the flag holds it.
  parser = flags.FLAGS['config'].parser
  load = parser.parse
  parser.parse = lambda path: _loaded.append(load(path)) or _loaded[-1]
  try:
    argv = flags.FLAGS(argv)
    _returned_a_config_dict(given)
    _CONFIG.value.keys()  # config_flags defers a failed file load to the first access.
  except (SystemExit, KeyboardInterrupt) as e:  # Raised by the config file itself, or absl's --help: re-raised.
    _config_file_stopped(given, e)
    raise
  except Exception as e:  # pylint: disable=broad-except  (sorted into one line by _parse_error)
    if any('returned None' in s for s in said) and _config_path(given) != '(none)':  # Overrides of it fail too.
      _fail(f'--config file {_config_path(given)}: get_config() returned None; it must return the ConfigDict it '
            f'built (end it with `return c`, as configs/tiny.py does).')
    # config_flags re-raises the file's TypeError or ValueError with its whole traceback as the message: the
    # file's own exception, further down the chain, says it in its words.
    raised = next((c for c in _chain(e) if _failed_in_config_file(given, c)), None)
    if raised is not None:
      _config_file_error(given, raised)
    _returned_a_config_dict(given)  # A dict returned: its overrides failed first.
    _parse_error(given, argv, e)
  finally:
    logging.getLogger('absl').removeFilter(quiet)
    parser.parse = load
  from trainer.base import config_keys, config_schema
  unknown = config_keys.unknown(_CONFIG.value)
  if unknown:
    _fail(f'--config file {_config_path(given)} sets {"a key" if len(unknown) == 1 else "keys"} that no code reads: '
          f'{"; ".join(unknown)}. Every key is declared in configs/base.py.')
  bad = config_schema.problems(_CONFIG.value)  # Every key's type and range, before anything starts.
  if bad:
    _fail(f'{"; ".join(bad)} (--config file {_config_path(given)} and its overrides).')
  return argv


_loaded: list = []  # What the --config file's get_config() returned.


def _returned_a_config_dict(given: list[str]) -> None:
  """One line when get_config() returned something other than a ConfigDict (a dict, a list)."""
  from ml_collections import config_dict
  value = _loaded[-1] if _loaded else None
  # None is said by the caller; _ErrorConfig is config_flags' stand-in for a file that failed to load.
  if value is None or isinstance(value, config_dict.ConfigDict) or type(value).__name__ == '_ErrorConfig':
    return
  _fail(f'--config file {_config_path(given)}: get_config() returned a {type(value).__name__}, not an '
        f'ml_collections ConfigDict; start from configs/base.get_config() (or build a ConfigDict) and return it, as '
        f'configs/tiny.py does.')


def _config_file_stopped(given: list[str], stop: BaseException) -> None:
  """One line for a SystemExit or KeyboardInterrupt raised while the config file ran; nothing else is answered.

  A SystemExit (any code, 0 too) is a config file that exited instead of returning a config: exit 2, since a
  silent exit 0 reads as a launched run. A KeyboardInterrupt keeps Ctrl-C's exit 130 (the supervisor does not
  retry it): a real Ctrl-C is answered by trainer/safety/startup_signals.py before it could raise one, so this is
  almost always the file's own `raise KeyboardInterrupt`, but the two cannot be told apart for sure and the line
  says both.
  """
  frames = _frames_in_config_file(given, stop)
  if not frames:
    return
  where = f'--config file {_config_path(given)}, line {frames[-1].lineno}'
  if isinstance(stop, KeyboardInterrupt):
    _fail(f'{where}: KeyboardInterrupt while the file ran (a Ctrl-C, or raised by the file); nothing was started.',
          130, 'interrupted')
  _fail(f'{where}: the file raised SystemExit({stop.code!r}) instead of returning a config; nothing was started. '
        f'Return a ConfigDict, or raise an error that says what is wrong.')


def _parse_error(given: list[str], argv: list[str], error: BaseException) -> None:
  """One line for what absl or config_flags raised while parsing the flags."""
  try:
    raise error
  except flags.Error as e:
    _fail(str(e))
  except OSError as e:
    _fail(f'cannot load the --config file: {str(e).strip().splitlines()[-1].strip()}')
  except SyntaxError as e:
    _fail(f'--config file {e.filename}, line {e.lineno}: {e.msg}; fix the file.')
  except (AttributeError, KeyError) as e:  # config_flags raises these for an override key that does not exist.
    if _failed_in_config_file(argv, e) or 'get_config' in str(e):
      _config_file_error(argv, e)
    text = str(e).replace('\\n', ' ').replace('\\', '').strip('\'"')
    bad = re.search(r'instead of "(\w+)"', text) or re.search(r'(\w+)', text)
    overrides = [a.lstrip('-').split('=')[0] for a in argv[1:] if a.lstrip('-').startswith('config.')]
    culprit = next((o for o in overrides if bad and bad.group(1) in o.split('.')), 'a --config override')
    hint = text[text.find('Did you mean'):] if 'Did you mean' in text else ''
    _fail(f'unknown config key --{culprit}. {hint} Every key is declared in configs/base.py.')
  except Exception as e:  # pylint: disable=broad-except  (the config file's own code failed: an import, a typo)
    _config_file_error(argv, e)


def _config_path(argv: list[str]) -> str:
  """The --config file as given (`--config=F`, `--config F`, either with a `:arg` suffix)."""
  given = [a.split('=', 1)[1] for a in argv[1:] if a.startswith(('--config=', '-config='))]
  given += [b for a, b in zip(argv[1:], argv[2:]) if a in ('--config', '-config')]
  return given[-1].split(':', 1)[0] if given else '(none)'


def _frames_in_config_file(argv: list[str], error: BaseException) -> list[traceback.FrameSummary]:
  path = os.path.abspath(_config_path(argv))
  return [f for f in traceback.extract_tb(error.__traceback__) if os.path.abspath(f.filename) == path]


def _failed_in_config_file(argv: list[str], error: BaseException) -> bool:
  return bool(_frames_in_config_file(argv, error))


def _config_file_error(argv: list[str], error: BaseException) -> None:
  path = _config_path(argv)
  if 'get_config' in str(error) and isinstance(error, AttributeError):
    _fail(f'--config file {path} has no get_config() function; a config file defines get_config() returning an '
          f'ml_collections.ConfigDict (see configs/tiny.py).')
  frames = _frames_in_config_file(argv, error)
  where = f'{path}, line {frames[-1].lineno}' if frames else path
  raised = 'get_config() raised ' if any(f.name == 'get_config' for f in frames) else ''
  _fail(f'--config file {where}: {raised}{type(error).__name__}: {" ".join(str(error).split())}; fix the file.')


def _chain(error: BaseException) -> list[BaseException]:
  """`error` and every exception it was raised from or while handling, newest first."""
  chain = []
  while error is not None and error not in chain:
    chain.append(error)
    error = error.__cause__ or error.__context__
  return chain


def main(argv):
  if len(argv) > 1:
    _fail(f'unexpected arguments: {" ".join(argv[1:])}')
  if not _PLAN.value and (_PLAN_MEMORY_GB.value is not None or _TOPOLOGY.value):
    _fail('--plan_memory_gb and --topology only apply with --plan.')
  if _ELASTIC_FULL.value is not None and _ELASTIC_FULL.value < 1:
    _fail(f'--elastic_full_processes={_ELASTIC_FULL.value} must be the process count the config is written for, 1 '
          f'or more; leave it out for a run that is not elastic.')
  if not _PLAN.value and not _WORKDIR.value:
    _fail('flag --workdir must have a value (a folder for checkpoints and logs); only --plan runs without one.')
  if _PLAN.value:  # XLA's error-level 'Constant folding / Very slow compile' alarms read as failures; plan mode
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')  # hides them (set before jax loads; see trainer/run/plan.py).
  if _TOPOLOGY.value:  # jax's CUDA plugin, when installed, checks the local GPU driver as it loads and stays out on a
    os.environ.setdefault('JAX_SKIP_CUDA_CONSTRAINTS_CHECK', '1')  # host without one; a GPU --topology needs it.
  from trainer.run import gpu_env
  gpu_env.apply()  # NVIDIA GPUs: cuDNN kept out of CUDA graphs (why: trainer/run/gpu_env.py); before jax loads.
  from trainer.base.errors import UserError
  from trainer.safety import workdir as workdir_lib
  from trainer.base import storage
  from trainer.supervision import settings
  try:
    settings.check(_CONFIG.value.train, _MAX_RESTARTS.value, _RESTART_BACKOFF_S.value)
    if not _PLAN.value:
      storage.configure(_CONFIG.value.ckpt.storage_deadline_s)
      workdir_lib.check(_WORKDIR.value)  # Before jax is imported: a bad --workdir fails in a second.
  except UserError as e:
    _fail(str(e), getattr(e, 'exit_code', 2))
  from trainer.supervision import attempt
  if not _PLAN.value and _MAX_RESTARTS.value > 0 and not attempt.supervised():
    from trainer.supervision import supervisor
    from trainer.safety import startup_signals
    startup_signals.hand_over()  # The supervisor's handlers answer the stop signals until it returns.
    try:
      code = supervisor.Supervisor([sys.executable, *sys.argv], _WORKDIR.value, _MAX_RESTARTS.value,
                                   _RESTART_BACKOFF_S.value, writes_record=_PROCESS_ID.value in (None, 0),
                                   preemption_signals=tuple(_CONFIG.value.train.preemption_signals)).run()
    finally:
      startup_signals.take_back()
    sys.exit(code)
  from parallel import distributed, platforms, watchdog  # After flag parsing, so --help does not wait for jax.
  if not _TOPOLOGY.value:  # No TPU asked for: libtpu's start-up lines stay off a machine without one.
    platforms.skip_absent_tpu()
  from trainer.observe import console
  from trainer.run import collector, loop
  from trainer.safety import preemption, sigterm_handoff
  from trainer.safety import disk, lock
  collector.freeze_imports()  # jax, flax, optax, Orbax, grain and the trainer: out of every collection from here on.
  console.quiet_library_info()
  if not _PLAN.value:
    console.divert_library_errors(_WORKDIR.value)
  held = None
  try:
    from trainer.hf import load as hf_load  # model.init_from: config.json replaces the file's model keys, not the flags'.
    config = hf_load.configure(_CONFIG.value, config_flags.get_override_values(flags.FLAGS['config']))
    if _PLAN.value:
      from trainer.run import plan
      plan.run(config, _PLAN_MEMORY_GB.value, _TOPOLOGY.value)
      return
    from trainer.supervision import elastic
    try:
      distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, _TIMEOUT.value,
                             elastic.PROCESSES_MISSING_EXIT_CODE if _ELASTIC_FULL.value else 2)
    except distributed.ProcessesMissing as e:
      if _ELASTIC_FULL.value:  # Said so that the survivors' last line tells what comes next.
        e.args = (f'{e} Elastic run: exit {e.exit_code}, for the launcher to start the processes left as a '
                  f'smaller job.',)
      raise
    size = _elastic_size(config) if _ELASTIC_FULL.value else None
    sigterm_handoff.hold_back()  # jax's preemption service took SIGTERM: the loop hands it back (issue 39).
    held = lock.acquire_for_run(_WORKDIR.value)  # Before --start_over moves anything, and before compiling.
    loop.run(config, _WORKDIR.value, start_over=_START_OVER.value, elastic_size=size)
  except UserError as e:
    if getattr(e, 'exit_at_once', False):  # A failed save (trainer/safety/disk.py): no shutdown beside Orbax.
      _exit_at_once.append(True)
    _fail(str(e), getattr(e, 'exit_code', 2))  # 3: stopped on a non-finite loss (trainer/safety/guardrails.py).
  except Exception as e:  # pylint: disable=broad-except
    # A UserError that a cleanup step (closing a writer on a full disk) raised over, or a disk/permission failure.
    cause = next((c for c in _chain(e) if isinstance(c, UserError)), None)
    if getattr(cause, 'exit_at_once', False):
      _exit_at_once.append(True)
    message = str(cause) if cause else disk.describe(e, _WORKDIR.value)
    if message is None:
      watchdog.grace()  # A collective that failed because a peer died: let the watchdog name it first.
      raise  # A bug: keep the traceback.
    _fail(message, getattr(cause, 'exit_code', 2))
  except KeyboardInterrupt:  # Ctrl-C before the step loop installed its handler (trainer/safety/preemption.py).
    _fail('Ctrl-C: stopped outside the step loop (before training, or while closing); every checkpoint already '
          'complete on disk is intact.', preemption.INTERRUPTED_EXIT_CODE, 'interrupted')
  finally:
    if held is not None:
      held.release()
  if preemption.interrupted_by_user():
    _fail(f'Ctrl-C: saved the current step to {_WORKDIR.value}/checkpoints and stopped; relaunch the same command '
          f'to continue.', preemption.INTERRUPTED_EXIT_CODE, 'interrupted')


def _elastic_size(config):
  """--elastic_full_processes: this attempt's mesh and accumulation for the processes that joined, written into
  `config` and said in one line (trainer/supervision/elastic.py)."""
  import jax
  from absl import logging as absl_logging
  from trainer.supervision import attempt, elastic
  size = elastic.plan(config.mesh, config.train, _ELASTIC_FULL.value, jax.process_count(), jax.local_device_count())
  elastic.apply(config.mesh, config.train, size)
  (absl_logging.warning if size.shrunk else absl_logging.info)('%s', size.describe())
  attempt.note(processes=size.processes, full_processes=size.full_processes,
               grad_accum_steps=size.grad_accum_steps)
  return size


_EXIT_GRACE_S = 5
_exit_at_once: list[bool] = []  # Set for an error after which no interpreter shutdown should run (a failed save).


def _exit_within(code: int) -> None:
  """Ends the process `_EXIT_GRACE_S` seconds from now with `code` if the interpreter has not exited by then.

  Python waits for every non-daemon thread before it exits. After a failed save
  Orbax's background threads can block for good (one sat in a coordination-service
  key wait), which would hold a job that already printed its error until the
  scheduler's time limit. Normal exits take well under a second, and they flush
  logs and close files first; this only cuts a shutdown that would never end.
  """
  def force():
    time.sleep(_EXIT_GRACE_S)
    sys.stderr.flush()
    os._exit(code)

  threading.Thread(target=force, daemon=True, name='exit-deadline').start()


if __name__ == '__main__':
  from trainer.run import collector
  collector.tune()  # Before the imports and the traces (why: trainer/run/collector.py).
  from trainer.safety import startup_signals
  startup_signals.install_early()  # Before flags and jax: SIGTERM, SIGHUP, SIGINT or SIGUSR1 never kill without a word.
  try:
    app.run(main, flags_parser=_parse_flags)
  except startup_signals.OutsideTheLoop as stop:  # A stop signal during the final eval or save (trainer/run/loop.py).
    _exit_within(128 + stop.signum)
    print(startup_signals.message(stop.signum, stop.kept), file=sys.stderr, flush=True)
    sys.exit(128 + stop.signum)
  except SystemExit as exit_:
    code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    if _exit_at_once:
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)
    _exit_within(code)
    raise
  except BaseException:
    _exit_within(1)
    raise
