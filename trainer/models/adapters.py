"""Flax NNX and Linen models behind one functional face: `init(key) -> params`, `bind(params) -> model`.

The train state keeps parameters as a plain nested dict of arrays whichever
framework built them, so sharding, checkpoints and the optimizer never look at
the framework. Each parameter's logical axis names (from
`nnx.with_partitioning` / `nn.with_logical_partitioning`) are kept beside it
as a Flax `LogicallyPartitioned` box in `abstract_boxed`, which
parallel/sharding.py turns into NamedShardings.

- NNX (primary): built under `nnx.use_eager_sharding(False)` (the launcher
  places every shard itself, from the config's rules, after init), split into
  graph and `nnx.Param` state; `bind` merges the graph with the given params.
- Linen: `init`/`apply` on example inputs of the batch's shapes; `bind` returns
  a callable whose methods (e.g. a custom `loss`) go through `apply(method=...)`.

Both initialize from one key: NNX as `Model(config, rngs=nnx.Rngs(key))`, Linen
as `model.init(key, ...)`, so a hand-written loop reproduces the launcher's
initial parameters from `train.seed`.
"""

import contextlib
import dataclasses
import inspect
import re
import sys
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from trainer.base import frames
from trainer.base.errors import UserError
from trainer.models import quantization, sown

Params = Any  # Nested dict of arrays.

@dataclasses.dataclass(frozen=True)
class AdaptedModel:
  framework: str  # 'nnx' or 'linen'.
  class_name: str  # The user's class, for messages and the log.
  module_class: type  # Its type: custom methods (a `loss`) are looked up here.
  abstract_boxed: Params  # ShapeDtypeStructs; named leaves boxed in nn.LogicallyPartitioned, unnamed ones bare.
  init: Callable[[jax.Array], Params]  # key -> params (plain arrays, the same tree as abstract_boxed unboxed).
  bind: Callable[[Params], Any]  # params -> a callable model.

  @property
  def abstract_params(self) -> Params:
    return nn.meta.unbox(self.abstract_boxed)

  def box(self, params: Params) -> Params:
    """`params` with every named leaf in the box of its logical names (what optax and the rules need)."""
    return jax.tree.map(lambda box, p: box.replace_boxed(p) if isinstance(box, nn.meta.AxisMetadata) else p,
                        self.abstract_boxed, params, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


@contextlib.contextmanager
def flat_kernels_unpinned():
  """While a Linen model is traced: a boxed value with more axis names than dimensions is unboxed unconstrained.

  nn.DenseGeneral boxes its kernel at the flat 2-D shape with the names of the
  final 3-D/4-D kernel, then reshapes; Linen's apply re-runs that initializer
  abstractly to check shapes. Under an abstract mesh Flax 0.12 pins the
  unboxed value to its names, and a rank-4 spec on a rank-2 value fails
  (test_brought_models.py, the 'do' model). Such a value is never the
  parameter the step uses (the launcher places parameters itself), so it is
  left unpinned; a box whose names fit its value keeps Flax's constraint.
  """
  originals = {cls: cls.unbox for cls in (nn.Partitioned, nn.LogicallyPartitioned)}

  def wrap(unbox):
    def unbox_fitting(self, apply_constraint=True):
      fits = len(self.names) <= getattr(self.value, 'ndim', len(self.names))
      return unbox(self, apply_constraint=apply_constraint and fits)
    return unbox_fitting

  for cls, unbox in originals.items():
    cls.unbox = wrap(unbox)
  try:
    yield
  finally:
    for cls, unbox in originals.items():
      cls.unbox = unbox


def _signature(builder: Callable) -> tuple[set[str], bool]:
  """(keyword names the builder's signature lists, whether it takes **kwargs)."""
  # A class's own __init__: NNX's metaclass hides it behind a generic (*args, **kwargs) __call__.
  target = builder.__init__ if isinstance(builder, type) else builder
  try:
    accepted = inspect.signature(target).parameters
  except (TypeError, ValueError):
    return set(), False
  return set(accepted), any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())


def takes_keyword(builder: Callable, keyword: str) -> bool:
  """Whether the builder's signature names `keyword` (a **kwargs catch-all does not count)."""
  return keyword in _signature(builder)[0]


def call_builder(builder: Callable, config, keywords: dict[str, Any], **extra) -> Any:
  """`builder(config, **extra)`, plus each of `keywords` its signature names.

  'mesh' and 'rules' also go to a builder taking **kwargs (they only add
  information); the others ('dtype', 'param_dtype', 'remat_policy') change what
  is built, so only a builder naming them gets them.
  """
  names, takes_all = _signature(builder)
  passed = {k: v for k, v in keywords.items() if k in names or (takes_all and k in ('mesh', 'rules'))}
  return builder(config, **extra, **passed)


def is_nnx_builder(builder: Callable) -> bool:
  """An nnx.Module class, or a function taking `rngs`: built with `rngs=nnx.Rngs(key)`."""
  if isinstance(builder, type):
    return issubclass(builder, nnx.Module) if (nnx := _nnx_if_loaded()) else False
  return takes_keyword(builder, 'rngs')


