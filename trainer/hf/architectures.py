"""Hugging Face config.json <-> the built-in Llama's model.* keys, for the architectures it can be.

Llama (2, 3.x, with `rope_scaling` of type 'llama3'), Qwen2/2.5 (biases on q/k/v),
Qwen3 (RMSNorm of each query and key head; its own head_dim) and Mistral (no sliding window within data.seq_len) are the same decoder as
trainer/models/llama.py. A setting outside it (another activation, a bias on
the output projection, another RoPE scaling) is refused by name here, before
anything is built, rather than imported approximately.

Published config.json files carry RoPE as `rope_theta` plus `rope_scaling`;
transformers 5 writes one `rope_parameters` dict. Both are read.
"""

import json
import pathlib

from trainer.base import confined
from trainer.base.errors import UserError
from trainer.hf import config_fields

SUPPORTED = {'LlamaForCausalLM': 'llama', 'Qwen2ForCausalLM': 'qwen2', 'Qwen3ForCausalLM': 'qwen3',
             'MistralForCausalLM': 'mistral'}
LLAMA3_KEYS = {'factor': 'rope_scaling_factor', 'low_freq_factor': 'rope_low_freq_factor',
               'high_freq_factor': 'rope_high_freq_factor',
               'original_max_position_embeddings': 'rope_original_max_positions'}


def read_config(folder: pathlib.Path, where: str) -> dict:
  if not folder.is_dir():
    raise UserError(f'{where}: {str(folder)!r} is not a folder; give a local Hugging Face model folder '
                    f'(config.json and safetensors weights; the hub is never contacted).')
  path = confined.inside(folder, 'config.json', where)
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    raise UserError(f'{where}: {str(folder)!r} has no config.json; give the folder of a Hugging Face model '
                    f'(config.json next to its safetensors weights).') from None
  except (OSError, ValueError) as e:
    raise UserError(f'{where}: {str(path)!r} is unreadable ({type(e).__name__}: {e}); download it again.') from e


def architecture(hf: dict, where: str) -> str:
  names = hf.get('architectures') or []
  found = [n for n in names if n in SUPPORTED]
  if not found:
    raise UserError(f'{where}: config.json names architecture {", ".join(names) or "(none)"} (model_type '
                    f'{hf.get("model_type")!r}); supported: {", ".join(SUPPORTED)}.')
  return found[0]


def _rope(hf: dict, where: str) -> dict:
  """model.rope_* keys from rope_theta/rope_scaling (published) or rope_parameters (transformers 5)."""
  params = dict(hf.get('rope_parameters') or {})
  scaling = dict(hf.get('rope_scaling') or params)
  theta = hf.get('rope_theta', params.get('rope_theta', 10000.0))
  kind = scaling.get('rope_type', scaling.get('type', 'default'))
  keys = {'rope_max_wavelength': float(theta)}
  if kind in (None, 'default'):
    return {**keys, 'rope_scaling': 'none'}
  if kind != 'llama3':
    raise UserError(f"{where}: config.json's RoPE scaling is of type {kind!r}; supported: 'default' (none) and "
                    f"'llama3'.")
  return {**keys, 'rope_scaling': 'llama3',
          **{ours: (int if ours == 'rope_original_max_positions' else float)(scaling[theirs])
             for theirs, ours in LLAMA3_KEYS.items()}}


def model_keys(hf: dict, seq_len: int, where: str) -> dict:
  """The model.* values config.json stands for; UserError for what the built-in Llama cannot be."""
  config_fields.check(hf, where)  # Each field's type and range, and the sizes they make, before any is used.
  arch = architecture(hf, where)
  d, heads = hf['hidden_size'], hf['num_attention_heads']
  refusals = []
  if hf.get('hidden_act', 'silu') != 'silu':
    refusals.append(f"hidden_act={hf['hidden_act']!r} (the model's MLP is SwiGLU: 'silu')")
  if hf.get('attention_bias'):
    refusals.append('attention_bias=true (a bias on the output projection too; only q/k/v biases, as Qwen2, are '
                    'supported)')
  if hf.get('mlp_bias'):
    refusals.append('mlp_bias=true')
  window = hf.get('sliding_window') if hf.get('use_sliding_window', arch == 'MistralForCausalLM') else None
  if window is not None and window < seq_len:
    refusals.append(f'sliding_window={window} below data.seq_len={seq_len} (set --config.data.seq_len={window} or '
                    f'less: within the window the attention is the same)')
  if refusals:
    raise UserError(f'{where}: the built-in Llama cannot be this {arch}: {"; ".join(refusals)}.')
  return {
      'num_layers': hf['num_hidden_layers'], 'd_model': d, 'num_heads': heads,
      # Most configs' head_dim (when they name one) is hidden_size / num_attention_heads: model.head_dim=0 says that.
      'head_dim': 0 if hf.get('head_dim') in (None, d // heads) else hf['head_dim'],
      'num_kv_heads': hf.get('num_key_value_heads') or heads, 'mlp_dim': hf['intermediate_size'],
      'vocab_size': hf['vocab_size'], 'norm_eps': float(hf.get('rms_norm_eps', 1e-6)),
      'tie_embeddings': bool(hf.get('tie_word_embeddings', False)), 'qkv_bias': arch == 'Qwen2ForCausalLM',
      'qk_norm': arch == 'Qwen3ForCausalLM',
      **_rope(hf, where)}


def hf_config(model, torch_dtype: str = 'float32', architecture: str | None = None) -> dict:
  """The config.json of the built-in Llama of `model` (config.model): Qwen2 when it has q/k/v biases, Qwen3 when it
  norms queries and keys, else `architecture` when given (the imported 'MistralForCausalLM'), else Llama; UserError
  for a model no Hugging Face architecture describes."""
  bias, qk_norm = bool(model.get('qkv_bias', False)), bool(model.get('qk_norm', False))
  unexportable = [what for what, on in (('model.num_experts > 0 (a mixture of experts)', model.get('num_experts', 0)),
                                        ('both model.qkv_bias and model.qk_norm', bias and qk_norm)) if on]
  if unexportable:
    raise UserError(f'this run\'s model has {unexportable[0]}, which none of the exported Hugging Face architectures '
                    f'(LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM) describes; export it with '
                    f'scripts/export_params.py instead.')
  model_type = 'qwen3' if qk_norm else 'qwen2' if bias else SUPPORTED.get(architecture, 'llama')
  out = {
      'architectures': [{v: k for k, v in SUPPORTED.items()}[model_type]],
      'model_type': model_type,
      'hidden_size': model.d_model, 'num_hidden_layers': model.num_layers, 'num_attention_heads': model.num_heads,
      'num_key_value_heads': model.num_kv_heads or model.num_heads, 'intermediate_size': model.mlp_dim,
      'head_dim': model.get('head_dim', 0) or model.d_model // model.num_heads, 'vocab_size': model.vocab_size, 'hidden_act': 'silu',
      'rms_norm_eps': model.norm_eps, 'tie_word_embeddings': bool(model.tie_embeddings),
      'rope_theta': float(model.rope_max_wavelength), 'torch_dtype': torch_dtype,
      'max_position_embeddings': max(8192, model.get('rope_original_max_positions', 8192)),
      'attention_bias': False, 'mlp_bias': False, 'use_sliding_window': False,
  }
  if model.get('rope_scaling', 'none') == 'llama3':
    out['rope_scaling'] = {'rope_type': 'llama3', **{theirs: model[ours] for theirs, ours in LLAMA3_KEYS.items()}}
  return out
