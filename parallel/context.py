"""The sequence split over the `context` mesh axis: which tokens each device holds, in one load-balanced order.

With `mesh.context = C > 1` every row's L tokens are split over C devices. Split in plain order, causal attention
leaves the first device almost idle (its queries see only its own keys) and the last with C times its work. The
row is therefore reordered once, before the model ("zig-zag", as torchtitan's head/tail balancer and MaxText's
load-balanced context parallelism do): cut into 2C chunks, device r holds chunk r and chunk 2C-1-r, so every device
gets one early and one late chunk and the same causal work (`causal_work` measures it).

`balance` applies the order to every per-token array of a batch (inputs, targets, positions, segment ids) in one
place, trainer/training/task.py's loss; it is undone nowhere: the loss is a sum over tokens, RoPE reads each token's own
entry of `positions`, and attention (trainer/attention/context.py) reads `order` to mask by original position.
"""

import numpy as np

from trainer.base.errors import UserError

AXIS = 'context'


def chunks(parts: int) -> int:
  """How many chunks a row is cut into: two per device."""
  return 2 * parts


def order(seq_len: int, parts: int) -> np.ndarray:
  """(L,) the original position of the token at each place of the balanced row; identity when parts == 1."""
  if parts == 1:
    return np.arange(seq_len)
  size = seq_len // chunks(parts)
  pieces = [i for r in range(parts) for i in (r, chunks(parts) - 1 - r)]
  return np.concatenate([np.arange(i * size, (i + 1) * size) for i in pieces])


def check_seq_len(seq_len: int, parts: int) -> None:
  """One line before compile when the row cannot be cut into two chunks per device."""
  if parts > 1 and seq_len % chunks(parts):
    multiple = chunks(parts)
    raise UserError(f'data.seq_len={seq_len} must be a multiple of {multiple} (2 x mesh.context={parts}: two '
                    f'chunks per device balance causal attention); use data.seq_len='
                    f'{max(multiple, seq_len // multiple * multiple)} or {(seq_len // multiple + 1) * multiple}.')


def balance(batch: dict, parts: int) -> dict:
  """The batch with every (B, L) array's tokens put in the balanced order (a gather along L; rows unchanged)."""
  if parts == 1:
    return batch
  index = order(next(iter(batch.values())).shape[1], parts)
  return {k: v[:, index] for k, v in batch.items()}


def causal_work(seq_len: int, parts: int, balanced: bool = True) -> list[int]:
  """Per device, the (query, key) pairs causal attention computes: a block kernel skips the rest."""
  where = order(seq_len, parts) if balanced else np.arange(seq_len)
  local = seq_len // parts
  return [int(np.sum(where[r * local:(r + 1) * local] + 1)) for r in range(parts)]
