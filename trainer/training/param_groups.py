"""Which parameters get which treatment: weight decay, and Muon's matrix view of each weight.

Decided once from the parameters' paths ('/'-joined, e.g. 'layers/mlp/up/kernel'),
shapes and logical axis names (the Flax metadata the sharding rules read), so the
same answer holds for the boxed tree optax initializes and the plain tree the
step updates. Axes named 'layers' are the stacked copies of a scanned block:
each layer's slice is one weight, so they count neither toward a weight's rank
nor as a matrix dimension (Muon treats them as batch axes, vmapped).
"""

import dataclasses
import re
from collections.abc import Sequence

import flax.linen as nn
import jax
from optax.contrib import MuonDimensionNumbers

LAYER_AXIS = 'layers'
# Embeddings and output heads stay on AdamW under Muon, as Muon's authors do: an
# embedding is a lookup table (rows updated one token at a time, not a linear
# map whose spectrum matters) and the head's outputs are per-class logits.
# Recognized by a 'vocab' axis, or by name for models without axis metadata.
_EMBED_OR_HEAD = re.compile(r'(^|/)(embed\w*|\w*_embed\w*|wte|wpe|pos_embedding|head|lm_head|classifier)(/|$)')


@dataclasses.dataclass(frozen=True)
class ParamInfo:
  path: str  # '/'-joined keys.
  shape: tuple[int, ...]
  names: tuple[str | None, ...]  # Logical axis names; all None when the model gives none.

  @property
  def weight_axes(self) -> tuple[int, ...]:
    """The axes of one weight: every axis but the stacked-layers ones."""
    return tuple(i for i, n in enumerate(self.names) if n != LAYER_AXIS)


def _is_box(x) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def path_name(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


def describe(abstract_boxed_params) -> dict[str, ParamInfo]:
  """Path -> ParamInfo for a (possibly boxed) abstract parameter tree."""
  infos = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_boxed_params, is_leaf=_is_box):
    value = leaf.unbox() if _is_box(leaf) else leaf
    names = tuple(getattr(leaf, 'names', None) or (None,) * len(value.shape))
    infos[path_name(path)] = ParamInfo(path_name(path), tuple(value.shape), names)
  return infos


# Flax's names for biases and norm scales: a multi-head attention bias is
# (heads, head_dim), rank 2, yet a bias all the same.
_BIAS_OR_SCALE = re.compile(r'(^|/)(bias|scale)$')


def decays(info: ParamInfo, exclude: Sequence[str]) -> bool:
  """Weight decay on weight matrices only: norm scales and biases keep their values."""
  return (len(info.weight_axes) >= 2 and not _BIAS_OR_SCALE.search(info.path)
          and not any(re.search(p, info.path) for p in exclude))


def muon_dimensions(info: ParamInfo) -> MuonDimensionNumbers | None:
  """Muon's (reduction, output) axes of a weight, or None for AdamW.

  A weight of more than 2 dimensions (attention's (embed, heads, head_dim)) is
  the matrix (input features, output features): when its first axis is the
  model width ('embed') that axis is the input, otherwise the last axis is the
  output (attention's (heads, head_dim, embed) projection, or a model without names).
  """
  axes = info.weight_axes
  if len(axes) < 2 or 'vocab' in info.names or _EMBED_OR_HEAD.search(info.path):
    return None
  if info.names[axes[0]] == 'embed' and len(axes) > 2:
    return MuonDimensionNumbers(reduction_axis=axes[:1], output_axis=axes[1:])
  return MuonDimensionNumbers(reduction_axis=axes[:-1], output_axis=axes[-1:])


def tree_of(infos: dict[str, ParamInfo], choose):
  """A function params -> the tree of choose(info) per leaf; works on boxed and plain trees alike."""
  def build(params):
    return jax.tree_util.tree_map_with_path(lambda p, _: choose(infos[path_name(p)]), params, is_leaf=_is_box)
  return build
