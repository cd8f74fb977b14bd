"""Analytic FLOPs per train step, peak FLOP/s per accelerator, and model FLOPs utilization (MFU).

Counted from the config, never from `compiled.cost_analysis()`: XLA counts a
scanned loop's body once, so with scanned layers it under-reports by about
`num_layers` times. Two conventions, both for a full train step (forward and
backward, 3x the forward's matmuls), both model FLOPs (rematerialized
recomputation is not useful work and is not counted):

- 'matmul' (MaxText's): every matmul of the model, 2*m*n*k, with causal
  attention's two (L, L) products halved because half the scores are masked.
- '6n' (nanoGPT's and torchtitan's): 6*N + 12*layers*heads*head_dim*seq_len per
  token, N the parameters other than the embedding table (an untied head counts;
  the lookup is not a matmul; a head tied to the table is not a parameter of its
  own, but its matmul is added to N for the FLOPs). Attention is counted unmasked.

MFU is only reported for accelerators in the peak table below (dense bfloat16
from the vendors' data sheets); any other device, the CPU included, gets none
rather than a made-up one.
"""

import dataclasses

import jax

# Dense bfloat16 peak FLOP/s per chip, by the short names plan mode accepts.
PEAK_FLOPS = {
    'h100': 989e12,  # H100 SXM.
    'h200': 989e12,
    'v4': 275e12,
    'v5e': 197e12,
    'v5p': 459e12,
    'v6e': 918e12,
}
# Lower-cased `device_kind` substrings -> short name; the first match wins (so 'tpu v5 lite' before 'tpu v5').
_DEVICE_KINDS = (
    ('h100 pcie', None), ('h100 nvl', None),  # Lower-clocked H100 variants: peak not in the table.
    ('h100', 'h100'), ('h200', 'h200'), ('tpu v4', 'v4'), ('tpu v5 lite', 'v5e'), ('tpu v5e', 'v5e'),
    ('tpu v5p', 'v5p'), ('tpu v5', 'v5p'), ('tpu v6 lite', 'v6e'), ('tpu v6e', 'v6e'),
)


def accelerator_name(device: jax.Device) -> str | None:
  """The peak table's name for a device ('h100', 'v5p', ...), or None when its peak is unknown."""
  kind = getattr(device, 'device_kind', '').lower()
  return next((name for pattern, name in _DEVICE_KINDS if pattern in kind), None)


def peak_flops(device: jax.Device) -> float | None:
  name = accelerator_name(device)
  return PEAK_FLOPS[name] if name else None


@dataclasses.dataclass(frozen=True)
class StepFlops:
  """Global FLOPs of one train step (all devices together) under each convention."""
  matmul: float
  six_n: float
  non_embedding_params: int


def step_flops(model_config, batch_size: int, seq_len: int) -> StepFlops:
  """FLOPs of one train step of `batch_size` sequences of `seq_len` tokens for a `config.model`."""
  m = model_config
  d, f, v, layers, heads = m.d_model, m.mlp_dim, m.vocab_size, m.num_layers, m.num_heads
  kv_heads = m.num_kv_heads or heads  # Grouped-query attention shrinks only the k/v projections.
  head_dim = d // heads
  tokens = batch_size * seq_len
  # Per token, forward, one block: q/k/v and out projections, the SwiGLU's gate, up and down.
  block_matmul_flops = 2 * ((heads + 2 * kv_heads) * d * head_dim + heads * head_dim * d + 3 * d * f)
  head_flops = 2 * d * v
  # Scores (Q K^T) and the weighted sum (P V), 2*L*H*K each per token, halved for the causal mask.
  causal_attention_flops = 4 * seq_len * heads * head_dim / 2
  matmul = 3 * tokens * (layers * (block_matmul_flops + causal_attention_flops) + head_flops)
  # A tied head is the embedding table itself: not a non-embedding parameter, though its matmul is still done.
  head_params = d * v
  tied = getattr(m, 'tie_embeddings', False)
  non_embedding = (layers * ((2 * heads + 2 * kv_heads) * d * head_dim + 3 * d * f + 2 * d) + d
                   + (0 if tied else head_params))
  six_n = tokens * (6 * (non_embedding + (head_params if tied else 0)) + 12 * layers * heads * head_dim * seq_len)
  return StepFlops(matmul=float(matmul), six_n=float(six_n), non_embedding_params=non_embedding)


@dataclasses.dataclass(frozen=True)
class Throughput:
  """Turns a measured step time into TFLOP/s per device and MFU (when the device's peak is known)."""
  flops: StepFlops
  num_devices: int
  peak_flops_per_device: float | None

  @classmethod
  def for_run(cls, config, devices) -> 'Throughput | None':
    """The run's throughput counter; None for models other than the built-in Llama, whose FLOPs it cannot count."""
    if config.model.name != 'llama':
      return None
    devices = list(devices)
    return cls(step_flops(config.model, config.train.batch_size, config.data.seq_len), len(devices),
               peak_flops(devices[0]))

  def metrics(self, step_time_s: float) -> dict[str, float]:
    """'tflops_per_device' (matmul convention), and 'mfu' / 'mfu_6n' under each convention if the peak is known."""
    per_device_s = 1.0 / (step_time_s * self.num_devices)
    out = {'tflops_per_device': self.flops.matmul * per_device_s / 1e12}
    if self.peak_flops_per_device:
      out['mfu'] = self.flops.matmul * per_device_s / self.peak_flops_per_device
      out['mfu_6n'] = self.flops.six_n * per_device_s / self.peak_flops_per_device
    return out
