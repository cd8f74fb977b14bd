"""What a model is trained to do (`model.task`): the batch it reads, its loss and metrics, its eval summary.

- 'lm': batches of token rows `inputs`/`targets` (B, L) int32, plus `segment_ids`
  and `positions` when data.packing; next-token cross entropy in float32 over
  non-padding tokens, plus the optional z-loss; eval loss and perplexity.
- train.objective='dpo' on an 'lm': pairs of answers, one a row, and the DPO loss
  against the starting weights (trainer/training/preference.py).
- 'classifier': `images` (B, H, W, C) float32 and `labels` (B,) int32; cross
  entropy and accuracy; eval loss and accuracy.

A loss here is the mean over what `weight(batch)` counts (tokens, or rows), so
gradient accumulation can weight microbatches back into the whole batch's mean.
A model whose class defines `loss(self, batch) -> (loss, metrics)` replaces the
objective's loss with its own (see trainer/training/task.py).
"""

import dataclasses
import math
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax

from trainer import data
from trainer.base.errors import UserError
from trainer.training import preference

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
TASKS = ('lm', 'classifier')


def token_weights(batch: Batch) -> jax.Array:
  """1.0 for tokens that count in the loss, 0.0 for padding (segment id 0 in packed batches) and for targets the
  batch's `loss_mask` leaves out (prompt tokens of fine-tuning data)."""
  weights = jnp.ones(batch['targets'].shape, jnp.float32)
  if 'segment_ids' in batch:
    weights = (batch['segment_ids'] != 0).astype(jnp.float32)
  if 'loss_mask' in batch:
    weights = weights * (batch['loss_mask'] != 0).astype(jnp.float32)
  return weights


def _cross_entropy_sums(logits_BLV, targets_BL, weights_BL, with_z: bool) -> tuple[jax.Array, jax.Array]:
  """Weighted sums over tokens of the cross entropy and (with_z) of logsumexp(logits)^2; float32 logits."""
  ce = jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL) * weights_BL)
  if not with_z:
    return ce, jnp.zeros((), jnp.float32)
  return ce, jnp.sum(jnp.square(jax.nn.logsumexp(logits_BLV, axis=-1)) * weights_BL)


