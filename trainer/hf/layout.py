"""Where each parameter of the built-in Llama lives in a Hugging Face checkpoint, and how it is laid out there.

A Hugging Face linear layer stores `weight` as (out features, in features); the
Llama's kernels are (in..., out...) with heads split out, e.g. the query kernel
(D, H, K) is `q_proj.weight` (H*K, D) transposed and reshaped. So every parameter
is one Hugging Face tensor (one per layer for the blocks), optionally transposed,
whose two dimensions are products of consecutive dimensions of ours: `split` of
ours make the first (of the transposed tensor), the rest the second. That is all
a slice needs: the rows and columns covering a slice of ours are contiguous
ranges (whole heads), read and then cut down.

The rotary layout needs no permutation: Hugging Face's checkpoints are stored for
`rotate_half` (channel i turns with channel i + K/2), which is what
trainer/models/llama.py's `rope` does. The imported logits prove it (tests/test_hf.py).

Scanned blocks stack the layers on a leading axis ('layers/...'); unrolled ones
are 'block_<i>/...'.
"""

import dataclasses
import math

import numpy as np

GLOBAL = {
    ('embed', 'embedding'): ('model.embed_tokens.weight', False, 1),
    ('head', 'kernel'): ('lm_head.weight', True, 1),
    ('final_norm', 'scale'): ('model.norm.weight', False, 1),
}
PER_LAYER = {
    ('attention', 'query', 'kernel'): ('self_attn.q_proj.weight', True, 1),
    ('attention', 'key', 'kernel'): ('self_attn.k_proj.weight', True, 1),
    ('attention', 'value', 'kernel'): ('self_attn.v_proj.weight', True, 1),
    ('attention', 'query', 'bias'): ('self_attn.q_proj.bias', False, 2),
    ('attention', 'key', 'bias'): ('self_attn.k_proj.bias', False, 2),
    ('attention', 'value', 'bias'): ('self_attn.v_proj.bias', False, 2),
    ('attention', 'out', 'kernel'): ('self_attn.o_proj.weight', True, 2),
    ('attention', 'query_norm', 'scale'): ('self_attn.q_norm.weight', False, 1),
    ('attention', 'key_norm', 'scale'): ('self_attn.k_norm.weight', False, 1),
    ('mlp', 'gate', 'kernel'): ('mlp.gate_proj.weight', True, 1),
    ('mlp', 'up', 'kernel'): ('mlp.up_proj.weight', True, 1),
    ('mlp', 'down', 'kernel'): ('mlp.down_proj.weight', True, 1),
    ('attention_norm', 'scale'): ('input_layernorm.weight', False, 1),
    ('mlp_norm', 'scale'): ('post_attention_layernorm.weight', False, 1),
}


@dataclasses.dataclass(frozen=True)
class Placement:
  """One parameter of ours: its Hugging Face tensor(s) and how they map onto it."""
  path: tuple[str, ...]  # Ours, e.g. ('layers', 'attention', 'query', 'kernel').
  hf_names: tuple[str, ...]  # One name; or one per layer, stacked on our leading axis when `stacked`.
  transpose: bool  # Ours is the Hugging Face tensor transposed (a linear layer's weight).
  split: int  # Our (per-layer) dimensions [:split] make the transposed tensor's first dimension.
  shape: tuple[int, ...]  # Ours, with the layers axis when stacked.
  stacked: bool

  @property
  def layer_shape(self) -> tuple[int, ...]:
    return self.shape[1:] if self.stacked else self.shape

  @property
  def hf_shape(self) -> tuple[int, ...]:
    """The shape the Hugging Face tensor must have."""
    dims = [math.prod(self.layer_shape[:self.split]), math.prod(self.layer_shape[self.split:])]
    if self.split == len(self.layer_shape):
      dims = dims[:1]  # A vector (norm scale, bias): no second dimension.
    return tuple(reversed(dims)) if self.transpose else tuple(dims)

  def read(self, index: tuple[slice, ...], read_block) -> np.ndarray:
    """Our slice `index` (one slice per dimension, start/stop resolved), read through
    `read_block(hf_name, rows, cols)` -> the tensor's rows x cols (cols None for vectors)."""
    if not self.stacked:
      return self._read_layer(self.hf_names[0], index, read_block)
    layers = range(len(self.hf_names))[index[0]]
    out = None
    for j, i in enumerate(layers):  # Filled a layer at a time: never the slice twice over.
      layer = self._read_layer(self.hf_names[i], index[1:], read_block)
      if out is None:
        out = np.empty((len(layers),) + layer.shape, layer.dtype)
      out[j] = layer
    return out

  def to_hf(self, value: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(Hugging Face name, tensor) pairs of our whole parameter `value`: the inverse of `read`."""
    layers = list(value) if self.stacked else [value]
    shape = self.layer_shape
    out = []
    for name, layer in zip(self.hf_names, layers):
      matrix = layer.reshape(math.prod(shape[:self.split]), -1) if self.split < len(shape) else layer.reshape(-1)
      out.append((name, np.ascontiguousarray(matrix.T if self.transpose else matrix)))
    return out

  def _read_layer(self, name: str, index: tuple[slice, ...], read_block) -> np.ndarray:
    shape = self.layer_shape
    groups = [range(0, self.split), range(self.split, len(shape))]
    covers, local = [], []
    for group in groups:
      if not group:
        continue
      inner = math.prod(shape[d] for d in group[1:])
      first = index[group[0]]
      covers.append(slice(first.start * inner, first.stop * inner))  # Whole sub-blocks of the group's first dim.
      local.append((first.stop - first.start,) + tuple(shape[d] for d in group[1:]))
    if self.transpose:
      block = read_block(name, covers[1], covers[0]).T
    else:
      block = read_block(name, covers[0], covers[1] if len(covers) > 1 else None)
    block = block.reshape(tuple(n for dims in local for n in dims))
    inner_index = tuple(slice(None) if d in (g[0] for g in groups if g) else index[d] for d in range(len(shape)))
    return block[inner_index]


def placements(abstract_params: dict) -> list[Placement]:
  """A Placement per parameter of the Llama's abstract parameter tree (a nested dict of ShapeDtypeStructs)."""
  out = []
  for path, leaf in flatten(abstract_params):
    shape = tuple(leaf.shape)
    if path in GLOBAL:
      name, transpose, split = GLOBAL[path]
      out.append(Placement(path, (name,), transpose, split, shape, stacked=False))
    elif path[0] == 'layers' and path[1:] in PER_LAYER:
      name, transpose, split = PER_LAYER[path[1:]]
      out.append(Placement(path, tuple(f'model.layers.{i}.{name}' for i in range(shape[0])), transpose, split, shape,
                           stacked=True))
    elif path[0].startswith('block_') and path[1:] in PER_LAYER:
      name, transpose, split = PER_LAYER[path[1:]]
      out.append(Placement(path, (f'model.layers.{path[0][len("block_"):]}.{name}',), transpose, split, shape,
                           stacked=False))
    else:
      raise ValueError(f'no Hugging Face name for parameter {"/".join(path)}')  # A model change this file missed.
  return out


def flatten(tree, prefix=()):
  """(path tuple, leaf) of a nested dict of parameters (or of their shardings)."""
  for key, value in tree.items():
    if hasattr(value, 'items'):
      yield from flatten(value, prefix + (key,))
    else:
      yield prefix + (key,), value


def unflatten(flat: dict) -> dict:
  tree = {}
  for path, leaf in flat.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return tree
