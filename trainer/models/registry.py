"""`model.name` -> the callable that builds the model: a registered short name, or an import path.

An import path is 'my_pkg.my_module:MyModel'. It resolves from the current
directory and PYTHONPATH, so a user's package next to their configs works
without installing it and without editing the trainer.
"""

import difflib
import importlib
import os
import sys
from collections.abc import Callable

from trainer.base import frames
from trainer.base.errors import UserError

# Short name -> (import path, the model.task it is made for).
REGISTERED = {
    'llama': ('trainer.models.llama:build', 'lm'),
    'vit': ('trainer.models.vit:ViT', 'classifier'),
}


def registered_task(name: str) -> str | None:
  """The model.task a registered model is made for; None for import paths."""
  return REGISTERED[name][1] if name in REGISTERED else None


def resolve(name: str) -> Callable:
  """The builder `name` stands for; one UserError naming what is missing otherwise."""
  path = REGISTERED[name][0] if name in REGISTERED else name
  module_name, sep, attr = path.partition(':')
  if not sep or not module_name or not attr:
    raise UserError(f"model.name={name!r} is neither a registered model ({', '.join(sorted(REGISTERED))}) nor an "
                    f"import path like 'my_pkg.my_module:MyModel' (module, a colon, then the class or function).")
  if os.getcwd() not in sys.path:
    sys.path.append(os.getcwd())  # Last, so a user's folder never shadows an installed package.
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name is not None and (module_name == e.name or module_name.startswith(e.name + '.')):
      raise UserError(f"model.name={name!r}: there is no module {e.name!r} to import. Check the spelling, and that "
                      f"its folder is the current directory or on PYTHONPATH.") from e
    raise UserError(f"model.name={name!r}: importing {module_name!r} failed because it imports {e.name!r}, which is "
                    f"not installed.") from e
  except Exception as e:  # pylint: disable=broad-except  (the module's own code failed as it was imported)
    raise UserError(frames.model_error(e, name, f'importing {module_name!r}')) from e
  try:
    return getattr(module, attr)
  except AttributeError as e:
    public = [n for n in vars(module) if not n.startswith('_')]
    close = difflib.get_close_matches(attr, public, n=3)
    hint = f' Did you mean {", ".join(repr(c) for c in close)}?' if close else ''
    raise UserError(f"model.name={name!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
                    f"attribute {attr!r}.{hint}") from e
