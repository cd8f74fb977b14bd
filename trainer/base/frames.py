"""Whose code a traceback frame runs: the launcher's, a library's, or the user's (their model).

An error raised while a brought model is built or traced is blamed on the
deepest frame that is not a library's: the user's own line when there is one
(one line, exit 2), the launcher's when the failure is ours ("please report
it"). Frames are told apart by the package their module belongs to, never by a
substring of their path: a user's model in a flax checkout's `examples/`
(`.../flax/examples/lm1b/models.py`, imported as `models`) is the user's,
and jax's or flax's code is a library's wherever it is installed (an editable
checkout too).

- the launcher: modules of this repository's `trainer` and `parallel`
  packages, and its entry points (`launch.py`, `scripts/`);
- a library: the standard library, any module whose file lies inside an
  installation directory of this interpreter (site-packages, the standard
  library's folders), and the packages of the stack the launcher runs on
  wherever they live (`STACK`);
- the user: everything else, and the package of model.name's module wherever
  it is installed (a model package pip-installed into site-packages).
"""

import functools
import pathlib
import site
import sys
import sysconfig
import traceback
import types

_REPO = pathlib.Path(__file__).resolve().parents[2]
_LAUNCHER_PACKAGES = ('trainer', 'parallel')
_ENTRY_POINTS = (_REPO / 'launch.py', _REPO / 'scripts')
# The stack the launcher runs on, by top-level import name: a library even where installed from a checkout.
STACK = frozenset({'jax', 'jaxlib', 'flax', 'optax', 'orbax', 'grain', 'numpy', 'ml_dtypes', 'chex', 'absl',
                   'treescope', 'etils', 'ml_collections', 'opt_einsum', 'scipy', 'einops', 'tensorstore'})


@functools.cache
def _installation_dirs() -> tuple[pathlib.Path, ...]:
  paths = {sysconfig.get_paths()[key] for key in ('stdlib', 'platstdlib', 'purelib', 'platlib')}
  paths.update(site.getsitepackages() + [site.getusersitepackages()])
  return tuple(pathlib.Path(p).resolve() for p in paths if p)


def _inside(path: pathlib.Path, folder: pathlib.Path) -> bool:
  return path == folder or folder in path.parents


def model_package(model_name: str) -> str | None:
  """The top-level package of model.name's module ('my_pkg' of 'my_pkg.models:LM'); None for a registered name."""
  module = model_name.partition(':')[0] if ':' in model_name else ''
  top = module.partition('.')[0]
  return top if top and top not in _LAUNCHER_PACKAGES else None


def owner(module_name: str, filename: str, user_package: str | None = None) -> str:
  """'launcher', 'library' or 'user': whose code the module `module_name` (a frame's `__name__`), in `filename`, is.

  `user_package` (model_package) is the user's wherever it is installed: a model package pip-installed into
  site-packages is still theirs.
  """
  top = (module_name or '').partition('.')[0]
  if user_package is not None and top == user_package:
    return 'user'
  if filename.startswith('<') and top != '__main__':  # Frozen importlib, code built by exec/eval in a library.
    return 'library'
  path = pathlib.Path(filename).resolve()
  if (top in _LAUNCHER_PACKAGES and _inside(path, _REPO / top)) or any(_inside(path, p) for p in _ENTRY_POINTS):
    return 'launcher'
  if top in sys.stdlib_module_names or top in STACK or any(_inside(path, d) for d in _installation_dirs()):
    return 'library'
  return 'user'


def frames(tb: types.TracebackType | None, user_package: str | None = None) -> list[tuple[str, traceback.FrameSummary]]:
  """(owner, frame) of each frame of the traceback, outermost first."""
  out = []
  for frame, lineno in traceback.walk_tb(tb):
    code = frame.f_code
    out.append((owner(frame.f_globals.get('__name__', ''), code.co_filename, user_package),
                traceback.FrameSummary(code.co_filename, lineno, code.co_name, lookup_line=False)))
  return out


def blamed(e: BaseException, model_name: str = '') -> tuple[str, str]:
  """(owner, 'file:line') of the deepest frame of `e` that is not a library's; ('', '') when every frame is.
  `model_name` (model.name) makes its module's package the user's (model_package)."""
  ours = [(who, f) for who, f in frames(e.__traceback__, model_package(model_name)) if who != 'library']
  if not ours:
    return '', ''
  who, frame = ours[-1]
  return who, f'{frame.filename}:{frame.lineno}'


def one_line(e: BaseException) -> str:
  """`e` as 'Type: message', its message's lines joined into one."""
  return f"{type(e).__name__}: {' '.join(line.strip() for line in str(e).splitlines() if line.strip())}"


def model_error(e: BaseException, name: str, doing: str) -> str:
  """The one line for model.name `name` failing while `doing` (e.g. 'building it'): where, and whose code to fix."""
  who, where = blamed(e, name)
  if who == 'launcher':
    fix = f'this failed inside the launcher ({where}), not the model: please report it with this line'
  elif who == 'user':
    fix = f'change the model where it raised ({where}); a restart would fail the same way'
  else:
    fix = 'change the model or its settings (no line of its own is in the traceback)'
  return f'model.name={name!r}: {doing} raised {one_line(e)} (raised at {where or "an unknown place"}). To fix: {fix}.'
