"""launch.py and the tools of scripts/ under a Python that lacks the project's packages: one line, not a traceback.

The system `python3` has no absl, jax or ml_collections; run with it, a script ended in a raw
ModuleNotFoundError. Each script calls `require_packages` before its first third-party import. It looks the
packages up without importing them (importlib's finder), so it costs milliseconds.
"""

import importlib.util
import sys

_NEEDED = ('absl', 'ml_collections', 'jax')


def require_packages(program: str) -> None:
  """Exits 2 with one line naming .venv/bin/python when this interpreter cannot import the project's packages."""
  missing = [name for name in _NEEDED if importlib.util.find_spec(name) is None]
  if missing:
    print(f"{program}: error: this Python ({sys.executable}) lacks the project's packages (no module "
          f"{missing[0]!r}); run it with .venv/bin/python, the virtual environment the README's Quickstart makes.",
          file=sys.stderr)
    sys.exit(2)
