"""The experts' local math, on the tokens one device holds: routing, dropless grouped matmuls, capacity buffers.

trainer/models/moe.py's layer runs it on one device (or under GSPMD); trainer/models/expert_parallel.py runs it on
each device's share after the all-to-all. Shape letters as in moe.py: T tokens, D d_model, E experts, K experts
per token, F expert hidden width, A = T*K assignments, C capacity.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from trainer.models import grouped_matmul, row_permute


def capacity_of(factor: float, num_tokens: int, experts_per_token: int, num_experts: int) -> int:
  """Assignments one expert takes in capacity mode: ceil(factor * T * K / E)."""
  return max(1, math.ceil(factor * num_tokens * experts_per_token / num_experts))


def route(x_TD, router_DE, k: int):
  """(logits (T, E), top-k weights (T, K) renormalized, top-k experts (T, K)), all in float32."""
  logits_TE = jnp.dot(x_TD.astype(jnp.float32), router_DE.astype(jnp.float32))
  probs_TE = jax.nn.softmax(logits_TE, axis=-1)
  weights_TK, experts_TK = jax.lax.top_k(probs_TE, k)
  return logits_TE, weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True), experts_TK


def group_sizes(experts_A, num_experts: int):
  """(E,) int32: assignments per expert, by a one-hot sum (bincount would scatter-add)."""
  return jnp.sum(jax.nn.one_hot(experts_A, num_experts, dtype=jnp.int32), axis=0)


def swiglu_ragged(x_AD, gate_EDF, up_EDF, down_EFD, group_sizes_E, kernel: str = 'ragged_dot'):
  D, F = gate_EDF.shape[1:]
  if kernel == 'triton' and grouped_matmul.supports(D, F):
    matmul = grouped_matmul.ragged_dot
  else:  # Widths the Triton kernel cannot tile stay on ragged_dot (the dense-experts guard then says so).
    matmul = jax.lax.ragged_dot
  h_AF = nn.silu(matmul(x_AD, gate_EDF, group_sizes_E)) * matmul(x_AD, up_EDF, group_sizes_E)
  return matmul(h_AF, down_EFD, group_sizes_E)


def dropless(x_TD, experts_TK, weights_TK, gate_EDF, up_EDF, down_EFD, kernel: str = 'ragged_dot'):
  """Every assignment through its expert: sorted by expert, grouped matmuls, unsorted, weighted sum over K."""
  T, K = experts_TK.shape
  E = gate_EDF.shape[0]
  experts_A = experts_TK.reshape(-1)
  order_A = jnp.argsort(experts_A, stable=True)
  inverse_A = row_permute.inverse(order_A)
  group_sizes_E = group_sizes(experts_A, E)
  # Rows move by gathers both ways (trainer/models/row_permute.py): indexing's transpose would scatter-add.
  x_AD = row_permute.sort(row_permute.repeat(x_TD, K), order_A, inverse_A)
  out_AD = swiglu_ragged(x_AD, gate_EDF, up_EDF, down_EFD, group_sizes_E, kernel)
  out_TKD = row_permute.unsort(out_AD, order_A, inverse_A).reshape(T, K, -1)  # Back to (token, choice) order.
  return jnp.einsum('tkd,tk->td', out_TKD, weights_TK.astype(out_TKD.dtype))


def capacity_slots(experts_TK, num_experts: int, capacity: int):
  """(slot of each assignment in its expert's buffer (T, K), kept (T, K) bool): choice-major, then token order."""
  onehot_KTE = jax.nn.one_hot(experts_TK.T, num_experts, dtype=jnp.int32)
  before_KTE = jnp.cumsum(onehot_KTE.reshape(-1, num_experts), axis=0).reshape(onehot_KTE.shape) - onehot_KTE
  slot_TK = jnp.sum(before_KTE * onehot_KTE, axis=-1).T
  return slot_TK, slot_TK < capacity


def with_capacity(x_TD, experts_TK, weights_TK, gate_EDF, up_EDF, down_EFD, capacity: int):
  """(output (T, D), dropped fraction): assignments scattered into (E, C, D) buffers (overflow dropped), batched
  matmuls, gathered back."""
  T, K = experts_TK.shape
  E = gate_EDF.shape[0]
  slot_TK, kept_TK = capacity_slots(experts_TK, E, capacity)
  slot_TK = jnp.where(kept_TK, slot_TK, capacity)  # Out of range: the scatter drops it, the gather fills 0.
  x_TKD = jnp.broadcast_to(x_TD[:, None, :], (T, K, x_TD.shape[-1]))
  buffer_ECD = jnp.zeros((E, capacity, x_TD.shape[-1]), x_TD.dtype).at[experts_TK, slot_TK].set(x_TKD, mode='drop')
  h_ECF = nn.silu(jnp.einsum('ecd,edf->ecf', buffer_ECD, gate_EDF)) * jnp.einsum('ecd,edf->ecf', buffer_ECD, up_EDF)
  out_ECD = jnp.einsum('ecf,efd->ecd', h_ECF, down_EFD)
  out_TKD = out_ECD.at[experts_TK, slot_TK].get(mode='fill', fill_value=0)
  out_TD = jnp.einsum('tkd,tk->td', out_TKD, weights_TK.astype(out_TKD.dtype))
  return out_TD, 1.0 - jnp.mean(kept_TK.astype(jnp.float32))
