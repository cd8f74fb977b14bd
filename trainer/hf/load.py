"""Import: `model.init_from='hf:/local/folder'` -> the built-in Llama's config keys and its weights, sharded.

Two calls, at two moments of a run:
- `configure(config, command_line)` reads config.json only (so `--plan` sizes an
  imported model without reading a weight): the model.* keys it stands for replace
  those of the config (the log lists those the config file set); a command-line
  override that contradicts it is refused naming both.
- `load_params(config, abstract_params, shardings)` reads the safetensors headers,
  checks every tensor's name and shape against the model (one line for a missing,
  extra or misshapen tensor, before any compile), then builds each parameter from
  its devices' slices: every process reads only the slices its own devices hold
  (trainer/hf/safetensors_files.py, through the safetensors package), one device
  at a time, so no host ever holds the whole model, nor more than one device's
  slice beyond what its devices keep.

The run calls `load_params` only when it starts fresh; a resumed run restores its
checkpoint and says that init_from was not read (trainer/run/loop.py).
"""

import collections
import copy
import json
import pathlib

import jax
import numpy as np
from absl import logging

from configs import base as base_config
from trainer.base.errors import UserError
from trainer.data import hf_tokenizer, prepared
from trainer.hf import architectures, layout, safetensors_files

PREFIX = 'hf:'
# Tensors some checkpoints carry that the model computes itself or shares: never a reason to refuse.
IGNORED_SUFFIXES = ('.rotary_emb.inv_freq',)


def folder_of(source: str) -> pathlib.Path:
  if not source.startswith(PREFIX):
    raise UserError(f"model.init_from={source!r}: give 'hf:' and a local Hugging Face model folder, e.g. "
                    f"--config.model.init_from=hf:/models/Llama-3.2-1B.")
  return pathlib.Path(source[len(PREFIX):]).expanduser()


def _where(config) -> str:
  return f'model.init_from={config.model.init_from!r}'


def _check_tokenizer(data, folder: pathlib.Path, where: str) -> None:
  """UserError when the prepared data's tokenizer is not the imported model's: its ids would mean other tokens to
  the model, the export would ship the model's tokenizer and sample.py would decode with the data's."""
  root = prepared.folder(data)
  if root is None or not (folder / 'tokenizer.json').is_file() or not (root / 'meta.json').is_file():
    return
  meta = json.loads((root / 'meta.json').read_text())
  made = meta.get('tokenizer_sha256') or ('bytes' if meta.get('tokenizer') == 'bytes' else None)
  if made is not None and made != hf_tokenizer.files_sha256(hf_tokenizer.folder_files(folder, where)):
    raise UserError(f'{where}: the data in {str(root)!r} was prepared with another tokenizer ({meta.get("tokenizer")})'
                    f' than the model\'s ({folder}); prepare it again with scripts/prepare_data.py '
                    f'--tokenizer={folder}.')


def configure(config, command_line: dict | None = None):
  """`config` with the model.* keys of init_from's config.json; `config` itself when init_from is None.

  `command_line`: the `--config.*` overrides launch.py was given (path -> value). A value the config file set
  (configs/default.py sets the model's sizes) is replaced by config.json's and listed in the log; only a
  command-line override that contradicts config.json is refused, naming both. Without `command_line` (a config
  built in code) every value other than configs/base.py's default counts as an override.
  """
  source = config.model.get('init_from')
  if not source:
    return config
  folder, where = folder_of(source), _where(config)
  if config.model.name != 'llama':
    raise UserError(f"{where} loads into the built-in Llama, but model.name={config.model.name!r}; set "
                    f"--config.model.name=llama.")
  keys = architectures.model_keys(architectures.read_config(folder, where), config.data.seq_len, where)
  _check_tokenizer(config.data, folder, where)
  defaults = base_config.get_config().model
  differ = {k: v for k, v in keys.items() if config.model[k] != v}
  overridden = ({k for k in differ if config.model[k] != defaults[k]} if command_line is None else
                {k for k in differ if f'model.{k}' in command_line})
  contradictions = [f'--config.model.{k}={config.model[k]!r} (config.json: {differ[k]!r})' for k in sorted(overridden)]
  if contradictions:
    raise UserError(f'{where}: {", ".join(contradictions)} contradicts {folder / "config.json"}, which decides the '
                    f'model; drop {"that override" if len(contradictions) == 1 else "those overrides"}.')
  replaced = [f'model.{k}={config.model[k]!r} -> {v!r}' for k, v in sorted(differ.items())
              if config.model[k] != defaults[k]]
  if replaced:
    logging.info('%s: config.json replaces what the config file set: %s.', where, ', '.join(replaced))
  config = copy.deepcopy(config)
  with config.unlocked():
    config.model.update(keys)
  return config


