"""The circular pipeline schedule: a scanned layer stack run as S stages over M microbatches, in one SPMD program.

Shape letters: S stages (mesh.pipeline), R repeats (layer groups per stage), P layers per stage group,
M microbatches, b rows per microbatch, plus the model's own (L length, D width).

The stacked layer parameters stay in the unpipelined layout ([R*S*P, ...], layer l at index l), so a checkpoint
is the same at every pipeline size; here they are viewed as [S, R, P, ...]: layer l = (r*S + s)*P + p belongs to
stage s, repeat r. Microbatch m's repeat r runs on stage s at iteration t = r*M + m + s; every iteration runs all S
stages at once (vmap over the stage dimension, split over the 'pipeline' mesh axis) and then rolls the stage
outputs one stage on, which GSPMD lowers to a collective-permute between neighbouring devices. What the last stage
emits waits in a per-microbatch buffer until the first stage takes it for the next repeat (or the stack ends).
R*M + S - 1 iterations run; S - 1 of them are the bubble.
"""

import contextlib
import contextvars
import dataclasses
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
  stack's work and trainer/flops.py would count the discarded part as useful (MFU too high)."""
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


def _stage_major(stacked, schedule: Schedule):
  """[R*S*P, ...] -> [S, R, P, ...] (stage s, repeat r holds layers (r*S + s)*P ... + P - 1)."""
  s, r = schedule.stages, schedule.repeats

  def view(leaf):
    per = leaf.shape[0] // (s * r)
    return jnp.swapaxes(leaf.reshape((r, s, per) + leaf.shape[1:]), 0, 1)
  return jax.tree.map(view, stacked)


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
    mesh: the training mesh (None: no sharding constraints, e.g. a test on one device).
    batch_axes: the mesh axes the batch rows are split over.
    remat_policy: a jax.checkpoint policy for each stage's layer group; None keeps everything.
  """
  if _COUNTING.get():
    return jax.lax.scan(lambda x, p: (layer_fn(p, x, *per_token), None), x_BLD, stacked)[0]
  s, m = schedule.stages, schedule.microbatches
  params = _stage_major(stacked, schedule)

  def group(p_RP, r, x, *tokens):  # One stage: its repeat r's P layers.
    p_P = jax.tree.map(lambda leaf: jax.lax.dynamic_index_in_dim(leaf, r, 0, keepdims=False), p_RP)

    def one(x, p):
      return layer_fn(p, x, *tokens), None
    return jax.lax.scan(one, x, p_P)[0]
  if remat_policy is not None:
    group = jax.checkpoint(group, policy=remat_policy, prevent_cse=False)
  stages_fn = jax.vmap(group, spmd_axis_name=AXIS if mesh is not None else None)

  def pin(x, *rest):  # Stage dimension over the pipeline axis, rows over the batch axes.
    if mesh is None:
      return x
    spec = PartitionSpec(*rest, batch_axes, *(None,) * (x.ndim - len(rest) - 1))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

  # What travels between stages: the activations and the per-token arrays of the same microbatch (rolled along
  # with them, rather than gathered per stage: XLA's SPMD partitioner rejected that gather inside the loop).
  carried = (x_BLD,) + tuple(a for a in per_token if a is not None)
  present = [a is not None for a in per_token]
  buffer = tuple(_split_rows(a, m) for a in carried)  # (M, b, ...) each: every microbatch's latest state.

  def stage_args(state):
    rest = iter(state[1:])
    return (state[0],) + tuple(next(rest) if p else None for p in present)

  def iteration(carry, t):
    buffer, previous = carry
    inputs = []
    for held, prev in zip(buffer, previous):
      shifted = pin(jnp.roll(prev, 1, axis=0), AXIS)  # Stage s takes what stage s-1 gave last iteration.
      first = jax.lax.dynamic_index_in_dim(held, t % m, 0, keepdims=False)
      inputs.append(pin(shifted.at[0].set(first), AXIS))
    repeat = jnp.clip((t - jnp.arange(s)) // m, 0, schedule.repeats - 1)  # Per stage: the repeat it is on.
    x = pin(stages_fn(params, repeat, *stage_args(inputs)), AXIS)
    outputs = (x,) + tuple(inputs[1:])
    last = t - (s - 1)  # The last stage's pass: written back when it is a real one, not the bubble.
    valid = (last >= 0) & (last < schedule.repeats * m)
    slot = jnp.clip(last, 0) % m

    def write(held, out):
      kept = jax.lax.dynamic_index_in_dim(held, slot, 0, keepdims=False)
      return jax.lax.dynamic_update_index_in_dim(held, jnp.where(valid, out[-1], kept), slot, 0)
    return (tuple(map(write, buffer, outputs)), tuple(outputs)), None

  previous = tuple(pin(jnp.zeros((s,) + a.shape[1:], a.dtype), AXIS) for a in buffer)
  (buffer, _), _ = jax.lax.scan(iteration, (buffer, previous), jnp.arange(schedule.iterations))
  return _join_rows(buffer[0])
