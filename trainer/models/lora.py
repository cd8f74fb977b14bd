"""Low-rank adapters (LoRA) on the built-in Llama's matmuls, through Qwix's LoRA mode: `model.lora_rank` > 0.

Qwix (google/qwix, pinned in requirements.txt) intercepts the dot_general/einsum of every Linen module whose path
matches a target and adds `<weight>_lora_a` (contracted dims flattened, rank) and `<weight>_lora_b` (rank, the other
dims flattened) beside the kernel, adding `x @ a @ b * alpha / rank` to its output; `b` starts at zero, so step 0 is
the base model. Scanned blocks stack both on the 'layers' axis like the kernel, and they inherit its logical axis
names, so the launcher's rules shard them. Everything else here is ours: which names a target may take, the checks,
the base weights frozen (`freeze_base`: no gradient, so no gradient matmuls; `labels`: no optimizer state), and the
adapters folded into the kernels (`merge`) or written as PEFT's tensors (`peft_tensors`).

The experts of an MoE block (trainer/models/moe.py) are not adapted: their grouped matmuls are not the dense
layers these targets name; the attention of every block and the dense MLP of the non-MoE blocks are.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from trainer.base.errors import UserError

# A target name -> the Linen module path suffix it adapts, and PEFT's module name for it.
TARGETS = {
    'query': ('attention/query', 'q_proj'), 'key': ('attention/key', 'k_proj'),
    'value': ('attention/value', 'v_proj'), 'out': ('attention/out', 'o_proj'),
    'gate': ('mlp/gate', 'gate_proj'), 'up': ('mlp/up', 'up_proj'), 'down': ('mlp/down', 'down_proj'),
}
SUFFIXES = ('_lora_a', '_lora_b')  # What Qwix appends to the adapted weight's name.


def enabled(model_config) -> bool:
  return bool(model_config.get('lora_rank', 0))  # A run's config.json from before the keys has none: off.


def targets(model_config) -> tuple[str, ...]:
  value = model_config.lora_targets
  names = tuple(n.strip() for n in value.split(',')) if isinstance(value, str) else tuple(value)
  return tuple(n for n in names if n)


def _matrix_dims(m, name: str) -> tuple[int, int]:
  """(in, out) features of the target's matrix in the Llama of model config `m`."""
  head_dim = m.get('head_dim', 0) or m.d_model // m.num_heads
  q, kv = m.num_heads * head_dim, (m.num_kv_heads or m.num_heads) * head_dim
  return {'query': (m.d_model, q), 'key': (m.d_model, kv), 'value': (m.d_model, kv), 'out': (q, m.d_model),
          'gate': (m.d_model, m.mlp_dim), 'up': (m.d_model, m.mlp_dim), 'down': (m.mlp_dim, m.d_model)}[name]


def check_config(config) -> None:
  """One UserError naming the key and the fix for LoRA settings the model cannot take; nothing when LoRA is off."""
  m = config.model
  if not enabled(m):
    return
  if m.name != 'llama':
    raise UserError(f"model.lora_rank={m.lora_rank}: LoRA adapts only the built-in Llama (model.name='llama'), not "
                    f"model.name={m.name!r}; set model.lora_rank=0.")
  names = targets(m)
  if not names:
    raise UserError(f'model.lora_targets is empty: name at least one of {", ".join(TARGETS)}.')
  for name in names:
    if name not in TARGETS:
      raise UserError(f'model.lora_targets names {name!r}, which is no matmul of the Llama: choose from '
                      f'{", ".join(TARGETS)}.')
  rank = m.lora_rank
  if not isinstance(rank, int) or rank < 0:
    raise UserError(f'model.lora_rank={rank!r} must be a whole number of at least 1 (0 = no LoRA).')
  for name in names:
    smallest = min(_matrix_dims(m, name))
    if rank > smallest:
      raise UserError(f'model.lora_rank={rank} exceeds the {name!r} matrix\'s smaller dimension {smallest} '
                      f'({"x".join(map(str, _matrix_dims(m, name)))}): use a rank of at most {smallest}.')
  if not m.lora_alpha > 0:
    raise UserError(f'model.lora_alpha={m.lora_alpha!r} must be positive (the adapters are scaled by alpha / rank).')
  if config.mesh.get('pipeline', 1) > 1:
    raise UserError(f'model.lora_rank={rank} with mesh.pipeline={config.mesh.pipeline}: the pipeline schedule runs '
                    f'the blocks without their adapters; set mesh.pipeline=1 or model.lora_rank=0.')


