"""Which attention kernel runs a call, and why: a pure function of the call's platform, dtype and shapes.

`choose` is what every model's attention goes through (trainer/attention/__init__.py) and what the model
builders and the run manifest ask before anything compiles. It takes plain values (a platform name, a dtype,
shapes), so every rule below is tested on CPU, including the GPU and TPU ones.

'auto' takes the fastest kernel that supports the call on the platform of the mesh's devices: cuDNN's fused
attention on NVIDIA GPUs, splash attention (Pallas/Mosaic) on TPUs, XLA's dot-product attention otherwise (CPU,
or when the fused kernel's limits rule the call out, with the reason). A named kernel that cannot run the call
is one UserError naming the constraint that failed.
"""

import dataclasses

import jax.numpy as jnp
from absl import logging

from trainer.base.errors import UserError

KERNELS = ('auto', 'xla', 'cudnn', 'splash')
# cuDNN's flash attention in jax (jax/_src/cudnn/fused_attention_stablehlo.py, check_is_flash_attention): head dim
# a multiple of 8, at most 128 before Hopper and 256 from Hopper (compute capability 9.0) on; float16/bfloat16;
# the packed (segment) layout from Hopper on.
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
# Splash attention tiles the sequence in blocks that are multiples of the TPU's 128 lanes.
SPLASH_LANES = 128
# Head dims splash was compiled for here (libtpu 0.0.51, v5p, plan mode): 64 and 128. Others are left to XLA on TPU
# until compiled; Pallas interpret mode (CPU) takes any.
SPLASH_TPU_HEAD_DIM_MULTIPLE = 64


@dataclasses.dataclass(frozen=True)
class Call:
  """What the kernel choice looks at: shapes (B, L, H, K) for queries and (B, L, G, K) for keys/values."""
  platform: str  # 'cpu', 'gpu' or 'tpu': the platform of the devices the call runs on.
  dtype: str  # The compute dtype of q/k/v, e.g. 'bfloat16'.
  q_shape: tuple[int, ...]
  kv_shape: tuple[int, ...]
  causal: bool
  packed: bool  # Segment ids given: attention stays within each segment (document) of a row.
  gpu_capability: float | None = None  # CUDA compute capability (9.0 = Hopper); None when unknown.

  @property
  def head_dim(self) -> int:
    return self.q_shape[-1]

  @property
  def seq_len(self) -> int:
    return self.q_shape[1]


@dataclasses.dataclass(frozen=True)
class Choice:
  kernel: str  # 'xla', 'cudnn' or 'splash'.
  setting: str  # What was asked for: 'auto' or a kernel name.
  reason: str  # Why this kernel: the platform's default, or why 'auto' fell back.

  def describe(self) -> str:
    return f"attention kernel {self.kernel} (model.attention={self.setting!r}: {self.reason})"


def cudnn_limit(call: Call) -> str | None:
  """The first cuDNN constraint the call fails, or None if cuDNN can run it."""
  if call.platform != 'gpu':
    return f'cuDNN needs an NVIDIA GPU, and the devices are {call.platform}'
  if jnp.dtype(call.dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
    return f'cuDNN takes bfloat16 or float16 compute, not {call.dtype} (train.compute_dtype)'
  hopper = call.gpu_capability is not None and call.gpu_capability >= 9.0
  max_head_dim = 256 if hopper else 128
  if call.head_dim % 8 or call.head_dim > max_head_dim:
    return f'cuDNN takes a head dim that is a multiple of 8 and at most {max_head_dim}, not {call.head_dim}'
  if call.packed and not hopper:
    return 'cuDNN takes packed rows (segment ids) only on Hopper or newer GPUs (compute capability 9.0)'
  return None


def splash_limit(call: Call) -> str | None:
  """The first splash-attention constraint the call fails, or None if splash can run it."""
  if call.platform not in ('tpu', 'cpu'):  # On CPU it runs in Pallas interpret mode (slow; for tests).
    return f'splash attention is a TPU kernel, and the devices are {call.platform}'
  if call.seq_len % SPLASH_LANES:
    return f'splash attention takes a sequence length that is a multiple of {SPLASH_LANES}, not {call.seq_len}'
  if call.q_shape[1] != call.kv_shape[1]:
    return 'splash attention here is self-attention: queries and keys of the same length'
  if call.platform == 'tpu' and call.head_dim % SPLASH_TPU_HEAD_DIM_MULTIPLE:
    return (f'splash attention on TPU takes a head dim that is a multiple of {SPLASH_TPU_HEAD_DIM_MULTIPLE} here, '
            f'not {call.head_dim}')
  return None


LIMITS = {'xla': lambda call: None, 'cudnn': cudnn_limit, 'splash': splash_limit}
# What 'auto' tries on each platform, fastest first; XLA runs everything.
AUTO_ORDER = {'gpu': ('cudnn', 'xla'), 'tpu': ('splash', 'xla')}


def choose(call: Call, setting: str) -> Choice:
  """The kernel that runs `call` under `model.attention=setting`; UserError if a named kernel cannot."""
  if setting not in KERNELS:
    raise UserError(f'model.attention={setting!r} is not a kernel; choose one of {KERNELS}.')
  if setting != 'auto':
    failed = LIMITS[setting](call)
    if failed:
      raise UserError(f'model.attention={setting!r} cannot run this model: {failed}. Set model.attention to '
                      f"'auto' (or 'xla', which runs everywhere).")
    return Choice(setting, setting, 'named in the config')
  order = AUTO_ORDER.get(call.platform, ('xla',))
  skipped = []
  for kernel in order:
    failed = LIMITS[kernel](call)
    if not failed:
      reason = f'the fastest kernel on {call.platform}' if not skipped else f'fell back: {"; ".join(skipped)}'
      if kernel == 'xla' and len(order) == 1:
        reason = f'no fused kernel on {call.platform}'
      return Choice(kernel, setting, reason)
    skipped.append(failed)
  raise AssertionError('XLA runs every call')  # 'xla' ends every order.


_LOGGED: set[str] = set()


def log_once(choice: Choice) -> None:
  """Logs the choice the first time it is made in this process (the model is traced for init, train and eval)."""
  text = choice.describe()
  if text not in _LOGGED:
    _LOGGED.add(text)
    logging.info('%s', text[0].upper() + text[1:])
