"""Per-choice log-likelihoods of multiple-choice questions: padded rows, one jitted function, sharded like training.

Every (question, choice) pair becomes one row of data.seq_len tokens, as lm-eval-harness builds its loglikelihood
requests: the prompt's and the continuation's tokens, cut from the left when longer than a row (+1, for the shift),
`inputs` the row, `targets` it shifted left, and a mask on the continuation's targets. Rows are right-padded: the
model is causal, so padding after a token never reaches that token's logits. Rows go to the devices in calls of
`rows_per_call` (the training batch split over the same 'batch' axes), a bounded number in flight (dispatch.py); the
function compiles once per row count and parameter layout.

The function is the task's own forward (`Task.outputs`: the compute dtype, the mesh context, the context split's
row order), then log-softmax in float32 and a masked sum per row; with train.loss_chunks > 1, the logits a slice of
positions at a time, as the chunked loss makes them. It runs under jit with the training
parameters' shardings whichever strategy trains (shard_map or pmap runs score through GSPMD).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from trainer.base.errors import UserError
from trainer.evals import dispatch
from trainer.evals.codec import Codec
from trainer.evals.tasks import TaskFile


@dataclasses.dataclass(frozen=True)
class Rows:
  """A task's (question, choice) rows, in question order then choice order."""
  inputs: np.ndarray  # (R, L) int32.
  targets: np.ndarray  # (R, L) int32.
  mask: np.ndarray  # (R, L) float32: 1.0 on the continuation's targets.
  question: np.ndarray  # (R,) int32: which question a row belongs to.


def encode_pair(codec: Codec, prompt: str, continuation: str) -> tuple[list[int], list[int]]:
  """(context ids, continuation ids) as lm-eval-harness 0.4.11 pairs them (`TemplateLM.loglikelihood`).

  A non-empty prompt goes through its `_encode_pair`: all trailing whitespace of the prompt (str.rstrip(): spaces,
  newlines, tabs, any Unicode whitespace) moves to the continuation; the context is the rest encoded with the
  run's prefix (BOS), and the continuation is what encoding the whole adds after the context's length. An empty
  prompt is scored after the prefix token (`prefix_token_id`: BOS, else the end-of-text token), the continuation
  encoded alone (a continuation that starts with that token gives it up as the context). A whitespace-only prompt
  whose context is left with no token at all (no BOS) is scored as an empty one: lm-eval's own Hugging Face model
  stops at an assertion there, and after the end-of-text token is what it does for the empty prompt. A run whose
  tokenizer has neither token (bytes) gets ([], ...): build_rows refuses the question in one line.
  """
  start = [*codec.prefix[:1], *codec.eos[:1]][:1]  # lm-eval's prefix_token_id: BOS, else end-of-text.
  if prompt:
    moved = len(prompt) - len(prompt.rstrip())
    if moved:
      prompt, continuation = prompt[:-moved], prompt[-moved:] + continuation
    context = [*codec.prefix, *codec.encode(prompt)]
    if context:
      return context, [*codec.prefix, *codec.encode(prompt + continuation)][len(context):]
  ids = codec.encode(continuation)
  if start and ids[:1] == start:
    return ids[:1], ids[1:]
  return start, ids


def build_rows(task: TaskFile, codec: Codec, seq_len: int) -> Rows:
  """The rows of every choice of every question; a continuation longer than a row is an error naming its line."""
  inputs, targets, masks, owner = [], [], [], []
  for index, question in enumerate(task.questions):
    for continuation in question.continuations:
      context, cont = encode_pair(codec, question.prompt, continuation)
      if not context:
        raise UserError(f'eval task file {task.path}, line {question.line}: the prompt is only whitespace and the '
                        f"run's tokenizer has no BOS or end-of-text token to score the choices after (lm-eval's "
                        f'rule); give the question a context with text in it.')
      if not cont or len(cont) > seq_len:
        raise UserError(f'eval task file {task.path}, line {question.line}: the continuation {continuation!r} is '
                        f'{len(cont)} tokens; it must be 1 to data.seq_len={seq_len}.')
      row_in, row_tgt, row_mask = row(context, cont, seq_len)
      inputs.append(row_in), targets.append(row_tgt), masks.append(row_mask), owner.append(index)
  return Rows(np.stack(inputs), np.stack(targets), np.stack(masks), np.asarray(owner, np.int32))


