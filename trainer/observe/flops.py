"""FLOPs per train step, peak FLOP/s per accelerator, and model FLOPs utilization (MFU).

Never from `compiled.cost_analysis()`: XLA counts a scanned loop's body once,
so with scanned layers it under-reports by about `num_layers` times.

Any model: `traced_step_flops` traces the step's forward and backward
(trainer/training/step.py's `grads_and_metrics`, gradient accumulation included) on the
global batch's shapes, without a mesh, and trainer/observe/traced_flops.py counts the
matmuls and convolutions of that program: scan bodies times their length,
rematerialized recomputation excluded, the optimizer update left out. It is
the same math under every strategy. A run counts it once, after the compile, and
where it can from the compiled step's own jaxpr (the same equations under 'jit'
with no pipeline, expert or context axis and no opaque kernel), so the model is
not traced a second time for it (a tiny launch: 3.93 -> 3.59 s of CPU, medians
of 8 alternated rounds). Attention runs the XLA kernel for the count
(trainer/attention's `xla_for_counting`): cuDNN's and splash's kernels are
opaque to a jaxpr. So causal attention counts its (L, L) products in full,
masked half included, as the 6N convention does. This count is the logged
'tflops_per_device' and 'mfu'.

The built-in Llama also has two analytic counts (`step_flops`), both for a full
train step (forward and backward, 3x the forward's matmuls), both model FLOPs:

- 'matmul' (MaxText's): every matmul of the model, 2*m*n*k, with causal
  attention's two (L, L) products halved because half the scores are masked.
  With attention unhalved ('matmul_unmasked') it is what the traced count finds
  (tests/test_flops.py).
- '6n' (nanoGPT's and torchtitan's): 6*N + 12*layers*heads*head_dim*seq_len per
  token, N the parameters other than the embedding table (an untied head counts;
  the lookup is not a matmul; a head tied to the table is not a parameter of its
  own, but its matmul is added to N for the FLOPs). Attention is counted unmasked.
  Logged as 'mfu_6n' for the Llama.

An MoE Llama (model.num_experts > 0) counts only what a token runs, in both: its
experts_per_token experts (not all of them), the router and a shared expert;
N of 6N is the active parameters (trainer/models/moe.py `inactive_params`).

MFU is only reported for accelerators in the peak table below (dense bfloat16
from the vendors' data sheets); any other device, the CPU included, gets none
rather than a made-up one. With train.quantization, 'mfu' stays against the
bf16 peak and 'mfu_fp8' / 'mfu_int8' is against the peak each dot runs at: the
8-bit dots (Count.quantized) at the chip's 8-bit peak, the rest at bf16's.
"""

import dataclasses
import time

import jax
from absl import logging

from parallel import context
from trainer import attention, pipeline
from trainer.models import expert_parallel, moe
from trainer.observe import traced_flops
from trainer.training import step as step_lib

# Dense bfloat16 peak FLOP/s per chip, by the short names plan mode accepts.
PEAK_FLOPS = {
    'h100': 989e12,  # H100 SXM.
    'h200': 989e12,
    'v4': 275e12,
    'v5e': 197e12,
    'v5p': 459e12,
    'v6e': 918e12,
}
# The peak of train.quantization's 8-bit matmuls as a multiple of the bf16 peak, on the chips that have them (data
# sheets: H100/H200 fp8 1,979 TFLOP/s dense; TPU v5e/v5p/v6e int8 twice bf16); others are refused before a run
# (trainer/models/quantization.py).
QUANTIZED_PEAK_FACTOR = {'fp8': {'h100': 2, 'h200': 2}, 'int8': {'v5e': 2, 'v5p': 2, 'v6e': 2}}
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


def quantized_peak_flops(mode: str | None, name: str | None) -> float | None:
  """The peak FLOP/s of chip `name`'s `mode` ('fp8', 'int8') matmuls; None where unknown or mode is None."""
  factor = QUANTIZED_PEAK_FACTOR.get(mode or '', {}).get(name or '')
  return factor * PEAK_FLOPS[name] if factor else None


def ideal_seconds(counted: traced_flops.Count, peak: float, mode: str | None, name: str | None) -> float:
  """Seconds `counted` takes on one chip at its peak: the 8-bit dots at the quantized peak, the rest at `peak`."""
  fast = quantized_peak_flops(mode, name)
  quantized = counted.quantized if fast else 0.0
  return (counted.flops - quantized) / peak + (quantized / fast if fast else 0.0)


