"""Direct preference optimization (`train.objective='dpo'`): the loss of Rafailov et al. 2023 on pairs of answers,
from log-probabilities (the objective that calls it: objectives.PreferenceOptimization).

A batch row holds one pair (trainer/data/pair_rows.py): the prompt and chosen
answer as segment 1, the prompt and rejected answer as segment 2, padding as
segment 0, with the loss mask on the answers' tokens. The model attends within
each segment (the packed call), so the two answers never see each other.

Per row, log p(answer | prompt) is the sum over the answer's masked tokens of
the token log-probabilities, for the policy (trained) and for the reference (the
starting weights, frozen: `TrainState.reference_params`). With
  h = beta x ((policy_chosen - reference_chosen) - (policy_rejected - reference_rejected))
the loss is (1 - s) x -log sigmoid(h) + s x -log sigmoid(-h) for label smoothing s
(cDPO), as TRL's 'sigmoid' loss, averaged over the rows. The metrics carry TRL's
names: rewards/chosen = beta x (policy_chosen - reference_chosen), rewards/rejected
likewise, rewards/margins their difference, rewards/accuracies the share of rows
whose chosen reward is the larger, logps/chosen and logps/rejected the policy's.
"""

import jax
import jax.numpy as jnp
import optax

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
KEYS = ('inputs', 'targets', 'segment_ids', 'positions', 'loss_mask')  # A pair row's (trainer/data/pair_rows.py).
CHOSEN, REJECTED = 1, 2  # A row's segment ids.


def answer_logps(logits_BLV: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
  """(chosen, rejected) log-probabilities (B,) of each row's two answers: sums over their masked target tokens."""
  token_logp_BL = -optax.softmax_cross_entropy_with_integer_labels(logits_BLV.astype(jnp.float32), batch['targets'])
  trained_BL = (batch['loss_mask'] != 0).astype(jnp.float32)

  def of(segment):
    return jnp.sum(token_logp_BL * trained_BL * (batch['segment_ids'] == segment), axis=-1)
  return of(CHOSEN), of(REJECTED)


def dpo_loss(policy: tuple[jax.Array, jax.Array], reference: tuple[jax.Array, jax.Array], beta: float,
             label_smoothing: float) -> tuple[jax.Array, Metrics]:
  """The mean DPO loss over rows and its metrics, from (chosen, rejected) log-probabilities (B,) of both models."""
  reward_chosen = beta * (policy[0] - reference[0])
  reward_rejected = beta * (policy[1] - reference[1])
  h = reward_chosen - reward_rejected
  per_row = -(1 - label_smoothing) * jax.nn.log_sigmoid(h) - label_smoothing * jax.nn.log_sigmoid(-h)
  loss = jnp.mean(per_row)
  return loss, {'loss': loss, 'rewards/chosen': jnp.mean(reward_chosen), 'rewards/rejected': jnp.mean(reward_rejected),
                'rewards/margins': jnp.mean(h), 'rewards/accuracies': jnp.mean((h > 0).astype(jnp.float32)),
                'logps/chosen': jnp.mean(policy[0]), 'logps/rejected': jnp.mean(policy[1])}