def adapt(builder: Callable, config, example_inputs: tuple[tuple, dict], keywords: dict[str, Any],
          init_context: Callable[[], Any] = contextlib.nullcontext, quantize: str | None = None) -> AdaptedModel:
  """Builds the configured model abstractly (nothing allocated) and wraps it for the functional train step.

  `example_inputs` is `(args, kwargs)` of ShapeDtypeStructs: what a Linen model is initialized on;
  `keywords` go to the builder where its signature takes them (call_builder);
  `init_context()` is entered around a Linen model's initializing call;
  `quantize` ('fp8', 'int8'): its layer matmuls run so, through Qwix (quantization.brought_provider).
  """
  try:
    return _adapt(builder, config, example_inputs, keywords, init_context, quantize)
  except UserError:
    raise
  except Exception as e:  # pylint: disable=broad-except  (whatever the model raised while built: deterministic)
    # Before step 1 nothing a restart changes: one line with the line to fix, exit 2, not retried as a crash.
    raise UserError(frames.model_error(e, config.model.name, 'building it (abstractly, before any step)')) from e


def _adapt(builder, config, example_inputs, keywords, init_context, quantize) -> AdaptedModel:
  name = config.model.name
  if is_nnx_builder(builder):
    return _adapt_nnx(builder, config, keywords, example_inputs, quantize)
  module = call_builder(builder, config, keywords)
  if (nnx := _nnx_if_loaded()) and isinstance(module, nnx.Module):
    raise UserError(f'model.name={name!r} built an NNX module without `rngs`; give its constructor an `rngs` '
                    f'argument (the launcher passes nnx.Rngs seeded from train.seed).')
  if not isinstance(module, nn.Module):
    raise UserError(f'model.name={name!r} returned a {type(module).__name__}, not a Flax module; point it at an '
                    f'nnx.Module class, or at a function `build(config)` returning a flax.linen Module.')
  if quantize:
    def survey(provider):
      _linen_init(quantization.intercept(module, provider, example_inputs), example_inputs,
                  init_context).eval_shape(jax.random.key(0))
    provider = quantization.brought_provider(quantize, name, survey)
    module = quantization.intercept(module, provider, example_inputs)
  return _adapt_linen(module, example_inputs, name, init_context)


def axis_names(out_sharding) -> tuple | None:
  """The axis names `nnx.with_partitioning` was given: names, a PartitionSpec, or a NamedSharding (whose spec's
  names are taken; its mesh is the model's own, and the launcher places parameters on its mesh itself)."""
  if out_sharding is None:
    return None
  if isinstance(out_sharding, jax.sharding.NamedSharding):
    out_sharding = out_sharding.spec
  return tuple(out_sharding)


def _nnx_if_loaded():
  """flax.nnx if anything imported it, else None: no NNX module exists before it is imported.

  Importing it cost every launch of a Linen model (the built-in Llama) 0.18 s
  of start-up (`python -X importtime`, 2026-11-27), so only an NNX model pays it.
  """
  return sys.modules.get('flax.nnx')


def _adapt_nnx(builder, config, keywords, example_inputs, quantize) -> AdaptedModel:
  from flax import nnx  # pylint: disable=import-outside-toplevel  (see _nnx_if_loaded)
  provider = None

  def make(key):
    with nnx.use_eager_sharding(False):  # The launcher shards after init, from the config's rules.
      module = call_builder(builder, config, keywords, rngs=nnx.Rngs(key))
    return module if provider is None else quantization.intercept(module, provider, example_inputs)

  if quantize:
    def survey(seen):
      nonlocal provider
      provider = seen
      nnx.eval_shape(lambda: make(jax.random.key(0)))
    provider = quantization.brought_provider(quantize, config.model.name, survey)
  abstract_module = nnx.eval_shape(lambda: make(jax.random.key(0)))
  own_class = getattr(type(abstract_module), '_unquantized_type', type(abstract_module))  # Qwix's subclass's base.
  graphdef, abstract_state, rest = nnx.split(abstract_module, nnx.Param, ...)
  others = [('/'.join(map(str, path)), type(v).__name__) for path, v in nnx.to_flat_state(rest)]
  if others:
    listed = ', '.join(f'{p} ({t})' for p, t in others[:5])
    raise UserError(f'model.name={config.model.name!r} holds state other than nnx.Param: {listed}. The launcher trains '
                    f'parameters only and runs the model deterministically: drop stored rngs and batch statistics '
                    f'(e.g. use LayerNorm instead of BatchNorm, dropout off).')
  boxed = {}
  for path, variable in nnx.to_flat_state(abstract_state):
    names = axis_names(variable.get_metadata().get('out_sharding'))
    value = variable.get_value()
    leaf = nn.LogicallyPartitioned(value, names) if names is not None else value
    node = boxed
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf

  def init(key):
    return nnx.to_pure_dict(nnx.state(make(key), nnx.Param))

  return AdaptedModel('nnx', own_class.__name__, own_class, boxed, init,
                      lambda params: nnx.merge(graphdef, params))