def chunked_cross_entropy(x_BLD, head_DV, targets_BL, weights_BL, chunks: int,
                          with_z: bool) -> tuple[jax.Array, jax.Array]:
  """_cross_entropy_sums of the logits x @ head, made `chunks` slices of positions at a time.

  Each slice's (B, L / chunks, V) logits are made, reduced and dropped inside a checkpointed lax.map step, and
  made again in the backward pass: one more head matmul per token instead of holding the whole float32 logits and their
  gradient (the vocabulary's share of a step's memory; BENCHMARKS "Chunked loss").
  """
  B, L, _ = x_BLD.shape

  def split(a):  # (B, L, ...) -> (chunks, B, L / chunks, ...): the map walks the first axis.
    return jnp.moveaxis(a.reshape(B, chunks, L // chunks, *a.shape[2:]), 1, 0)

  @jax.checkpoint
  def slice_sums(slice_):
    x_BlD, targets_Bl, weights_Bl = slice_
    logits_BlV = jnp.einsum('bld,dv->blv', x_BlD, head_DV).astype(jnp.float32)
    return _cross_entropy_sums(logits_BlV, targets_Bl, weights_Bl, with_z)

  # A map, not a scan with a running sum: a carry started from a constant would not match a shard_map body's
  # device-varying sums.
  ce_C, z_C = jax.lax.map(slice_sums, (split(x_BLD), split(targets_BL), split(weights_BL)))
  return jnp.sum(ce_C), jnp.sum(z_C)


def _per_source(logits_BLV, batch: Batch, weights_BL, names: tuple[str, ...], batch_size: int) -> Metrics:
  """`loss/NAME`: the mean cross entropy of this batch's tokens from each source of a mixture (0 when it gave none),
  and `tokens/NAME`: how many it gave, scaled to the global batch like trained_tokens."""
  ce_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch['targets'])
  metrics = {}
  for k, name in enumerate(names):
    mine_BL = weights_BL * (batch['source_ids'] == k + 1).astype(jnp.float32)
    count = jnp.sum(mine_BL)
    metrics[f'loss/{name}'] = jnp.sum(ce_BL * mine_BL) / jnp.maximum(count, 1.0)
    metrics[f'tokens/{name}'] = count * (batch_size / weights_BL.shape[0])
  return metrics


@dataclasses.dataclass(frozen=True)
class LanguageModeling:
  batch_size: int = 1  # Global batch, in rows.
  seq_len: int = 1
  keys: tuple[str, ...] = ('inputs', 'targets')  # + data.PACKED_KEYS when packing.
  z_loss_weight: float = 0.0  # Weight of mean(logsumexp(logits)^2) added to the loss; 0 = off.
  loss_chunks: int = 1  # > 1: the head and loss run on this many slices of positions (chunked_cross_entropy).
  feed: str = 'inputs'  # The row the model is called on; 'targets' for a model that shifts right itself.
  sources: tuple[str, ...] = ()  # data.source='mixture': the sources' names; batches carry `source_ids` (1, 2, ...).
  kind: ClassVar[str] = 'lm'
  unit: ClassVar[str] = 'tokens'  # Throughput is reported as tokens_per_s.

  @classmethod
  def from_config(cls, model, data_config, train) -> 'LanguageModeling':
    return cls(train.batch_size, data_config.seq_len, data.batch_keys(data_config),
               float(train.z_loss_weight), train.get('loss_chunks', 1),  # A run from before the key: 1.
               # Fed the targets, a model that shifts them right itself sees [pad, targets[0..L-2]] = inputs but for
               # the first token, so its logits[t] still score targets[t].
               'targets' if model.get('unshifted_inputs', False) else 'inputs',
               data.mixture_names(data_config))

  @property
  def units_per_step(self) -> int:
    return self.batch_size * self.seq_len

  def batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct((self.batch_size, self.seq_len), jnp.int32) for k in self.keys}

  def model_inputs(self, batch) -> tuple[tuple, dict]:
    """How the model is called: `model(inputs)`, with `segment_ids=`/`positions=` for packed rows."""
    packed = {k: batch[k] for k in data.PACKED_KEYS if k in batch}
    return (batch[self.feed],), packed

  def weight(self, batch: Batch) -> jax.Array:
    return jnp.sum(token_weights(batch))

  def loss(self, model: Callable, batch: Batch) -> tuple[jax.Array, Metrics]:
    """Mean cross entropy over non-padding tokens; the 'loss' metric leaves the z-loss out, so runs compare."""
    args, kwargs = self.model_inputs(batch)
    weights_BL = token_weights(batch)
    num_tokens = jnp.maximum(jnp.sum(weights_BL), 1.0)
    if self.loss_chunks > 1:
      x_BLD, head_DV = model(*args, hidden_and_head=True, **kwargs)
      loss, z_loss = chunked_cross_entropy(x_BLD, head_DV, batch['targets'], weights_BL, self.loss_chunks,
                                           with_z=bool(self.z_loss_weight))
    else:
      logits_BLV = model(*args, **kwargs).astype(jnp.float32)
      loss, z_loss = _cross_entropy_sums(logits_BLV, batch['targets'], weights_BL, with_z=bool(self.z_loss_weight))
    loss = loss / num_tokens
    metrics = {'loss': loss}
    if self.sources and self.loss_chunks == 1:
      metrics.update(_per_source(logits_BLV, batch, weights_BL, self.sources, self.batch_size))
    if 'loss_mask' in batch:  # Scaled from these rows to the global batch: the count itself under jit, and after
      # the per-device strategies' mean over devices (with train.grad_accum_steps > 1, a weighted mean of the
      # microbatches' counts).
      metrics['trained_tokens'] = jnp.sum(weights_BL) * (self.batch_size / weights_BL.shape[0])
    if not self.z_loss_weight:
      return loss, metrics
    z_loss = self.z_loss_weight * z_loss / num_tokens
    return loss + z_loss, {**metrics, 'z_loss': z_loss}

  def eval_summary(self, means: dict[str, float]) -> dict[str, float]:
    return {'eval_loss': means['loss'], 'eval_perplexity': float(math.exp(min(means['loss'], 80.0)))}


