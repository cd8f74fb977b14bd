"""Preference pairs as rows: row i holds pair i, its chosen answer then its rejected one, side by side.

scripts/prepare_data.py writes a pair as two consecutive masked documents of the
token shards (meta 'pairs': true): the prompt and chosen answer, then the prompt
and rejected answer, each as the chat template renders it (trainer/data/preference_jsonl.py).
A row packs the two as segments 1 and 2, each shifted into (input, target) pairs
on its own, with its own positions (offsets in its document) and the loss mask
on its answer's tokens; the rest of the row is padding (segment 0, mask 0). The
model's packed attention keeps the segments apart, so one forward pass scores
both answers (trainer/training/preference.py). One pair a row, in order, keeps
the dataset random access: the shuffle, the split over processes and the resume
position are those of any other row source.
"""

import numpy as np

from trainer.base.errors import UserError
from trainer.data.documents import Documents


class PairRows:
  """Grain random-access source of one pair a row, each row `seq_len` long."""

  def __init__(self, documents: Documents, seq_len: int, split: str):
    lengths = documents.lengths
    if len(lengths) % 2 or not documents.has_mask:
      raise UserError(f'{documents.name} are not preference pairs (an even count of masked documents): prepare them '
                      f'with scripts/prepare_data.py from {{"prompt", "chosen", "rejected"}} JSONL.')
    self._documents, self._seq_len = documents, seq_len
    self._needed = (lengths[0::2] - 1) + (lengths[1::2] - 1)  # A document of n tokens is n - 1 (input, target) pairs.
    longest = int(np.argmax(self._needed)) if len(self._needed) else 0
    if len(self._needed) and self._needed[longest] > seq_len:
      raise UserError(f'pair {longest} of the {split} split of {documents.name} needs a row of '
                      f'{int(self._needed[longest])} tokens (chosen {int(lengths[2 * longest])} + rejected '
                      f'{int(lengths[2 * longest + 1])}, less one each) but data.seq_len={seq_len}: set '
                      f'--config.data.seq_len={int(self._needed.max())} (or more), or prepare the data with '
                      f'shorter answers.')

  def __len__(self) -> int:
    return len(self._needed)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    row = {k: np.zeros(self._seq_len, np.int32) for k in ('inputs', 'targets', 'segment_ids', 'positions', 'loss_mask')}
    at = 0
    for segment, d in ((1, 2 * index), (2, 2 * index + 1)):
      n = int(self._documents.lengths[d])
      tokens = self._documents.span(d, 0, n).astype(np.int32)
      end = at + n - 1
      row['inputs'][at:end], row['targets'][at:end] = tokens[:-1], tokens[1:]
      row['segment_ids'][at:end] = segment
      row['positions'][at:end] = np.arange(n - 1)
      row['loss_mask'][at:end] = self._documents.mask_span(d, 1, n)
      at = end
    return row

  def __repr__(self) -> str:
    return f'PairRows(pairs={len(self)}, seq_len={self._seq_len})'
