"""What a person sees on the terminal: the launcher's own INFO lines and everyone's warnings.

Orbax, Grain and JAX log dozens of INFO lines per checkpoint; they drown the
progress lines, so INFO records from outside this repository are dropped.
Pass --verbosity=1 to see everything.
"""

import logging as py_logging
import pathlib

from absl import logging

_REPO = str(pathlib.Path(__file__).resolve().parent.parent)


class _OwnInfoOnly(py_logging.Filter):

  def filter(self, record: py_logging.LogRecord) -> bool:
    # The Quickstart's .venv lives inside the repo, so library files are told apart by site-packages.
    own = record.pathname.startswith(_REPO) and 'site-packages' not in record.pathname
    return record.levelno >= py_logging.WARNING or own


def quiet_library_info() -> None:
  """Drops library INFO chatter unless the user raised --verbosity above 0."""
  if logging.get_verbosity() <= logging.INFO:
    logging.get_absl_handler().addFilter(_OwnInfoOnly())
