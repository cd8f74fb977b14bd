"""train.quantization: the transformer layers' matmuls in fp8 or int8, through Qwix's quantized training (QT).

Qwix (google/qwix, MaxText's quantization library) intercepts the `dot_general`s and einsums a Linen module's call
makes and runs those whose module path matches a rule as quantized dots; everything else runs as before. The rule
here names the built-in Llama's dense kernels: the attention projections (query, key, value, out) and the MLP's
gate, up and down (the shared expert's too). The embedding lookup, the output head (run by the objective, outside
the model's call), the norms, RoPE, the attention core and softmax, and the MoE experts' grouped matmul (no
dot_general to intercept) stay in train.compute_dtype.

'fp8': E4M3 operands forward, E5M2 gradients backward, one scale per tensor computed from its current absolute
maximum ("current scaling", as torchtitan's Float8 and Megatron's default). Current rather than flax's delayed
scaling (amax histories in an 'overwrite_with_gradient' collection): on our pins both give the same error
(`benchmarks/bench_quantization.py --candidates`: relative error 0.038 forward, 0.059 for both gradients, against
0.003 in bf16) and both compile to fp8 dots for an H100 (`--h100`); current scaling needs no state, so nothing new
is checkpointed and a resume is bit-exact as any other, and it cannot lag a sudden change of range. Qwix also
covers int8 and intercepts any Linen or NNX module's dots, which flax's ops (a Dense's `dot_general_cls`) do not. 'int8': the same with int8 on both passes (TPU v5e/v5p/v6e's matrix units run int8 at twice bf16).

On CPU the quantized dots are emulated (cast, scale, dot in float): the step's numerics are those of the chip, its
speed is not. `check` refuses a device with no fast path for the format; `quantize` refuses a model whose call
makes no matching matmul.
"""

import dataclasses
import re

from absl import logging

from trainer.base.errors import UserError

MODES = ('fp8', 'int8')
# The module paths (Qwix joins a Linen module's scope names with '/') whose dots are quantized: the attention
# projections and the dense MLP, at any depth (scanned 'layers/...', unrolled 'block_3/...', grouped 'block_0/...').
LAYER_MATMULS = r'(.*/)?(attention/(query|key|value|out)|(mlp|shared_expert)/(gate|up|down))'
KEPT = 'embeddings, output head, norms, attention core and softmax, MoE experts'
# TPU device kinds whose matrix units take each format: int8 on v5e ('TPU v5 lite'), v5p and v6e ('TPU v6 lite');
# fp8 on TPU7x.
TPU_KINDS = {'int8': ('TPU v5 lite', 'TPU v5p', 'TPU v5', 'TPU v6 lite'), 'fp8': ('TPU7x',)}
FP8_MIN_CAPABILITY = 8.9  # NVIDIA fp8 tensor cores: Ada (sm_89) and Hopper (sm_90) onwards.


@dataclasses.dataclass(frozen=True)
class Format:
  forward: str  # The operands' dtype name in the forward dots.
  backward: str  # The gradients' dtype name in the backward dots.


FORMATS = {'fp8': Format('float8_e4m3fn', 'float8_e5m2'), 'int8': Format('int8', 'int8')}


def _capability(device) -> float:
  """A GPU's compute capability (jax reports it as a string, '9.0'); 0 where it says none."""
  try:
    return float(getattr(device, 'compute_capability', 0) or 0)
  except ValueError:
    return 0.0


def check(mode: str | None, device) -> None:
  """Raises UserError when `device` (any of the run's) has no fast path for train.quantization `mode`; logs the
  CPU's emulation."""
  if mode is None:
    return
  if mode not in MODES:
    raise UserError(f'train.quantization={mode!r}: choose one of {MODES}, or None for train.compute_dtype matmuls.')
  platform, kind = device.platform, getattr(device, 'device_kind', '?')
  if platform == 'cpu':
    logging.info('train.quantization=%r on CPU: the quantized matmuls are emulated, for testing numerics, not speed.',
                 mode)
  elif platform == 'gpu' and mode == 'fp8' and _capability(device) < FP8_MIN_CAPABILITY:
    raise UserError(f"train.quantization='fp8' needs fp8 tensor cores (NVIDIA Ada/Hopper or later, compute "
                    f"capability >= {FP8_MIN_CAPABILITY}); this {kind} has {_capability(device) or 'none'}. "
                    f"Unset train.quantization (bf16 matmuls).")
  elif platform == 'gpu' and mode == 'int8':
    raise UserError(f"train.quantization='int8' is the TPU path (v5e, v5p, v6e); on this {kind} use "
                    f"train.quantization='fp8' (Hopper or later) or unset it.")
  elif platform == 'tpu' and kind not in TPU_KINDS[mode]:
    other = next(m for m in MODES if m != mode)
    hint = f"train.quantization={other!r} or " if kind in TPU_KINDS[other] else ''
    raise UserError(f"train.quantization={mode!r}: this {kind} has no {mode} matrix path "
                    f"({mode} runs on {', '.join(TPU_KINDS[mode])}); use {hint}unset train.quantization.")


def provider(mode: str):
  """Qwix's quantized-training provider for `mode`: per-tensor current scaling on LAYER_MATMULS."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import qwix  # pylint: disable=import-outside-toplevel  (only runs that quantize load it)
  fmt = FORMATS[mode]
  rule = qwix.QtRule(module_path=LAYER_MATMULS, weight_qtype=jnp.dtype(fmt.forward), act_qtype=jnp.dtype(fmt.forward),
                     bwd_qtype=jnp.dtype(fmt.backward), disable_channelwise_axes=True)
  return qwix.QtProvider([rule])


def require_quantizable(mode: str | None, model_name: str) -> None:
  """Raises UserError when train.quantization is set for a model with no matmul the rule names (every model but
  the built-in Llama, so far: a brought model's layer names are its own)."""
  if mode is not None and model_name != 'llama':
    raise UserError(f"train.quantization={mode!r}: model.name={model_name!r} has no matmul the launcher quantizes "
                    f"(only the built-in 'llama' attention and MLP kernels, so far); unset train.quantization.")


def quantize(model, mode: str | None):
  """`model` (a Linen module) with its layer matmuls in `mode`; `model` itself when mode is None.

  Logs which matmuls run at which precision.
  """
  if mode is None:
    return model
  import qwix  # pylint: disable=import-outside-toplevel
  fmt = FORMATS[mode]
  logging.info('train.quantization=%r (Qwix, per-tensor current scaling): attention q/k/v/out and MLP gate/up/down '
               'matmuls run %s forward, %s gradients; %s stay in train.compute_dtype.',
               mode, fmt.forward, fmt.backward, KEPT)
  return qwix.quantize_model(model, provider(mode))


def is_layer_matmul(module_path: str) -> bool:
  """Whether a dot in the module at `module_path` ('layers/mlp/up') is quantized."""
  return re.fullmatch(LAYER_MATMULS, module_path) is not None


def resume_note(step: int, saved_mode: str | None, mode: str | None) -> str | None:
  """The line a resume logs when train.quantization changed since checkpoint `step`; None when it did not.

  Current scaling keeps no state: the checkpoint's float32 master weights are all either precision needs.
  """
  if saved_mode == mode:
    return None
  name = lambda m: m or 'train.compute_dtype'
  return (f'Resuming step {step}, saved with {name(saved_mode)} layer matmuls, with {name(mode)} ones '
          f'(train.quantization {saved_mode!r} -> {mode!r}): the same float32 weights; current scaling has no '
          f'scaling state to restore.')
