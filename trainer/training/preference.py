"""Direct preference optimization (`train.objective='dpo'`): the loss of Rafailov et al. 2023 on pairs of answers,
from log-probabilities (the objective that calls it: objectives.PreferenceOptimization).

A batch row holds one pair, or with data.packing several (trainer/data/pair_rows.py):
pair k's prompt and chosen answer as segment 2k + 1, its prompt and rejected
answer as segment 2k + 2, padding as segment 0, with the loss mask on the
answers' tokens. The model attends within each segment (the packed call), so
no answer sees another.

Per row, log p(answer | prompt) is the sum over the answer's masked tokens of
the token log-probabilities, for the policy (trained) and for the reference (the
starting weights, frozen: `TrainState.reference_params`). With
  h = beta x ((policy_chosen - reference_chosen) - (policy_rejected - reference_rejected))
the loss is (1 - s) x -log sigmoid(h) + s x -log sigmoid(-h) for label smoothing s
(cDPO), as TRL's 'sigmoid' loss, averaged over the pairs. The metrics carry TRL's
names: rewards/chosen = beta x (policy_chosen - reference_chosen), rewards/rejected
likewise, rewards/margins their difference, rewards/accuracies the share of pairs
whose chosen reward is the larger, logps/chosen and logps/rejected the policy's.
"""

import jax
import jax.numpy as jnp
import optax

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
KEYS = ('inputs', 'targets', 'segment_ids', 'positions', 'loss_mask')  # A pair row's (trainer/data/pair_rows.py).


def answer_logps(logits_BLV: jax.Array, batch: Batch, pairs: int) -> tuple[jax.Array, jax.Array]:
  """(chosen, rejected) log-probabilities (B, P) of the answers of each row's (up to) `pairs` pairs: sums over their
  masked target tokens; pair k's answers are segments 2k + 1 and 2k + 2 (0 where a row holds fewer pairs)."""
  token_logp_BL = -optax.softmax_cross_entropy_with_integer_labels(logits_BLV.astype(jnp.float32), batch['targets'])
  trained_BL = token_logp_BL * (batch['loss_mask'] != 0)
  in_segment_BLS = batch['segment_ids'][..., None] == jnp.arange(1, 2 * pairs + 1)
  sums_BS = jnp.einsum('bl,bls->bs', trained_BL, in_segment_BLS.astype(jnp.float32))
  return sums_BS[:, 0::2], sums_BS[:, 1::2]


def pair_count_BP(batch: Batch, pairs: int) -> jax.Array:
  """1.0 for each pair a row holds, 0.0 for the slots it leaves empty: (B, P)."""
  return (jnp.max(batch['segment_ids'], axis=-1, keepdims=True) >= 2 * jnp.arange(1, pairs + 1)).astype(jnp.float32)


def dpo_loss(policy: tuple[jax.Array, jax.Array], reference: tuple[jax.Array, jax.Array], held_BP: jax.Array,
             beta: float, label_smoothing: float) -> tuple[jax.Array, Metrics]:
  """The DPO loss, a mean over the pairs `held_BP` marks, and its metrics, from the (chosen, rejected)
  log-probabilities (B, P) of both models."""
  count = jnp.maximum(jnp.sum(held_BP), 1.0)
  mean = lambda x: jnp.sum(x * held_BP) / count
  reward_chosen = beta * (policy[0] - reference[0])
  reward_rejected = beta * (policy[1] - reference[1])
  h = reward_chosen - reward_rejected
  per_pair = -(1 - label_smoothing) * jax.nn.log_sigmoid(h) - label_smoothing * jax.nn.log_sigmoid(-h)
  loss = mean(per_pair)
  return loss, {'loss': loss, 'rewards/chosen': mean(reward_chosen), 'rewards/rejected': mean(reward_rejected),
                'rewards/margins': mean(h), 'rewards/accuracies': mean((h > 0).astype(jnp.float32)),
                'logps/chosen': mean(policy[0]), 'logps/rejected': mean(policy[1])}