class _BoundLinen:
  """A Linen module with its parameters: call it like the module; its methods go through `apply(method=...)`."""

  def __init__(self, module: nn.Module, params: Params):
    self._module, self._variables = module, {'params': params}
    self.sown = {}  # What the last call sowed into sown.COLLECTIONS (MoE loss terms and metrics).

  def __call__(self, *args, **kwargs):
    with flat_kernels_unpinned():
      out, self.sown = self._module.apply(self._variables, *args, mutable=list(sown.COLLECTIONS), **kwargs)
    return out

  def __getattr__(self, name):
    method = getattr(type(self._module), name)

    def call(*args, **kwargs):
      with flat_kernels_unpinned():
        return self._module.apply(self._variables, *args, method=method, **kwargs)
    return call


def _linen_init(module: nn.Module, example_inputs, init_context):
  """`module`'s jitted init on zeros of `example_inputs`' shapes: key -> variables."""
  def init_variables(key):
    args, kwargs = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct)
                                else s, example_inputs)  # Constant keywords (model.call_kwargs) as they are.
    with init_context(), flat_kernels_unpinned():
      return module.init(key, *args, **kwargs)

  # Jitted once, so the state's init (trainer/training/state.py), which calls it inside its own jit, reuses the trace
  # eval_shape made here: the model's init is traced once per launch, not twice.
  return jax.jit(init_variables)


def _adapt_linen(module: nn.Module, example_inputs, name: str, init_context) -> AdaptedModel:
  init_variables = _linen_init(module, example_inputs, init_context)
  own_class = getattr(type(module), '_unquantized_type', type(module))  # Qwix's subclass's base.
  try:
    variables = init_variables.eval_shape(jax.random.key(0))
  except TypeError as e:
    raise call_error(e, name, example_inputs[1], own_class) from e
  others = sorted(set(variables) - {'params', *sown.COLLECTIONS})
  if others:
    raise UserError(f'model.name={name!r} creates variable collections {others} besides "params". The launcher '
                    f'trains parameters only and runs the model deterministically: drop batch statistics and '
                    f'other mutable state (e.g. LayerNorm instead of BatchNorm).')
  return AdaptedModel('linen', own_class.__name__, own_class, variables['params'],
                      lambda key: nn.meta.unbox(init_variables(key)['params']),
                      lambda params: _BoundLinen(module, params))


def packing_refusal(name: str, module_class: type | None, keyword: str) -> str:
  """The line for a model refusing a packed-row keyword (data.packing=True calls it with segment_ids= and
  positions=): its own names for them where its __call__ has some, else that it cannot pack and how one can."""
  try:
    names = list(inspect.signature(module_class.__call__).parameters)
  except (AttributeError, TypeError, ValueError):
    names = []
  segment = [n for n in names if 'segment' in n]
  position = [n for n in names if 'position' in n]
  if segment and position:
    return (f'model.name={name!r} takes no {keyword}= keyword, but its __call__ takes {segment[0]}= and '
            f'{position[0]}=: if those are its segment ids and positions (data.packing=True passes both), name them '
            f'with --config.model.packed_kwarg_names="(\'{segment[0]}\', \'{position[0]}\')", or set '
            f'--config.data.packing=False.')
  return (f'model.name={name!r} cannot train on packed rows: data.packing=True calls it with segment_ids= and '
          f'positions=, and its __call__ takes no {keyword}= (nor any keyword for segment ids), so its attention would '
          f'cross the documents packed into a row. Set --config.data.packing=False, or make it packable: take '
          f'segment_ids= and positions= in its __call__ and attend only where segment ids match.')


def call_error(e: TypeError, name: str, kwargs: dict, module_class: type | None = None) -> Exception:
  """A UserError for a call the model's signature refuses (a keyword it lacks or requires); else `e` itself."""
  text = str(e)
  missing = re.search(r"__call__\(\) missing \d+ required (?:keyword-only |positional )?arguments?: '(\w+)'", text)
  if missing:
    key = missing.group(1)
    return UserError(f'model.name={name!r}: its call requires {key}= ({text}); the launcher calls it with '
                     f'{sorted(kwargs) or "no keywords"}: pass a constant with --config.model.call_kwargs='
                     f'"((\'{key}\', True),)" (and --config.model.eval_call_kwargs="((\'{key}\', False),)" for eval, '
                     f'if it differs).')
  given = [k for k in kwargs if f"'{k}'" in text]
  if not given:
    return e
  if isinstance(kwargs[given[0]], jax.ShapeDtypeStruct):  # A packed-row keyword.
    return UserError(packing_refusal(name, module_class, given[0]))
  return UserError(f'model.name={name!r} takes no {given[0]}= keyword ({text}): remove it from model.call_kwargs / '
                   f'model.eval_call_kwargs.')
