"""How a brought model is called: its own names for the packed-row keywords, and constant keywords it requires.

The objective calls every model as `model(inputs, segment_ids=..., positions=...)`.
Public models name things their own way (flax lm1b: `inputs_segmentation=`,
`inputs_positions=`) and some require a keyword of their own (vision_transformer:
`train=`). `model.packed_kwarg_names` renames the packed keywords,
`model.call_kwargs` adds constants (at init too), and `model.eval_call_kwargs`
replaces some of them in eval, so such a model needs no wrapper module.

A model whose call is the decoding convention of flax's Gemma example and
google/tunix's models, `model(tokens, positions, cache, attention_mask) ->
(logits, cache)`, is recognized by those parameter names (`takes_decoding_call`)
and called that way: positions (the packed ones, else 0..L-1), the mask each
token may attend to ([B, L, L]: positions at or before its own, within its
segment), no cache in training; its logits are taken from the pair.
`with_cache` and the model's `init_cache` are there for scripts/sample.py.
"""

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from trainer import data
from trainer.base.errors import UserError


@dataclasses.dataclass(frozen=True)
class CallConvention:
  constants: tuple[tuple[str, Any], ...] = ()  # (name, value) keywords added to every call.
  packed_names: tuple[str, ...] = data.PACKED_KEYS  # The model's names for segment_ids and positions.
  decoding: bool = False  # The model's call is (tokens, positions, cache, attention_mask) -> (logits, cache).

  @classmethod
  def from_config(cls, model_config, evaluating: bool = False) -> 'CallConvention':
    """The convention `config.model` asks for: training's, or eval's (eval_call_kwargs over call_kwargs)."""
    get = model_config.get  # A run's config.json from before these keys has none of them.
    constants = dict(_pairs(get('call_kwargs', ()), 'model.call_kwargs'))
    if evaluating:
      constants.update(_pairs(get('eval_call_kwargs', ()), 'model.eval_call_kwargs'))
    names = tuple(get('packed_kwarg_names', data.PACKED_KEYS))
    if len(names) != len(data.PACKED_KEYS) or not all(isinstance(n, str) and n.isidentifier() for n in names):
      raise UserError(f'model.packed_kwarg_names={names!r}: give two keyword names, for segment ids then positions, '
                      f"e.g. ('inputs_segmentation', 'inputs_positions').")
    return cls(tuple(constants.items()), names)

  def keywords(self, packed: dict[str, Any]) -> dict[str, Any]:
    """The packed keywords (by the launcher's names) under the model's names, plus the constants."""
    renamed = dict(zip(self.packed_names, data.PACKED_KEYS))
    return {**{name: packed[ours] for name, ours in renamed.items() if ours in packed}, **dict(self.constants)}

  def wrap(self, model: Callable) -> Callable:
    """`model` called the objective's way, reaching it the model's way."""
    if self.decoding:
      return _Decoding(model, dict(self.constants))
    if self == CallConvention():
      return model
    return _Called(model, self)


def takes_decoding_call(module_class: type) -> bool:
  """Whether `module_class.__call__` takes (tokens, positions, cache, attention_mask), as flax's Gemma example and
  tunix's models do (their first argument's name differs: last_tokens, input_tokens)."""
  try:
    names = list(inspect.signature(module_class.__call__).parameters)
  except (TypeError, ValueError):
    return False
  return names[2:5] == ['positions', 'cache', 'attention_mask']


class _Decoding:
  """A decoding-convention model called the objective's way: `(inputs, segment_ids=, positions=) -> logits`."""

  def __init__(self, model, constants: dict[str, Any]):
    self._model, self._constants = model, constants

  def __call__(self, tokens_BL, segment_ids=None, positions=None, **kwargs):
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
    # Rows may arrive reordered (the context split): causality is by position, not by place in the row.
    mask_BLL = positions[:, None, :] <= positions[:, :, None]
    if segment_ids is not None:
      mask_BLL &= segment_ids[:, None, :] == segment_ids[:, :, None]
    return self.with_cache(tokens_BL, positions, None, mask_BLL, **kwargs)[0]

  def with_cache(self, tokens_BL, positions_BL, cache, mask_BLS, **kwargs):
    """(logits, cache) of the model's own call."""
    out = self._model(tokens_BL, positions_BL, cache, mask_BLS, **kwargs, **self._constants)
    return tuple(out) if isinstance(out, (tuple, list)) else (out, None)

  def __getattr__(self, name):  # The model's own methods: init_cache, a custom `loss`.
    return getattr(self._model, name)


class _Called:
  def __init__(self, model, convention: CallConvention):
    self._model, self._convention = model, convention

  def __call__(self, *args, **kwargs):
    packed = {k: kwargs.pop(k) for k in data.PACKED_KEYS if k in kwargs}
    return self._model(*args, **kwargs, **self._convention.keywords(packed))

  def __getattr__(self, name):  # The model's own methods (a custom `loss`) as they are.
    return getattr(self._model, name)


def _pairs(value, key: str) -> list[tuple[str, Any]]:
  try:
    pairs = [(name, v) for name, v in value]
  except (TypeError, ValueError):
    pairs = None
  if pairs is None or not all(isinstance(n, str) and n.isidentifier() for n, _ in pairs):
    raise UserError(f'{key}={value!r}: give (name, value) pairs, e.g. --config.{key}="((\'train\', True),)".')
  return pairs