@dataclasses.dataclass(frozen=True)
class StepFlops:
  """Global FLOPs of one train step (all devices together) under each convention."""
  matmul: float
  six_n: float
  non_embedding_params: int
  matmul_unmasked: float = 0.0  # 'matmul' with causal attention in full: what the traced count finds.
  six_n_params: int = 0  # The N of 6N: the active non-embedding parameters, plus a tied output head (its matmul is done).
  inactive_params: int = 0  # MoE: the non-embedding parameters of the experts a token is not routed to.


def step_flops(model_config, batch_size: int, seq_len: int) -> StepFlops:
  """FLOPs of one train step of `batch_size` sequences of `seq_len` tokens for a `config.model`."""
  m = model_config
  d, f, v, layers, heads = m.d_model, m.mlp_dim, m.vocab_size, m.num_layers, m.num_heads
  kv_heads = m.num_kv_heads or heads  # Grouped-query attention shrinks only the k/v projections.
  head_dim = getattr(m, 'head_dim', 0) or d // heads
  tokens = batch_size * seq_len
  # Per token, forward, one block: q/k/v and out projections, the SwiGLU's gate, up and down.
  block_matmul_flops = 2 * ((heads + 2 * kv_heads) * d * head_dim + heads * head_dim * d + 3 * d * f)
  moe_layers = moe.num_moe_layers(m)
  if moe_layers:  # Each MoE block: the router, experts_per_token experts and a shared expert, not the dense MLP.
    fe = m.expert_mlp_dim or f
    moe_mlp = 2 * (d * m.num_experts + (m.experts_per_token + int(bool(m.shared_expert))) * 3 * d * fe)
    block_matmul_flops += moe_layers / layers * (moe_mlp - 2 * 3 * d * f)
  head_flops = 2 * d * v
  # Scores (Q K^T) and the weighted sum (P V), 2*L*H*K each per token, halved for the causal mask.
  causal_attention_flops = 4 * seq_len * heads * head_dim / 2
  matmul = 3 * tokens * (layers * (block_matmul_flops + causal_attention_flops) + head_flops)
  unmasked = matmul + 3 * tokens * layers * causal_attention_flops
  # A tied head is the embedding table itself: not a non-embedding parameter, though its matmul is still done.
  head_params = d * v
  tied = getattr(m, 'tie_embeddings', False)
  non_embedding = (layers * ((2 * heads + 2 * kv_heads) * d * head_dim + 3 * d * f + 2 * d) + d
                   + (0 if tied else head_params))
  if moe_layers:  # All experts, the router and a shared expert in place of the dense MLP; N of 6N counts the active.
    non_embedding += moe_layers * (m.num_experts * 3 * d * fe + d * m.num_experts
                                   + int(bool(m.shared_expert)) * 3 * d * fe - 3 * d * f)
  active = non_embedding - moe.inactive_params(m)
  n = active + (head_params if tied else 0)
  six_n = tokens * (6 * n + 12 * layers * heads * head_dim * seq_len)
  return StepFlops(matmul=float(matmul), six_n=float(six_n), non_embedding_params=non_embedding,
                   matmul_unmasked=float(unmasked), six_n_params=n, inactive_params=non_embedding - active)


def traced_step_flops(task, params, batch_shapes, options=step_lib.StepOptions()) -> traced_flops.Count:
  """FLOPs of one train step's forward and backward over the global batch, counted from its traced program.

  Args:
    task: what trainer/training/step.py trains (`loss`, `weight`); params and batch_shapes: pytrees of
      `jax.ShapeDtypeStruct` (a Job's `abstract.params`, `task.batch_shapes()`); options: the accumulation.
  """
  def grads(p, batch):
    return step_lib.grads_and_metrics(p, batch, task, options)

  with attention.xla_for_counting(), expert_parallel.one_device_for_counting(), pipeline.unpipelined_for_counting():
    return traced_flops.count(grads, params, batch_shapes)


def job_step_flops(job, log: bool = True) -> traced_flops.Count | None:
  """A Job's traced step FLOPs, logged with the time the count took; None (and a warning) if it does not trace.

  Counted once per Job: from the compiled step's own jaxpr where that holds the same program (`_from_the_step`),
  else by traced_step_flops. `log=False` for callers that report the count themselves (plan mode, which counts every
  candidate it compiles).
  """
  config = job.config
  start = time.perf_counter()
  if 'flops' not in job.traced:
    try:
      job.traced['flops'] = _from_the_step(job) or traced_step_flops(
          job.task, job.abstract.params, job.task.batch_shapes(), step_lib.StepOptions.from_config(config.train))
    except Exception as e:  # pylint: disable=broad-except  (e.g. a loss using collectives only its strategy binds)
      logging.warning('FLOPs not counted, so no TFLOP/s or MFU: the train step of model.name=%r does not trace '
                      'without a mesh (%s: %s).', config.model.name, type(e).__name__, (str(e).splitlines() or [''])[0])
      job.traced['flops'] = None
  counted = job.traced['flops']
  if not log or counted is None:
    return counted
  logging.info('FLOPs per step: %.4g (matmuls and convolutions of the traced step, counted in %.2fs)',
               counted.flops, time.perf_counter() - start)
  if counted.opaque or counted.unbounded_loops:
    logging.warning('TFLOP/s and MFU undercount: %s.', describe_gaps(counted))
  return counted


