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

Any other model (a brought NNX or Linen model, the ViT) has no names the launcher knows: one abstract call through
Qwix finds the modules whose dots take a parameter, and all but its embeddings and its output head (the last one
called) run quantized (`brought_provider`); its log line names each.

On CPU the quantized dots are emulated (cast, scale, dot in float): the step's numerics are those of the chip, its
speed is not. `check` refuses a device with no fast path for the format; `brought_provider` refuses a model
whose only matmuls are its embedding and head.
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


def _weight_dots_provider(rules):
  """A Qwix QtProvider that quantizes, in the modules its `rules` match, only the dots with a parameter operand (a
  layer's kernel) and records in `.dots` every intercepted dot as (module path, has a parameter operand), in call
  order. A dot of two activations (the attention core, softmax(QK)V) stays in the compute dtype, as the recipes
  keep it, even where a model computes it in the module holding its projections."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import qwix  # pylint: disable=import-outside-toplevel
  # Qwix's own test of "is this operand a parameter of the current module" (how QT tells weights from activations);
  # private in qwix 0.1.8, which requirements.txt pins.
  from qwix._src.utils import flax_util  # pylint: disable=import-outside-toplevel

  class WeightDots(qwix.QtProvider):

    def __init__(self, rules):
      super().__init__(rules)
      self.dots: dict[str, bool] = {}  # Module path -> whether its dots have a parameter operand; call order.

    def _weighted(self, *operands) -> bool:
      path = '/'.join(map(str, flax_util.get_current_module_path()))
      weighted = any(flax_util.find_param(x) is not None for x in operands if hasattr(x, 'shape'))
      self.dots[path] = self.dots.get(path, False) or weighted
      return weighted

    def dot_general(self, lhs, rhs, *args, **kwargs):
      if self._weighted(lhs, rhs):
        return super().dot_general(lhs, rhs, *args, **kwargs)
      return jax.lax.dot_general(lhs, rhs, *args, **kwargs)  # Inside the handler Qwix intercepts nothing.

    def einsum(self, spec, *operands, **kwargs):
      if self._weighted(*operands):
        return super().einsum(spec, *operands, **kwargs)
      return jnp.einsum(spec, *operands, **kwargs)

  return WeightDots(rules)


def intercept(module, provider, example_inputs: tuple[tuple, dict]):
  """`module` (Linen or NNX) with its dots through `provider`. Qwix runs an NNX module once to set it up (on zeros of
  `example_inputs`' shapes, so only inside a trace such as nnx.eval_shape or jit); a Linen one is only wrapped."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import qwix  # pylint: disable=import-outside-toplevel
  if isinstance(module, nn.Module):
    return qwix.quantize_model(module, provider)
  args, kwargs = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype) if isinstance(s, jax.ShapeDtypeStruct)
                              else s, example_inputs)
  return qwix.quantize_model(module, provider, *args, **kwargs)


def _is_embedding(path: str) -> bool:
  return 'embed' in path.rsplit('/', 1)[-1].lower()  # nn.Embed's attend, 'wte', 'token_embedding'...


def brought_provider(mode: str, model_name: str, survey) -> object:
  """The Qwix provider that runs a brought model's layer matmuls in `mode`, found by one abstract call.

  `survey(provider)` calls the model once (abstractly) through `provider`. Every module whose dots take a
  parameter is a layer matmul except the embeddings (a module named '*embed*') and the output head (the last
  such module the call reaches), which stay in the compute dtype as in the built-in Llama; so do activation-by-
  activation dots and convolutions. Logs which module paths run at which precision.

  Raises:
    UserError: the model has no matmul left to quantize (exit 2).
  """
  seen = _weight_dots_provider([])  # No rule: quantizes nothing, records every dot.
  survey(seen)
  weighted = [p for p, w in seen.dots.items() if w]
  head = weighted[-1:]
  embeddings = [p for p in weighted if _is_embedding(p)]
  layers = [p for p in weighted if p not in head and p not in embeddings]
  core = [p or '(top)' for p, w in seen.dots.items() if not w]
  if not layers:
    raise UserError(f"train.quantization={mode!r}: model.name={model_name!r} has no layer matmul to quantize (its "
                    f"matmuls with a parameter are {weighted or 'none'}: embeddings and the output head, kept in "
                    f"train.compute_dtype); unset train.quantization.")
  fmt = FORMATS[mode]
  kept = [*(f'{p} (embedding)' for p in embeddings), *(f'{p} (output head)' for p in head),
          *(f'{p} (no parameter operand: attention core)' for p in core)]
  logging.info('train.quantization=%r (Qwix, per-tensor current scaling) on model.name=%r: the matmuls of %s run %s '
               'forward, %s gradients; in train.compute_dtype stay %s, norms, softmax and convolutions.', mode,
               model_name, ', '.join(p or '(top)' for p in layers), fmt.forward, fmt.backward, '; '.join(kept))
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import qwix  # pylint: disable=import-outside-toplevel
  rule = qwix.QtRule(module_path='|'.join(re.escape(p) for p in layers), op_names=('dot_general', 'einsum'),
                     weight_qtype=jnp.dtype(fmt.forward), act_qtype=jnp.dtype(fmt.forward),
                     bwd_qtype=jnp.dtype(fmt.backward), disable_channelwise_axes=True)
  return _weight_dots_provider([rule])


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