def check_adapted(model_config, abstract_params) -> None:
  """One UserError when model.lora_targets adapted nothing in the built model (only MoE blocks, say): the run would
  train nothing."""
  if enabled(model_config) and not has_adapters(abstract_params):
    raise UserError(f'model.lora_targets={targets(model_config)} adapts no matmul of this model (the experts of MoE '
                    f'blocks are not adapted): add an attention target such as \'query\', or set model.lora_rank=0.')


def wrap(module, model_config):
  """The Linen Llama `module` with adapters on model.lora_targets (Qwix's LoRA provider); same fields and methods."""
  try:
    import qwix  # Imported here: a run without LoRA never loads it.
  except ImportError as e:
    raise UserError(f'model.lora_rank={model_config.lora_rank} needs Qwix ({e}): install requirements.txt '
                    f'(qwix==0.1.8) into this environment, or set model.lora_rank=0.') from e
  # Qwix 0.1.8 checks for flax's removed nnx.VariableState alias on every intercepted call: one warning a call.
  warnings.filterwarnings('ignore', message="'VariableState' was removed", category=DeprecationWarning)

  class InComputeDtype(qwix.LoraProvider):
    """Qwix's LoRA with each adapted output in its input's dtype, as the layer's own: Qwix adds the float32
    adapters' x @ a @ b to a bfloat16 output, and a float32 block output breaks the scanned blocks' carry type."""

    def dot_general(self, lhs, rhs, *args, **kwargs):
      return super().dot_general(lhs, rhs, *args, **kwargs).astype(lhs.dtype)

    def einsum(self, einsum_str, *operands, **kwargs):
      return super().einsum(einsum_str, *operands, **kwargs).astype(operands[0].dtype)

  paths = '|'.join(TARGETS[n][0] for n in targets(model_config))
  provider = InComputeDtype(module_path=f'(.*/)?({paths})', rank=model_config.lora_rank,
                            alpha=float(model_config.lora_alpha))
  return qwix.apply_lora_to_model(module, provider)


def is_adapter(path) -> bool:
  """Whether a parameter path (a tuple of names, or jax key entries) is an adapter's."""
  last = [getattr(k, 'key', k) for k in path if isinstance(getattr(k, 'key', k), str)][-1]
  return last.endswith(SUFFIXES)


def labels(params):
  """'adapter' or 'frozen' per leaf of `params` (boxed or not): optax.multi_transform's labels."""
  return jax.tree_util.tree_map_with_path(lambda path, _: 'adapter' if is_adapter(path) else 'frozen', params)


def has_adapters(params) -> bool:
  return any(is_adapter(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0])


def freeze_base(params):
  """`params` with the base weights behind stop_gradient: their gradients are zeros the compiler never computes."""
  return jax.tree_util.tree_map_with_path(lambda path, p: p if is_adapter(path) else jax.lax.stop_gradient(p), params)


def fill_adapters(params, fresh):
  """`params` (imported base weights, without adapters) completed with `fresh`'s adapter leaves (their init)."""
  out = dict(params)
  for key, value in fresh.items():
    if isinstance(value, dict):
      out[key] = fill_adapters(params.get(key, {}), value)
    elif key.endswith(SUFFIXES):
      out[key] = value
  return out


