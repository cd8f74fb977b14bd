"""Moving the experts' rows by gathers alone, forward and backward: sorting assignments by expert, padding groups to
tiles, and back.

Why: jnp indexing `x[idx]` is a gather whose autodiff transpose is a scatter-add, and `zeros.at[idx].set(x)` a scatter
(its transpose a gather). On GPUs a scatter-add runs with atomics: the H200 profile of moe_1b b8 dropless put about
39 ms of the grouped matmuls' 104 ms a step in XLA scatter fusions around the kernels (docs/moe.md "Where the time
goes"). Every row movement of the dropless experts is injective (a permutation, or a layout that puts each row in at
most one place), so its exact transpose is a gather too: `take` is a gather whose custom VJP gathers the cotangent
by the inverse map. A token's K copies (`repeat`) are a broadcast, whose transpose is a sum over K. MaxText's moe.py
does the same for its sort (`_sort_activations`).

Shape letters: N rows in, M rows out, D the row width, T tokens, K copies of each.
"""

import jax
import jax.numpy as jnp


def vary_alike(*arrays):
  """The arrays varying over the same manual mesh axes (under shard_map, trainer/models/expert_parallel.py): a custom
  VJP must give each cotangent its operand's type; pcast's own transpose then sums over the axes it added."""
  axes = frozenset().union(*(jax.typeof(a).mat.varying for a in arrays))
  return [jax.lax.pcast(a, tuple(sorted(axes - jax.typeof(a).mat.varying)), to='varying') for a in arrays]


def _gather(x_ND, index_M):
  """(M, D): rows of x, zeros where the index is out of range (>= N)."""
  return jnp.take(x_ND, index_M, axis=0, mode='fill', fill_value=0)


@jax.custom_vjp
def _take(x_ND, src_M, dst_N):
  return _gather(x_ND, src_M)


def _take_fwd(x_ND, src_M, dst_N):
  return _gather(x_ND, src_M), (src_M, dst_N)


def _take_bwd(residuals, dy_MD):
  src_M, dst_N = residuals
  # Row n of x went to row dst[n] alone (or nowhere): its cotangent is that row's, read by a gather.
  return _gather(dy_MD, dst_N), None, None


_take.defvjp(_take_fwd, _take_bwd)


def take(x_ND, src_M, dst_N):
  """(M, D): row m is x[src[m]], zeros where src[m] >= N; each row of x goes to at most one place.

  `dst_N` is the inverse map: dst[n] is the m with src[m] = n, or >= M where none, so the gradient is dy[dst] (a
  gather, where jnp's own indexing would scatter-add). Out-of-range indices must be large, not negative."""
  return _take(*vary_alike(x_ND, src_M, dst_N))


def inverse(order_N):
  """The inverse of the permutation `order_N` (z[order][inverse] == z), by a sort: no scatter."""
  return jnp.argsort(order_N).astype(order_N.dtype)


def repeat(x_TD, k: int):
  """(T*K, D): each row K times in a row, as `jnp.repeat(x, k, axis=0)`, by a broadcast whose transpose sums over K."""
  T, D = x_TD.shape
  return jnp.broadcast_to(x_TD[:, None, :], (T, k, D)).reshape(T * k, D)


def sort(x_ND, order_N, inverse_N):
  """x[order]: the rows permuted (`inverse_N` = inverse(order_N))."""
  return take(x_ND, order_N, inverse_N)


def unsort(y_ND, order_N, inverse_N):
  """The z with z[order] = y: `sort` undone, y[inverse]."""
  return take(y_ND, inverse_N, order_N)
