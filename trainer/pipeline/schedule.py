"""The circular pipeline schedule: a scanned layer stack run as S stages over M microbatches, in one SPMD program.

Shape letters: S stages (mesh.pipeline), R repeats (layer groups per stage), P layers per stage group,
M microbatches, b rows per microbatch, plus the model's own (L length, D width).

The stacked layer parameters stay in the unpipelined layout ([R*S*P, ...], layer l at index l), so a checkpoint
is the same at every pipeline size; here they are viewed as [R, S, P, ...]: layer l = (r*S + s)*P + p belongs to
stage s, repeat r. Microbatch m's repeat r runs on stage s at iteration t = r*M + m + s.

The loop runs under jax.shard_map with only the 'pipeline' axis manual (the batch, fsdp and tensor splits inside a
stage stay GSPMD's): each device runs its own stage's layer group on the microbatch it holds, then hands its
output to the next stage with a ppermute, a point-to-point collective-permute (between TPU slices, a one-to-one
DCN send/recv). Under GSPMD alone (a vmap over the stage dimension and a jnp.roll, issue 43's first version) the
CPU compile permuted too, but the libtpu compile all-gathered the microbatch buffer over fsdp instead
(tests/test_plan.py's two-slice test). Stage 0 keeps a per-microbatch buffer: the inputs (every stage receives the
batch; only stage 0 reads it), then what the last stage hands round the ring after each repeat, waiting M - S
iterations for stage 0. After the loop stage 0's buffer holds the stack's output, summed over the stages (psum) so
every stage returns it. R*M + S - 1 iterations run; S - 1 of them are the bubble.
"""

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = 'pipeline'
_COUNTING = contextvars.ContextVar('pipeline_counting', default=False)


@contextlib.contextmanager
def unpipelined_for_counting():
  """Within, `run` runs the layers in one plain scan: the same math without the bubble. Every iteration runs all S
  stages, the bubble's on zeros that are discarded, so a jaxpr of the schedule holds (R*M + S - 1)/(R*M) of the
  stack's work and trainer/observe/flops.py would count the discarded part as useful (MFU too high)."""
  token = _COUNTING.set(True)
  try:
    yield
  finally:
    _COUNTING.reset(token)


@dataclasses.dataclass(frozen=True)
class Schedule:
  stages: int
  microbatches: int
  repeats: int = 1

  @property
  def iterations(self) -> int:
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble_fraction(self) -> float:
    return (self.stages - 1) / self.iterations