def _from_the_step(job) -> traced_flops.Count | None:
  """The count from the jaxpr compile_train_step kept ('jit' only), when it is the program traced_step_flops would
  trace: the equations under step.GRADS_SCOPE, with no kernel the counting contexts swap. Not with a pipeline, MoE
  layers exchanging tokens or in capacity mode on several devices, or a context axis (their per-device programs are
  what those contexts replace), nor with an opaque kernel (cuDNN's or splash's attention, which the count runs as
  XLA's). A tiny launch's count took 0.19 s of tracing; this walk, 0.003 s. None: trace it.
  """
  jaxpr = job.traced.get('train_step')
  if jaxpr is None:  # Nothing kept: traced_step_flops traces it (before the mesh is read: it may be None there).
    return None
  model, shape = job.config.model, dict(job.mesh.shape)
  # Split MoE layers run the one-device work per device (counted times the devices) except over `expert` (receive
  # buffers) and in capacity mode (each device's capacity rounded up).
  moe_apart = model.get('num_experts', 0) and expert_parallel.splits(job.mesh) and (
      shape.get(expert_parallel.AXIS, 1) > 1 or model.get('expert_capacity_factor'))
  if (pipeline.from_config(job.config.train, job.mesh) is not None or moe_apart
      or shape.get(context.AXIS, 1) > 1):
    return None
  counted = traced_flops.count_jaxpr(jaxpr.jaxpr, scope=step_lib.GRADS_SCOPE)
  return counted if counted.flops and not counted.opaque else None


@dataclasses.dataclass(frozen=True)
class Throughput:
  """Turns a measured step time into TFLOP/s per device and MFU (when the device's peak is known)."""
  step_flops: float  # Global, traced (traced_step_flops).
  num_devices: int
  peak_flops_per_device: float | None
  six_n: float | None = None  # The built-in Llama's analytic 6N count, for 'mfu_6n'.
  quantized: tuple[str, float] | None = None  # (train.quantization, the ideal step seconds at each dot's peak).

  @classmethod
  def for_job(cls, job) -> 'Throughput | None':
    """The run's throughput counter, from the job's traced step; None when that cannot be counted."""
    counted = job_step_flops(job)
    if counted is None or not counted.flops:
      return None
    config, devices = job.config, list(job.mesh.devices.flat)
    six_n = (step_flops(config.model, config.train.batch_size, config.data.seq_len).six_n
             if config.model.name == 'llama' else None)
    mode, chip = config.train.get('quantization'), accelerator_name(devices[0])
    quantized = None
    if quantized_peak_flops(mode, chip):  # Per device: the step's FLOPs split evenly, as in 'mfu'.
      quantized = (mode, ideal_seconds(counted, PEAK_FLOPS[chip], mode, chip) / len(devices))
    return cls(counted.flops, len(devices), peak_flops(devices[0]), six_n, quantized)

  def metrics(self, step_time_s: float) -> dict[str, float]:
    """'tflops_per_device' and, where the peak is known, 'mfu' (traced count) and 'mfu_6n' (the Llama's 6N)."""
    per_device_s = 1.0 / (step_time_s * self.num_devices)
    out = {'tflops_per_device': self.step_flops * per_device_s / 1e12}
    if self.peak_flops_per_device:
      out['mfu'] = self.step_flops * per_device_s / self.peak_flops_per_device
      if self.six_n:
        out['mfu_6n'] = self.six_n * per_device_s / self.peak_flops_per_device
    if self.quantized:  # 'mfu' stays against the bf16 peak, as the anchors; this one against each dot's own peak.
      mode, ideal_s = self.quantized
      out[f'mfu_{mode}'] = ideal_s / step_time_s
    return out


def describe_gaps(counted: traced_flops.Count) -> str:
  """What a traced count leaves out, in words ('' when nothing)."""
  gaps = []
  if counted.opaque:
    gaps.append(f'custom kernels whose FLOPs a jaxpr does not show ({", ".join(counted.opaque)}) count as 0')
  if counted.unbounded_loops:
    gaps.append(f'{counted.unbounded_loops} while loop(s) counted for one iteration (no trip count in the program)')
  return '; '.join(gaps)
