"""The dropless token exchange over the expert axis by ragged all-to-all: each device sends each peer only the rows
routed to it.

Shape letters as in moe.py; N devices on the axis, R = N*A rows (the receive buffer). The padded exchange
(expert_parallel.py) sends every peer a buffer with room for all A assignments, N times the rows routed;
`jax.lax.ragged_all_to_all` sends each peer its rows alone, at offsets agreed beforehand from the per-expert counts
(one all-gather of N x E integers). The receive buffer keeps the worst case's static size (every assignment of every
device routed here), so nothing drops; its rows past those received belong to no expert group, and the Triton grouped
matmul (grouped_matmul.py) skips their tiles, so a device multiplies the rows it received. The compiled grid still
spans the whole buffer, so model.expert_buffer_factor sizes it for the balanced load times the factor instead
(MaxText's ragged_buffer_factor): every device clips its send sizes, from the same gathered counts, so that each
receiver's rows fit, and the assignments past them drop.

XLA:CPU has no ragged-all-to-all (jax 0.10.2); compiled for an H100 it lowers, gradient included. `emulated` is the
same exchange built from the padded `all_to_all`: what a CPU runs when asked for 'ragged', and how the tests check
the offsets on 8 fake CPU devices.
"""

import math

import jax
import jax.numpy as jnp

from trainer.models import expert_math, row_permute


def _exclusive_cumsum(x, axis=0):
  return jnp.cumsum(x, axis=axis) - x


def emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
  """jax.lax.ragged_all_to_all's result from a padded all_to_all: chunk j (send_sizes[j] rows from input_offsets[j])
  lands in peer j's output at output_offsets[j]."""
  rows, n = operand.shape[0], send_sizes.shape[0]
  place = jnp.arange(rows)
  take_NR = input_offsets[:, None] + place[None, :]  # Row i of chunk j; beyond send_sizes[j] it is masked off.
  valid_NR = place[None, :] < send_sizes[:, None]
  chunks_NRD = jnp.where(valid_NR[..., None], operand[jnp.minimum(take_NR, rows - 1)], 0)
  got_NRD = jax.lax.all_to_all(chunks_NRD, axis_name, 0, 0)
  got_offsets_N = jax.lax.all_to_all(output_offsets.reshape(n, 1), axis_name, 0, 0).reshape(n)
  dest_NR = jnp.where(place[None, :] < recv_sizes[:, None], got_offsets_N[:, None] + place[None, :], output.shape[0])
  return output.at[dest_NR.reshape(-1)].set(got_NRD.reshape(-1, operand.shape[-1]), mode='drop')


def buffer_rows(factor: float | None, assignments: int, num_devices: int) -> int:
  """A device's receive buffer: N*A rows (every device's assignments landing here: nothing drops), or with
  model.expert_buffer_factor ceil(factor * A), the balanced load times the factor."""
  return num_devices * assignments if factor is None else math.ceil(factor * assignments)


def _fitting(rows_NN, counts_NNe, capacity: int):
  """(rows source -> target that fit, per local expert): each target takes its sources in order, each source's rows
  in the order sent (by local expert, then token), up to `capacity` rows; the rest drop."""
  before_NN = _exclusive_cumsum(rows_NN, axis=0)  # A target's rows from earlier sources.
  kept_NN = jnp.clip(capacity - before_NN, 0, rows_NN)
  kept_NNe = jnp.clip(kept_NN[..., None] - _exclusive_cumsum(counts_NNe, axis=-1), 0, counts_NNe)
  return kept_NN, kept_NNe


def dropless(x_TD, experts_TK, weights_TK, gate_EDF, up_EDF, down_EFD, kernel: str, axis: str, emulate: bool,
             buffer_factor: float | None = None):
  """((T, D), dropped fraction of this device's assignments): every assignment through its expert on the device
  holding it, rows exchanged by ragged all-to-all (`emulate`: by `emulated`). `buffer_factor` (None: room for all)
  sizes the receive buffer (`buffer_rows`); an assignment past it drops (`_fitting`) and contributes zero."""
  T, K = experts_TK.shape
  N, local = jax.lax.axis_size(axis), gate_EDF.shape[0]
  me = jax.lax.axis_index(axis)
  exchange = emulated if emulate else jax.lax.ragged_all_to_all
  experts_A = experts_TK.reshape(-1)
  order_A = jnp.argsort(experts_A, stable=True)  # By expert, so by device (device j holds experts j*local...).
  inverse_A = row_permute.inverse(order_A)  # Rows move by gathers both ways (trainer/models/row_permute.py).
  counts_NE = jax.lax.all_gather(expert_math.group_sizes(experts_A, N * local), axis)  # [source, e]
  counts_NNe = counts_NE.reshape(N, N, local)  # [source, target, target's local expert]
  routed_NN = jnp.sum(counts_NNe, axis=-1)  # Rows source -> target.
  R = buffer_rows(buffer_factor, T * K, N)
  rows_NN, kept_NNe = _fitting(routed_NN, counts_NNe, R)
  # Chunks start where the sort put them (all routed rows); only their first rows_NN[me] travel.
  send_offsets_N = _exclusive_cumsum(routed_NN[me])
  send_N, recv_N = rows_NN[me], rows_NN[:, me]
  # In target j's buffer the rows of sources before me come first; mine follow, as my own receive offsets say.
  into_peer_N = _exclusive_cumsum(rows_NN, axis=0)[me]
  recv_offsets_N = _exclusive_cumsum(recv_N)
  sorted_AD = row_permute.sort(row_permute.repeat(x_TD, K), order_A, inverse_A)
  got_RD = exchange(sorted_AD, jnp.zeros((R, x_TD.shape[-1]), x_TD.dtype), send_offsets_N, send_N, into_peer_N, recv_N,
                    axis_name=axis)
  # Each source's rows arrive sorted by local expert: segment (source, expert) of kept_NNe[:, me] in that order.
  ends = jnp.cumsum(kept_NNe[:, me].reshape(-1))
  segment_R = jnp.searchsorted(ends, jnp.arange(R), side='right')
  ids_R = jnp.where(segment_R < N * local, segment_R % local, local)  # Unfilled rows: id `local`, sorted last.
  order_R = jnp.argsort(ids_R, stable=True)
  inverse_R = row_permute.inverse(order_R)
  group_sizes_e = jnp.sum(kept_NNe[:, me], axis=0)
  out_RD = expert_math.swiglu_ragged(row_permute.sort(got_RD, order_R, inverse_R), gate_EDF, up_EDF, down_EFD,
                                     group_sizes_e, kernel)
  out_RD = row_permute.unsort(jnp.where((ids_R[order_R] < local)[:, None], out_RD, 0), order_R, inverse_R)
  # The results home: the reverse exchange, each chunk back where its rows came from (dropped rows stay zero).
  back_AD = exchange(out_RD, jnp.zeros((T * K, x_TD.shape[-1]), out_RD.dtype), recv_offsets_N, recv_N,
                     _exclusive_cumsum(routed_NN, axis=1)[:, me], send_N, axis_name=axis)
  out_TKD = row_permute.unsort(back_AD, order_A, inverse_A).reshape(T, K, -1)
  dropped = 1.0 - jnp.sum(send_N) / (T * K)
  return jnp.einsum('tkd,tk->td', out_TKD, weights_TK.astype(out_TKD.dtype)), dropped.astype(jnp.float32)