def _pairs(params, prefix=()):
  """(path of the module, its dict) of every module holding an adapter pair."""
  if any(k.endswith(SUFFIXES) for k in params):
    yield prefix, params
  for key, value in params.items():
    if isinstance(value, dict):
      yield from _pairs(value, prefix + (key,))


def _delta(module: dict, scale: float) -> jax.Array:
  """The kernel's change a @ b * scale, in the kernel's shape (float32)."""
  a, b = (jnp.asarray(module['kernel' + s], jnp.float32) for s in SUFFIXES)
  return (jnp.matmul(a, b) * scale).reshape(module['kernel'].shape)


def merge(params, model_config):
  """The plain Llama's parameters: each adapted kernel plus a @ b * alpha / rank, the adapter leaves dropped."""
  scale = float(model_config.lora_alpha) / model_config.lora_rank

  def walk(tree):
    if not isinstance(tree, dict):
      return tree
    out = {k: walk(v) for k, v in tree.items() if not k.endswith(SUFFIXES)}
    if 'kernel_lora_a' in tree:
      kernel = tree['kernel']
      out['kernel'] = (jnp.asarray(kernel, jnp.float32) + _delta(tree, scale)).astype(kernel.dtype)
    return out
  return walk(params)


def reference(params):
  """`params` with every `b` at zero: the same tree, so the same (adapted) model computes the frozen base's outputs.

  A preference objective's reference model (DPO) is the run's starting point; under LoRA that is the base, held once
  in the state, so the reference needs no second copy of the weights, only this view (x @ a @ 0 costs a rank-sized
  matmul per target).
  """
  return jax.tree_util.tree_map_with_path(
      lambda path, p: jnp.zeros_like(p) if is_adapter(path) and str(getattr(path[-1], 'key', path[-1])).endswith(
          '_lora_b') else jax.lax.stop_gradient(p), params)


def base(params):
  """The frozen base: `params` without the adapter leaves."""
  if not isinstance(params, dict):
    return params
  return {k: base(v) for k, v in params.items() if not k.endswith(SUFFIXES)}


def peft_tensors(params, placements_by_path: dict) -> dict[str, np.ndarray]:
  """PEFT's adapter tensors: 'base_model.model.<layer>.lora_A.weight' (rank, in) and '...lora_B.weight' (out, rank)
  per adapted Hugging Face linear layer; `placements_by_path` is trainer/hf/layout's placement per kernel path."""
  out = {}
  for path, module in _pairs(params):
    placement = placements_by_path[path + ('kernel',)]
    a, b = (np.asarray(module['kernel' + s], np.float32) for s in SUFFIXES)
    a, b = (a, b) if placement.stacked else (a[None], b[None])
    for i, name in enumerate(placement.hf_names):
      stem = 'base_model.model.' + name[:-len('.weight')]
      out[f'{stem}.lora_A.weight'] = np.ascontiguousarray(a[i].T)
      out[f'{stem}.lora_B.weight'] = np.ascontiguousarray(b[i].T)
  return out


def peft_config(model_config, base_path: str) -> dict:
  """adapter_config.json as PEFT's LoraConfig writes it (peft_type LORA, the scaling lora_alpha / r)."""
  return {
      'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'base_model_name_or_path': base_path,
      'r': model_config.lora_rank, 'lora_alpha': float(model_config.lora_alpha), 'lora_dropout': 0.0,
      'target_modules': sorted(TARGETS[n][1] for n in targets(model_config)), 'bias': 'none',
      'fan_in_fan_out': False, 'use_rslora': False, 'use_dora': False, 'inference_mode': True,
      'init_lora_weights': True, 'modules_to_save': None, 'layers_to_transform': None, 'rank_pattern': {},
      'alpha_pattern': {},
  }


def count(params) -> tuple[int, int]:
  """(adapter parameters, all parameters): the trainable share the log reports."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return (sum(math.prod(p.shape) for path, p in flat if is_adapter(path)), sum(math.prod(p.shape) for _, p in flat))