def row(context: list[int], continuation: list[int], seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(inputs, targets, mask) of one (context, continuation) pair, cut from the left to seq_len + 1 tokens."""
  whole = (context + continuation)[-(seq_len + 1):]
  row_in, row_tgt, row_mask = np.zeros(seq_len, np.int32), np.zeros(seq_len, np.int32), np.zeros(seq_len, np.float32)
  n = len(whole) - 1
  row_in[:n], row_tgt[:n] = whole[:-1], whole[1:]
  row_mask[n - min(len(continuation), seq_len):n] = 1.0
  return row_in, row_tgt, row_mask


def _masked_sums(logits_BLV, targets_BL, mask_BL):
  logp_BL = jnp.take_along_axis(jax.nn.log_softmax(logits_BLV.astype(jnp.float32), axis=-1), targets_BL[..., None],
                                axis=-1)[..., 0]
  return jnp.sum(logp_BL * mask_BL, axis=-1)


def _row_log_likelihoods(params, inputs_BL, targets_BL, mask_BL, *, task, chunks: int = 1):
  """(B,) float32: each row's sum of log p(target) over its masked positions.

  With `chunks` > 1 (train.loss_chunks) the logits are made a slice of positions at a time from the model's hidden
  states and head, as the chunked loss makes them, so a call never holds (B, L, V) whole. A row's sum does not
  depend on the order of its positions, so the slices are taken in the order the model ran them (the context
  split's balanced order, which the mask follows).
  """
  if chunks == 1:
    return _masked_sums(task.outputs(params, {'inputs': inputs_BL, 'targets': targets_BL}), targets_BL, mask_BL)
  batch = task.balanced({'inputs': inputs_BL, 'targets': targets_BL, 'mask': mask_BL})
  args, kwargs = task.objective.model_inputs(batch)
  with task.context():
    x_BLD, head_DV = task.bind(params)(*args, hidden_and_head=True, **kwargs)
  B, L = inputs_BL.shape

  def split(a):  # (B, L, ...) -> (chunks, B, L / chunks, ...)
    return jnp.moveaxis(a.reshape(B, chunks, L // chunks, *a.shape[2:]), 1, 0)

  def slice_sums(slice_):
    x_BlD, targets_Bl, mask_Bl = slice_
    return _masked_sums(jnp.einsum('bld,dv->blv', x_BlD, head_DV), targets_Bl, mask_Bl)
  return jnp.sum(jax.lax.map(slice_sums, (split(x_BLD), split(batch['targets']), split(batch['mask']))), axis=0)


class Scorer:
  """Scores Rows with one jitted function on `mesh`, `rows_per_call` rows at a time, split over the batch axes."""

  def __init__(self, task, mesh, params_shardings, row_sharding: NamedSharding, rows_per_call: int,
               chunks: int = 1):
    self.rows_per_call = rows_per_call
    self._row_sharding = row_sharding
    self._fn = jax.jit(functools.partial(_row_log_likelihoods, task=task, chunks=chunks),
                       in_shardings=(params_shardings, row_sharding, row_sharding, row_sharding),
                       out_shardings=NamedSharding(mesh, PartitionSpec()))

  def _global(self, block: np.ndarray):
    """A host array every process holds whole, as a global array on the row sharding (any number of processes)."""
    return jax.make_array_from_callback(block.shape, self._row_sharding, lambda index: block[index])

  def log_likelihoods(self, params, rows: Rows) -> np.ndarray:
    """(R,) float64 log-likelihood of each row's continuation."""
    n, per = len(rows.inputs), self.rows_per_call
    padded = -(-n // per) * per

    def pad(a):
      return np.concatenate([a, np.zeros((padded - n,) + a.shape[1:], a.dtype)])
    inputs, targets, mask = pad(rows.inputs), pad(rows.targets), pad(rows.mask)
    outs = dispatch.fetched(lambda i: self._fn(params, *(self._global(a[i:i + per]) for a in (inputs, targets, mask))),
                            range(0, padded, per))  # A bounded number in flight (dispatch.py).
    return np.concatenate([np.asarray(o, np.float64) for o in outs])[:n]


def multiple_choice_scores(task: TaskFile, rows: Rows, lls: np.ndarray) -> tuple[dict[str, float], list[dict]]:
  """({'acc', 'acc_norm'}, per question {'line', 'gold', 'log_likelihoods', 'pred', 'pred_norm'})."""
  per_question, acc, acc_norm = [], [], []
  for index, question in enumerate(task.questions):
    ll = lls[rows.question == index]
    pred, pred_norm = int(np.argmax(ll)), int(np.argmax(ll / np.asarray(question.choice_chars, np.float64)))
    acc.append(pred == question.gold)
    acc_norm.append(pred_norm == question.gold)
    per_question.append({'line': question.line, 'gold': question.gold, 'log_likelihoods': [float(x) for x in ll],
                         'pred': pred, 'pred_norm': pred_norm})
  return {'acc': float(np.mean(acc)), 'acc_norm': float(np.mean(acc_norm))}, per_question