@dataclasses.dataclass(frozen=True)
class PreferenceOptimization(LanguageModeling):
  """train.objective='dpo': a language model's rows hold pairs of answers (trainer/training/preference.py)."""
  keys: tuple[str, ...] = preference.KEYS
  beta: float = 0.1  # train.dpo_beta.
  label_smoothing: float = 0.0  # train.dpo_label_smoothing.
  pairs: int = 1  # The most pairs a row holds (data.pairs_per_row).

  @classmethod
  def from_config(cls, model, data_config, train) -> 'PreferenceOptimization':
    del model
    return cls(train.batch_size, data_config.seq_len, beta=float(train.dpo_beta),
               label_smoothing=float(train.dpo_label_smoothing), pairs=data.pairs_per_row(data_config))

  def weight(self, batch: Batch) -> jax.Array:
    return jnp.sum(preference.pair_count_BP(batch, self.pairs))  # The loss is a mean over pairs.

  def loss(self, model: Callable, batch: Batch, reference: Callable | None = None) -> tuple[jax.Array, Metrics]:
    """The DPO loss of the policy `model` against the `reference` model (both bound, called alike); the packed
    call keeps a row's two answers apart."""
    if reference is None:
      raise ValueError("train.objective='dpo' needs the reference model: the state's reference_params.")
    args, kwargs = self.model_inputs(batch)
    policy = preference.answer_logps(model(*args, **kwargs), batch, self.pairs)
    frozen = preference.answer_logps(reference(*args, **kwargs), batch, self.pairs)
    frozen = jax.tree.map(jax.lax.stop_gradient, frozen)
    return preference.dpo_loss(policy, frozen, preference.pair_count_BP(batch, self.pairs), self.beta,
                               self.label_smoothing)

  def eval_summary(self, means: dict[str, float]) -> dict[str, float]:
    return {'eval_loss': means['loss'], 'eval_rewards/margins': means['rewards/margins'],
            'eval_rewards/accuracies': means['rewards/accuracies']}


@dataclasses.dataclass(frozen=True)
class Classification:
  batch_size: int = 1  # Global batch, in images.
  image_shape: tuple[int, ...] = (32, 32, 3)  # (H, W, C).
  kind: ClassVar[str] = 'classifier'
  unit: ClassVar[str] = 'images'  # Throughput is reported as images_per_s.

  @classmethod
  def from_config(cls, model, data_config, train) -> 'Classification':
    del model  # Read by the language objective only.
    return cls(train.batch_size, tuple(data_config.image_shape))

  @property
  def units_per_step(self) -> int:
    return self.batch_size

  def batch_shapes(self) -> dict[str, jax.ShapeDtypeStruct]:
    return {'images': jax.ShapeDtypeStruct((self.batch_size,) + self.image_shape, jnp.float32),
            'labels': jax.ShapeDtypeStruct((self.batch_size,), jnp.int32)}

  def model_inputs(self, batch) -> tuple[tuple, dict]:
    return (batch['images'],), {}

  def weight(self, batch: Batch) -> jax.Array:
    return jnp.asarray(batch['labels'].shape[0], jnp.float32)

  def loss(self, model: Callable, batch: Batch) -> tuple[jax.Array, Metrics]:
    logits_BC = model(batch['images']).astype(jnp.float32)
    loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BC, batch['labels']))
    accuracy = jnp.mean((jnp.argmax(logits_BC, axis=-1) == batch['labels']).astype(jnp.float32))
    return loss, {'loss': loss, 'accuracy': accuracy}

  def eval_summary(self, means: dict[str, float]) -> dict[str, float]:
    return {'eval_loss': means['loss'], 'eval_accuracy': means['accuracy']}


Objective = LanguageModeling | Classification | PreferenceOptimization


def for_config(model, data_config, train) -> Objective:
  """The objective of config.model.task, from config.model, config.data and config.train."""
  if model.task not in TASKS:
    raise UserError(f'model.task={model.task!r}: choose one of {TASKS}.')
  if train.get('objective', 'task') == 'dpo':  # A run from before the key: its task's own loss.
    if model.task != 'lm':
      raise UserError(f"train.objective='dpo' trains a language model on answer pairs, but model.task="
                      f"{model.task!r}; set --config.train.objective=task.")
    return PreferenceOptimization.from_config(model, data_config, train)
  return (LanguageModeling if model.task == 'lm' else Classification).from_config(model, data_config, train)


def example_inputs(objective: Objective) -> tuple[tuple, dict]:
  """The model's call arguments as ShapeDtypeStructs of the global batch (what a Linen model is initialized on)."""
  return objective.model_inputs(objective.batch_shapes())


