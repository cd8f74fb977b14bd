"""The idle-expert warning: an MoE expert that receives no tokens for many steps in a row is named in the log.

A collapsed router sends every token to a few experts; the others stop learning
and their parameters are dead weight. The MoE layer sows each expert's load
(`*/load_per_expert`, trainer/models/moe.py); this watch reads it from every
step's fetched metrics on the host, counts the steps in a row each expert got
none, and warns once per expert when the count reaches `log.idle_expert_steps`,
again if it recovers and goes idle again.
"""

import numpy as np
from absl import logging

from trainer.models import sown


class IdleExperts:
  def __init__(self, steps: int):
    self._limit = steps  # 0 = off.
    self._idle: dict[str, np.ndarray] = {}  # Per layer: steps in a row each expert had no token.

  def step_done(self, step: int, metrics: dict) -> list[str]:
    """Counts this step's idle experts; returns (and logs) one warning per expert that just reached the limit."""
    if not self._limit:
      return []
    warnings = []
    for key, load in metrics.items():
      if not key.endswith(sown.PER_EXPERT):
        continue
      idle = np.asarray(load) == 0
      count = self._idle.get(key, np.zeros(idle.shape, np.int64))
      count = np.where(idle, count + 1, 0)
      self._idle[key] = count
      layer = key[:-len(sown.PER_EXPERT)].rsplit('/', 1)[0]
      for expert in np.flatnonzero(count == self._limit):
        warnings.append(f'step {step}: MoE layer {layer}: expert {expert} has received no tokens for {self._limit} '
                        f'steps in a row (its router collapsed); raise model.router_aux_loss_weight or set '
                        f'model.router_bias_rate=0.01, or check the '
                        f'load metrics {layer}/load_* in metrics.jsonl.')
    for warning in warnings:
      logging.warning(warning)
    return warnings