def _split_rows(x, m: int):
  """(B, ...) -> (M, B/M, ...), microbatch j holding rows j, j+M, ...: each device's rows stay on it."""
  return jnp.swapaxes(x.reshape((x.shape[0] // m, m) + x.shape[1:]), 0, 1)


def _join_rows(x):
  return jnp.swapaxes(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def run(layer_fn: Callable, stacked, x_BLD, per_token: tuple, schedule: Schedule, mesh: Mesh | None,
        batch_axes=None, remat_policy=None):
  """The stack's output for `x_BLD`, as `for l: x = layer_fn(stacked[l], x, *per_token)` gives it.

  Args:
    layer_fn: one layer, `(params, x_bLD, *per_token_bL) -> x_bLD`.
    stacked: the layers' parameters, every leaf stacked on a leading axis of R*S*P layers.
    per_token: arrays (B, L) every layer also reads (positions, segment ids), or None.
    mesh: the training mesh (None: the stages run as a vmap on one device, e.g. a test).
    batch_axes: the mesh axes the batch rows are split over (GSPMD keeps them; only 'pipeline' is manual here).
    remat_policy: a jax.checkpoint policy for each layer of a stage; None keeps everything.
  """
  if _COUNTING.get():
    return jax.lax.scan(lambda x, p: (layer_fn(p, x, *per_token), None), x_BLD, stacked)[0]
  s, r = schedule.stages, schedule.repeats
  # [R*S*P, ...] -> [R, S, P, ...]: the stage dimension is the one split over 'pipeline' (R = 1: the contiguous
  # 'layers' split as stored, no movement; R > 1: GSPMD regroups the layers to this circular view each step).
  params = jax.tree.map(lambda leaf: leaf.reshape((r, s, leaf.shape[0] // (r * s)) + leaf.shape[1:]), stacked)
  present = tuple(a is not None for a in per_token)
  tokens = tuple(a for a in per_token if a is not None)
  body = functools.partial(_stage_program, layer_fn, schedule, present, remat_policy,
                           batch_axes if mesh is not None else None)
  if mesh is None:  # Same program, the stage axis a vmap axis; every stage returns the (psummed) same output.
    per_stage = jax.tree.map(lambda leaf: leaf[:, :, None], params)  # Each stage sees [R, 1, P, ...], as below.
    out = jax.vmap(body, in_axes=(1, None, None), axis_name=AXIS, axis_size=s)(per_stage, x_BLD, tokens)
    return out[0]
  # Only 'pipeline' is manual: every device runs its own stage, and the activations go to the next stage by
  # ppermute (a collective-permute); the batch, fsdp and tensor splits inside a stage stay GSPMD's.
  # check_vma=False: with it on, a stage's splash attention (its own shard_map, unchecked: the Pallas kernel's
  # outputs carry no varying-axis types) failed to differentiate for a TPU ("Expected cotangent type
  # bfloat16[...]{V:pipeline}"); tests/test_pipeline.py's gradients are the same either way (measured).
  stage_spec = jax.tree.map(lambda _: PartitionSpec(None, AXIS), params)
  sharded = jax.shard_map(body, mesh=mesh, in_specs=(stage_spec, PartitionSpec(), PartitionSpec()),
                          out_specs=PartitionSpec(), axis_names={AXIS}, check_vma=False)
  return sharded(params, x_BLD, tokens)


def _stage_program(layer_fn, schedule: Schedule, present, remat_policy, batch_axes, params, x_BLD, tokens):
  """One stage's part of the schedule (under shard_map or vmap over AXIS): its params [R, 1, P, ...] (the stage's
  layer groups), the whole batch's inputs (every stage holds them; only stage 0 reads them). Returns the stack's
  output, the same on every stage (a psum of stage 0's buffer)."""

  def pin(x, rows_dim=0):  # Rows over the batch axes within the stage (GSPMD's part), as outside the pipeline.
    if batch_axes is None:
      return x
    spec = PartitionSpec(*(None,) * rows_dim, batch_axes)
    return jax.lax.with_sharding_constraint(x, NamedSharding(jax.sharding.get_abstract_mesh(), spec))
  s, m, repeats = schedule.stages, schedule.microbatches, schedule.repeats
  stage = jax.lax.axis_index(AXIS)
  params = jax.tree.map(lambda leaf: leaf[:, 0], params)  # [R, P, ...]

  # The policy applies to each layer, as the unpipelined scan applies it: checkpointing the stage's whole group
  # instead kept every layer's activations of the group at once while its backward recomputed it (an 8B Llama's
  # stage of 16 layers planned 28.1 GiB of temporaries per chip for a TPU, against 19.1 unpipelined; BENCHMARKS.md).
  one_layer = layer_fn if remat_policy is None else jax.checkpoint(layer_fn, policy=remat_policy, prevent_cse=False)

  def group(p_RP, rep, x, *toks):  # This stage's repeat `rep`: its P layers.
    p_P = jax.tree.map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, rep, 0, keepdims=False), p_RP)
    return jax.lax.scan(lambda y, p: (one_layer(p, y, *toks), None), x, p_P)[0]

  def layer_tokens(m_index):  # The per-token arrays of microbatch m_index (read locally, nothing travels).
    rest = iter(jax.lax.dynamic_index_in_dim(a, m_index, 0, keepdims=False) for a in token_buffers)
    return tuple(next(rest) if p else None for p in present)

  token_buffers = tuple(_split_rows(a, m) for a in tokens)
  # buffer[j]: microbatch j's latest state on stage 0: its input, then what the last stage gave it after each
  # repeat (it waits there M - S iterations for stage 0). Only stage 0's buffer is read.
  buffer = pin(_split_rows(x_BLD, m), 1)
  ring = [(i, (i + 1) % s) for i in range(s)]

  def receive(buffer, incoming, t):
    """Stage 0 files what the last stage passed on at iteration t - 1 (microbatch (t - S) % M), when real."""
    slot = jnp.clip(t - s, 0) % m
    kept = jax.lax.dynamic_index_in_dim(buffer, slot, 0, keepdims=False)
    keep = (stage == 0) & (t >= s)
    return pin(jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(keep, incoming, kept), slot, 0), 1)

  def iteration(carry, t):
    buffer, incoming = carry
    buffer = receive(buffer, incoming, t)
    first = jax.lax.dynamic_index_in_dim(buffer, t % m, 0, keepdims=False)
    x = pin(jnp.where(stage == 0, first, incoming))
    rep = jnp.clip((t - stage) // m, 0, repeats - 1)
    y = group(params, rep, x, *layer_tokens((t - stage) % m))
    return (buffer, pin(jax.lax.ppermute(pin(y), AXIS, ring))), None

  incoming = pin(jnp.zeros(buffer.shape[1:], buffer.dtype))
  (buffer, incoming), _ = jax.lax.scan(iteration, (buffer, incoming), jnp.arange(schedule.iterations))
  buffer = receive(buffer, incoming, jnp.asarray(schedule.iterations))  # The last microbatch's last repeat.
  return _join_rows(jax.lax.psum(jnp.where(stage == 0, buffer, jnp.zeros_like(buffer)), AXIS))

