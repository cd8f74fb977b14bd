"""Which functions the whole run config reaches: a profiler hook over one tiny launch or one --plan.

A call counts when one of its arguments is a whole config (a ConfigDict holding both `train` and `model`: the
launcher's, or a copy with overrides), or a dataclass one of whose fields is one (the Job, the RunContext: the
whole config carried inside). Functions are named `module_stem.qualname` (a package's
`__init__` by the package), the folders above left out, so the names survive trainer/ modules moving between
folders.

Run as a script for the table (the figures in issue 44's notes):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python tests/config_flow.py [--plan]
"""

import collections
import dataclasses
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def _is_whole(value) -> bool:
  if type(value).__name__ not in ('ConfigDict', 'FrozenConfigDict'):
    return False
  try:
    return 'train' in value and 'model' in value
  except Exception:  # pylint: disable=broad-except  (a half-built ConfigDict during its own __init__)
    return False


def _holds_whole(value) -> bool:
  fields = getattr(type(value), '__dataclass_fields__', None)
  if not fields or isinstance(value, type):
    return False
  return any(_is_whole(getattr(value, name, None)) for name in fields)


@dataclasses.dataclass
class Flow:
  """Calls (by `module_stem.qualname`) that received the whole config: directly, or inside a Job-like holder."""
  direct: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  held: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  modules: set = dataclasses.field(default_factory=set)  # Repository paths, for the report only.
  callers: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(set))  # Of each direct taker.

  def functions(self) -> set[str]:
    return set(self.direct) | set(self.held)


def _name(module: str, code) -> str:
  stem = pathlib.Path(module).stem
  return f'{pathlib.Path(module).parent.name if stem == "__init__" else stem}.{code.co_qualname}'


def trace(fn, *args, **kwargs) -> Flow:
  """Runs `fn(*args, **kwargs)` with the hook on (this thread only) and returns what the config reached."""
  flow, ours = Flow(), {}

  def own(code) -> str | None:
    if code not in ours:
      path = pathlib.Path(code.co_filename)
      try:
        relative = path.resolve().relative_to(REPO)
      except ValueError:
        relative = None
      ours[code] = (str(relative) if relative and relative.parts[0] not in ('tests', '.venv')
                    and relative.suffix == '.py' else None)
    return ours[code]

  def hook(frame, event, _):
    if event != 'call':
      return
    code = frame.f_code
    module = own(code)
    if module is None:
      return
    count = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x04) + bool(code.co_flags & 0x08)
    values = [frame.f_locals.get(name) for name in code.co_varnames[:count]]
    spread = [v for v in values if isinstance(v, (tuple, dict))]
    values += [x for v in spread for x in (v.values() if isinstance(v, dict) else v)]
    name = _name(module, code)
    if any(_is_whole(v) for v in values):
      flow.direct[name] += 1
      flow.modules.add(module)
      caller = frame.f_back
      if caller is not None and own(caller.f_code):
        flow.callers[name].add(_name(own(caller.f_code), caller.f_code))
    elif any(_holds_whole(v) for v in values):
      flow.held[name] += 1
      flow.modules.add(module)

  sys.setprofile(hook)
  try:
    fn(*args, **kwargs)
  finally:
    sys.setprofile(None)
  return flow


def tiny_launch(workdir: str, steps: int = 2) -> Flow:
  from configs import tiny
  from trainer.run import loop
  config = tiny.get_config()
  config.train.steps = steps
  config.lock()
  return trace(loop.run, config, workdir)


def tiny_plan() -> Flow:
  from configs import tiny
  from trainer.run import plan
  config = tiny.get_config()
  config.train.remat_policy = 'auto'  # The resolution is part of what a plan builds.
  config.lock()
  return trace(plan.run, config, print_fn=lambda _: None)


def _report(title: str, flow: Flow) -> None:
  print(f'{title}: {len(flow.modules)} modules entered with the whole config; '
        f'{len(flow.direct)} functions / {sum(flow.direct.values())} calls take it directly, '
        f'{len(flow.held)} functions / {sum(flow.held.values())} calls inside a Job or RunContext')
  for name, n in sorted(flow.direct.items()):
    print(f'  direct {n:4d} {name}  (from {", ".join(sorted(flow.callers[name])) or "the caller"})')
  for name, n in sorted(flow.held.items()):
    print(f'  held   {n:4d} {name}')


if __name__ == '__main__':
  import tempfile
  sys.path.insert(0, str(REPO))
  if '--plan' in sys.argv:
    _report('--plan (configs/tiny.py, remat auto)', tiny_plan())
  else:
    with tempfile.TemporaryDirectory(prefix='config_flow_44C_') as d:
      _report('tiny launch (configs/tiny.py, 2 steps)', tiny_launch(d))
