"""Attention for every model: one call, `dot_product_attention`, and the kernel that runs it per platform.

Shape letters: B batch, L sequence length, H query heads, G key/value heads (G divides H; G = H is plain multi-head
attention), K head dim.

The built-in Llama and ViT call it, and so can a user's model (docs/bring_your_own_model.md). The kernel comes
from `model.attention` ('auto' or a name in choice.KERNELS): trainer/attention/choice.py decides, one module per
kernel family runs it (xla.py, cudnn.py, splash.py). `check_config` makes the same decision from a launcher
config's shapes before anything compiles, so a named kernel that cannot run the model fails in one line.
"""

import contextlib
import contextvars

import jax
import numpy as np
from jax.sharding import Mesh

from trainer.attention import context, cudnn, splash, xla
from trainer.attention.choice import Call, Choice, KERNELS, choose, log_once
from trainer.base.errors import UserError
from trainer.base.precision import compute_dtype

__all__ = ['KERNELS', 'Call', 'Choice', 'choose', 'dot_product_attention', 'cached_attention', 'check_config',
           'platform_of', 'xla_for_counting', 'fused_forward_saveable', 'dots_saveable']

_COUNTING = contextvars.ContextVar('attention_xla_for_counting', default=False)


@contextlib.contextmanager
def xla_for_counting():
  """Within, every call runs the XLA kernel: the same math as cuDNN's and splash's, written as two matmuls that a
  jaxpr shows (their kernels are opaque custom calls), so trainer/observe/flops.py counts the same FLOPs on any
  platform."""
  token = _COUNTING.set(True)
  try:
    yield
  finally:
    _COUNTING.reset(token)


def fused_forward_saveable(primitive, *_, **__) -> bool:
  """A jax.checkpoint policy: keep what a fused attention kernel's forward returns for the backward pass.

  cuDNN's and splash's forward are one opaque call each, returning the output and the softmax statistics its
  backward reads; no dot-based or name-based policy saves them, so every remat policy recomputed the whole
  attention forward inside the backward pass, even a policy whose point is to save the attention output
  (tests/test_cuda_lowering.py counts the calls). Splash is a Pallas call: this saves any Pallas kernel's outputs,
  which in the built-in models is attention alone.
  """
  return primitive is cudnn.FORWARD_PRIMITIVE or primitive.name == 'pallas_call'


# 'dots_saveable': every matmul output, the fused attention kernels' (two matmuls and a softmax) included.
dots_saveable = jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.dots_saveable,
                                                                fused_forward_saveable)


def platform_of(mesh: Mesh | None = None) -> tuple[str, float | None]:
  """(platform, CUDA compute capability or None) of the devices the call runs on.

  The mesh's devices when given (they may be TPU compile-only devices described on a CPU host: `--topology`), or
  an abstract mesh's device (a pipeline stage's blocks get the shard_map's abstract mesh);
  inside a per-device strategy's shard_map, the abstract mesh's device; else jax's default backend.
  """
  if isinstance(mesh, jax.sharding.AbstractMesh):  # Inside a pipeline's shard_map (trainer/pipeline/schedule.py).
    return mesh.abstract_device.platform, None
  if mesh is not None:
    device = mesh.devices.flat[0]
    capability = getattr(device, 'compute_capability', None)
    return device.platform, float(capability) if capability else None
  abstract = jax.sharding.get_abstract_mesh()
  if abstract is not None and getattr(abstract, 'abstract_device', None) is not None:
    return abstract.abstract_device.platform, None
  device = jax.devices()[0]
  capability = getattr(device, 'compute_capability', None)
  return device.platform, float(capability) if capability else None