def _check_tensors(placements: list[layout.Placement], tensors: dict, tied: bool, where: str) -> None:
  wanted = {name: p for p in placements for name in p.hf_names}
  missing = [n for n in wanted if n not in tensors]
  if missing:
    raise UserError(f'{where}: the weights lack {len(missing)} tensor(s) the model needs, e.g. {missing[0]!r}; the '
                    f'folder is incomplete or of another model than its config.json.')
  spare = {'lm_head.weight'} if tied else set()  # Some tied checkpoints store the shared table twice.
  extra = [n for n in tensors if n not in wanted and n not in spare and not n.endswith(IGNORED_SUFFIXES)]
  if extra:
    raise UserError(f'{where}: the weights hold {len(extra)} tensor(s) the model has no place for, e.g. '
                    f'{extra[0]!r} (in {tensors[extra[0]].file.name}); the model would not be the checkpoint '
                    f'(config.json and the weights disagree, or the architecture has parts this Llama lacks).')
  for name, placement in wanted.items():
    if tensors[name].dtype not in safetensors_files.FLOATS:  # Read and cast, I32 codes would train as weights.
      raise UserError(f'{where}: tensor {name!r} in {tensors[name].file.name} has dtype {tensors[name].dtype}, but '
                      f'the model\'s parameters are floating point (expected one of '
                      f'{", ".join(safetensors_files.FLOATS)}); the weights are not of this model (a quantized or '
                      f'damaged checkpoint): download the float weights.')
    if tensors[name].shape != placement.hf_shape:
      raise UserError(f'{where}: tensor {name!r} in {tensors[name].file.name} has shape {tensors[name].shape}, but '
                      f'config.json makes it {placement.hf_shape}; config.json and the weights disagree.')


def check_weights(config, abstract_params) -> tuple[dict, list[layout.Placement]]:
  """(tensors by name, placements) after checking init_from's weights against the model, from the headers alone."""
  where = _where(config)
  tensors = safetensors_files.read_tensors(folder_of(config.model.init_from), where)
  placements = layout.placements(abstract_params)
  _check_tensors(placements, tensors, bool(config.model.tie_embeddings), where)
  return tensors, placements


def _assemble(placement: layout.Placement, leaf, sharding, read_block) -> jax.Array:
  """One parameter on this process's devices, each device's slice read, put on it and let go before the next.

  (jax.make_array_from_callback would hold every device's host copy at once.) Devices holding the same slice
  (replicas) get it from one read.
  """
  indices = sharding.addressable_devices_indices_map(leaf.shape)
  waiting = collections.Counter(_key(index, leaf.shape) for index in indices.values())
  cache, shards = {}, []
  for device, index in indices.items():
    key = _key(index, leaf.shape)
    if key not in cache:
      block = placement.read(tuple(slice(*k) for k in key), read_block)
      cache[key] = np.ascontiguousarray(block.astype(leaf.dtype, copy=False))
    waiting[key] -= 1
    shards.append(jax.device_put(cache.pop(key) if waiting[key] == 0 else cache[key], device))
  return jax.make_array_from_single_device_arrays(leaf.shape, sharding, shards)


def _key(index: tuple[slice, ...], shape) -> tuple[tuple[int, int], ...]:
  """A device's slice as ((start, stop), ...) per dimension, None bounds resolved."""
  return tuple(tuple(s.indices(n)[:2]) for s, n in zip(index, shape))


def load_params(config, abstract_params, shardings):
  """The parameters from init_from's safetensors, each already in its sharding (a tree like `abstract_params`)."""
  tensors, placements = check_weights(config, abstract_params)

  def read_block(name, rows, cols):
    return safetensors_files.read_block(tensors[name], rows, cols)

  flat_shardings = dict(layout.flatten(shardings))
  flat_abstract = dict(layout.flatten(abstract_params))
  loaded = {}
  for placement in placements:
    leaf, sharding = flat_abstract[placement.path], flat_shardings[placement.path]
    loaded[placement.path] = _assemble(placement, leaf, sharding, read_block)
  logging.info('%s: read %d parameters into the run\'s shardings.', _where(config), len(placements))
  return layout.unflatten(loaded)
