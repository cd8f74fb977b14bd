"""What a person sees on the terminal: the launcher's own INFO lines and everyone's warnings.

Orbax, Grain and JAX log dozens of INFO lines per checkpoint; they drown the
progress lines, so INFO records from outside this repository are dropped.
Pass --verbosity=1 to see everything.

When a save fails (a full disk, lost permission) or a damaged checkpoint is read,
Orbax logs error lines and its background threads die with tracebacks (`Event loop
is closed`) on the way to the launcher's own one-line message; 23-41 such lines
came before it on a full disk. Those library error records and uncaught exceptions
of threads other than the main one go to WORKDIR/logs/library_errors.log instead
(`divert_library_errors`): the console keeps the line that names the cause and the
fix, and the details stay on disk for whoever debugs it (where the disk can still
take them: on a full one they are dropped).
"""

import logging as py_logging
import os
import pathlib
import tempfile
import threading
import traceback

from absl import logging

from trainer.base import confined

_REPO = str(pathlib.Path(__file__).resolve().parents[2])


class _OwnInfoOnly(py_logging.Filter):

  def filter(self, record: py_logging.LogRecord) -> bool:
    # The Quickstart's .venv lives inside the repo, so library files are told apart by site-packages.
    return record.levelno >= py_logging.WARNING or _own(record)


def _own(record: py_logging.LogRecord) -> bool:
  # The Quickstart's .venv lives inside the repo, so library files are told apart by site-packages.
  return record.pathname.startswith(_REPO) and 'site-packages' not in record.pathname


class _Sink:
  """The file, created at its first line: a launch with nothing to divert leaves nothing in the workdir."""

  def __init__(self, path: pathlib.Path):
    self.path, self._file, self._lock = path, None, threading.Lock()

  def write(self, text: str) -> bool:
    with self._lock:
      try:
        if self._file is None:
          self.path.parent.mkdir(parents=True, exist_ok=True)
          self._file = confined.open_append(self.path, buffering=1)  # Never through a link planted there.
        self._file.write(text)
        return True
      except (OSError, confined.Planted):
        # The disk is full or read-only (likely why a library is failing): the launcher's own line says so, and
        # these lines, consequences of it, are dropped rather than shown in its place.
        return False


class _LibraryErrorsToFile(py_logging.Filter):
  """Library records at ERROR and above go to a file, not the console."""

  def __init__(self, sink: _Sink):
    super().__init__()
    self._sink = sink
    self._format = py_logging.Formatter('%(asctime)s %(levelname)s %(pathname)s:%(lineno)d] %(message)s')

  def filter(self, record: py_logging.LogRecord) -> bool:
    if record.levelno < py_logging.ERROR or _own(record):
      return True
    self._sink.write(self._format.format(record) + '\n')
    return False


def divert_library_errors(workdir: str) -> str | None:
  """Sends library error lines and other threads' tracebacks to WORKDIR/logs/library_errors.log; returns its path."""
  if logging.get_verbosity() > logging.INFO:
    return None
  if '://' in workdir:  # A bucket cannot be appended to line by line: a local file instead.
    path = pathlib.Path(tempfile.gettempdir()) / f'launch-library-errors-{os.getpid()}.log'
  else:
    path = pathlib.Path(workdir) / 'logs' / 'library_errors.log'
  sink = _Sink(path)
  logging.get_absl_handler().addFilter(_LibraryErrorsToFile(sink))
  previous = threading.excepthook

  def thread_excepthook(args) -> None:
    if args.thread is threading.main_thread():
      previous(args)
      return
    text = (f'Exception in thread {args.thread.name if args.thread else "?"}:\n'
            + ''.join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)))
    sink.write(text)

  threading.excepthook = thread_excepthook
  return str(path)


def quiet_library_info() -> None:
  """Drops library INFO chatter unless the user raised --verbosity above 0."""
  if logging.get_verbosity() <= logging.INFO:
    logging.get_absl_handler().addFilter(_OwnInfoOnly())


_HELP = ('-h', '--help', '-help', '-?', '--helpshort', '-helpshort', '--helpfull', '-helpfull')


def help_if_asked(argv: list[str]) -> None:
  """`-h` or `--help` (absl's --helpshort and --helpfull too): the docstring and the flags on stdout, exit 0.

  absl's own --help exits 1, as a failure, and it knows no -h (an unknown flag).
  """
  import sys

  from absl import app
  given = argv[1:argv.index('--')] if '--' in argv else argv[1:]
  asked = [a for a in given if a in _HELP]
  if asked:
    full = any('helpfull' in a for a in asked)
    app.usage(shorthelp=not full, writeto_stdout=True)
    if not full:
      print('\nTry --helpfull to get a list of all flags.')
    sys.exit(0)


def one_line_flag_errors(script: str):
  """An absl `app.run(main, flags_parser=...)` for the scripts: a flag error (a required flag missing, a bad value,
  a --config file that fails to load or an unknown --config key, a stray argument) is one line,
  `SCRIPT: error: ...`, and exit code 2, as launch.py's user errors are; absl's own parser exits 1 with usage text
  or a traceback."""
  import sys

  from absl import flags
  from ml_collections import config_flags

  def parse(argv):
    help_if_asked(argv)
    try:
      argv = flags.FLAGS(argv)
      for name in flags.FLAGS:
        if hasattr(flags.FLAGS[name], 'config_filename') and flags.FLAGS[name].present:  # A config_flags flag:
          flags.FLAGS[name].value.keys()  # it defers a failed file load to the first access.
      if len(argv) > 1:
        raise flags.Error(f'unexpected arguments: {" ".join(argv[1:])}')
    except (AttributeError, KeyError) as e:  # config_flags raises these for an override key the config lacks.
      message = (f'a --config override names a key the config lacks ({e.args[0] if e.args else e}); every key is '
                 f'declared in configs/base.py')
    except (flags.Error, OSError, SyntaxError) as e:
      message = str(e)
    else:
      return argv
    print(f'{script}: error: {" ".join(message.split())}', file=sys.stderr)
    sys.exit(2)
  return parse