def dot_product_attention(q_BLHK, k_BLGK, v_BLGK, *, causal: bool, segment_ids_BL=None, kernel: str = 'auto',
                          mesh: Mesh | None = None, rules=(), max_segments: int | None = None,
                          context_scheme: str = 'auto'):
  """Softmax(q k^T / sqrt(K)) v, on the kernel `kernel` names ('auto': the fastest that fits the call).

  Args:
    q_BLHK: queries (B, L, H, K); k_BLGK, v_BLGK: keys and values (B, L, G, K), G dividing H (grouped-query).
    causal: each token attends only to itself and earlier tokens.
    segment_ids_BL: (B, L) integer ids of packed rows: a token attends only to tokens of its own segment
      (with `causal`, only earlier ones). Segments are runs of equal ids along the row, as trainer/data numbers
      documents. None: the row is one sequence.
    kernel: `model.attention`: 'auto', 'xla', 'cudnn' or 'splash'.
    mesh, rules: the mesh and logical axis rules when the caller runs under jit with a mesh (the launcher's
      'jit' strategy gives them to models that take them); None under shard_map/pmap, where the model already
      sees its local shards. Splash needs them to shard itself; the other kernels are partitioned by XLA.
      With mesh.context > 1 the rows must be in parallel/context.py's balanced order (the launcher's loss puts
      them so) and attention runs across the split (trainer/attention/context.py).
    max_segments: with `segment_ids_BL`, the most segments (runs of equal ids) a row can hold; the launcher
      passes data.max_documents_per_row. Only cuDNN reads it: it treats each segment as a sequence of its own
      and keeps float32 softmax statistics of shape (B * max_segments, H, L) for the backward pass. None takes
      L, always enough but twice the bytes of XLA's (B, H, L, L) bfloat16 scores: pass the real bound. A row with more
      segments than this loses its last ones on cuDNN.
    context_scheme: `model.context_scheme`, how attention crosses mesh.context > 1: 'auto', 'all-gather' or 'ring'
      (trainer/attention/context.py). Ignored without the split.

  Returns:
    (B, L, H, K) in the dtype of q.

  Raises:
    UserError: a named kernel cannot run this call; names the constraint that failed.
  """
  if _COUNTING.get():
    return xla.attention(q_BLHK, k_BLGK, v_BLGK, causal=causal, segment_ids_BL=segment_ids_BL)
  if mesh is not None and mesh.shape.get(context.context_lib.AXIS, 1) > 1:
    choice, scheme = context_choice(mesh, kernel, context_scheme, q_BLHK.shape[1], q_BLHK.shape[-1])
    log_once(choice)
    return context.attention(q_BLHK, k_BLGK, v_BLGK, causal=causal, segment_ids_BL=segment_ids_BL, mesh=mesh,
                             rules=rules, kernel=choice.kernel, scheme=scheme,
                             interpret=platform_of(mesh)[0] != 'tpu')
  platform, capability = platform_of(mesh)
  call = Call(platform, np.dtype(q_BLHK.dtype).name, tuple(q_BLHK.shape), tuple(k_BLGK.shape), causal,
              segment_ids_BL is not None, capability)
  choice = choose(call, kernel)
  log_once(choice)
  if choice.kernel == 'cudnn':
    return cudnn.attention(q_BLHK, k_BLGK, v_BLGK, causal=causal, segment_ids_BL=segment_ids_BL,
                           max_segments=max_segments)
  if choice.kernel == 'splash':
    return splash.attention(q_BLHK, k_BLGK, v_BLGK, causal=causal, segment_ids_BL=segment_ids_BL, mesh=mesh,
                            rules=rules, interpret=platform != 'tpu')
  return xla.attention(q_BLHK, k_BLGK, v_BLGK, causal=causal, segment_ids_BL=segment_ids_BL)


def cached_attention(q_BLHK, k_BSGK, v_BSGK, positions_BL):
  """Decoding with a KV cache (trainer/models/kv_cache.py): queries at `positions_BL` (B, L) against S cached
  key/value slots (B, S, G, K), slot s holding position s; each query attends to the slots up to its position.

  Always XLA's: a step's few queries against the cache are matrix-vector work the fused kernels do not target, and
  the mask is by position, not the causal triangle they build in.
  """
  return xla.attention_to_positions(q_BLHK, k_BSGK, v_BSGK, positions_BL)


def context_choice(mesh: Mesh, setting: str, scheme_setting: str, seq_len: int,
                   head_dim: int) -> tuple[Choice, str]:
  """(kernel choice, scheme) of attention across a context axis of the mesh; the choice's reason names the scheme
  (logged once, in the run manifest)."""
  parts = mesh.shape[context.context_lib.AXIS]
  scheme, kernel, why = context.scheme_for(scheme_setting, setting, platform_of(mesh)[0], seq_len, parts, head_dim)
  return Choice(kernel, setting, f'{scheme} of keys/values over mesh.context={parts}, balanced (zig-zag) row order '
                f'(model.context_scheme={scheme_setting!r}): {why}'), scheme


def config_call(m, data, dtype_name: str, mesh: Mesh | None = None) -> Call | None:
  """The attention call of a built-in model ('llama', 'vit') under config.model `m`, config.data `data` and
  train.compute_dtype `dtype_name`; None for other models."""
  platform, capability = platform_of(mesh)
  dtype = _config_dtype(dtype_name, platform)
  if m.name == 'llama':
    head_dim, kv_heads, seq_len = m.d_model // m.num_heads, m.num_kv_heads or m.num_heads, data.seq_len
    return Call(platform, dtype, (1, seq_len, m.num_heads, head_dim), (1, seq_len, kv_heads, head_dim),
                causal=True, packed=bool(data.packing), gpu_capability=capability)
  if m.name == 'vit':
    height, width, _ = data.image_shape
    shape = (1, (height // m.patch_size) * (width // m.patch_size), m.num_heads, m.d_model // m.num_heads)
    return Call(platform, dtype, shape, shape, causal=False, packed=False, gpu_capability=capability)
  return None


def _config_dtype(name: str, platform: str) -> str:
  """The compute dtype's name; 'auto' read for the mesh's platform (bfloat16 off CPU), not this host's."""
  return np.dtype(compute_dtype(name, platform)).name


def check_config(m, data, dtype_name: str, mesh: Mesh | None = None) -> Choice | None:
  """The kernel a built-in model will run (config.model `m`, config.data `data`, train.compute_dtype `dtype_name`);
  UserError now if a named one cannot run it."""
  call = config_call(m, data, dtype_name, mesh)
  scheme = m.get('context_scheme', 'auto')
  if scheme not in context.SCHEMES:  # Also without the split: a typo should not wait for mesh.context > 1.
    raise UserError(f'model.context_scheme={scheme!r} is not a scheme; choose one of {context.SCHEMES}.')
  if call is not None and mesh is not None and mesh.shape.get(context.context_lib.AXIS, 1) > 1:
    return context_choice(mesh, m.attention, scheme, call.seq_len, call.head_dim)[0]
  return None if call is None else choose(call, m.attention)
