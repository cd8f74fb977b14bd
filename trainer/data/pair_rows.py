"""Preference pairs as rows: each pair's chosen answer then its rejected one, side by side; with data.packing, as
many whole pairs a row as fit.

scripts/prepare_data.py writes a pair as two consecutive masked documents of the
token shards (meta 'pairs': true): the prompt and chosen answer, then the prompt
and rejected answer, each as the chat template renders it (trainer/data/preference_jsonl.py).
A row packs pair k of the row as segments 2k + 1 (chosen) and 2k + 2 (rejected),
each shifted into (input, target) pairs on its own, with its own positions
(offsets in its document) and the loss mask on its answer's tokens; the rest of
the row is padding (segment 0, mask 0). The model's packed attention keeps the
segments apart, so one forward pass scores every answer (trainer/training/preference.py).
Without packing a row holds one pair; with it, the pairs in their order fill a row
until the next does not fit or the row holds data.max_documents_per_row // 2 of
them (the bound cuDNN's attention is sized by). The rows are fixed by an index
made once, so the dataset stays random access: the shuffle, the split over
processes and the resume position are those of any other row source.
"""

import numpy as np

from trainer.base.errors import UserError
from trainer.data.documents import Documents


def pairs_per_row(data_config) -> int:
  """The most pairs a row holds: one, or with data.packing as many as data.max_documents_per_row has segments for."""
  return max(1, data_config.max_documents_per_row // 2) if data_config.packing else 1


class PairRows:
  """Grain random-access source of whole pairs, up to `pairs_per_row` a row, each row `seq_len` long."""

  def __init__(self, documents: Documents, seq_len: int, split: str, pairs_per_row: int = 1):
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
    self.pairs_per_row = pairs_per_row
    self._starts = _row_starts(self._needed, seq_len, pairs_per_row)

  def __len__(self) -> int:
    return len(self._starts) - 1

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    row = {k: np.zeros(self._seq_len, np.int32) for k in ('inputs', 'targets', 'segment_ids', 'positions', 'loss_mask')}
    at = 0
    first = int(self._starts[index])
    for segment, d in enumerate(range(2 * first, 2 * int(self._starts[index + 1])), start=1):
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
    return f'PairRows(pairs={len(self._needed)}, rows={len(self)}, seq_len={self._seq_len})'


def _row_starts(needed: np.ndarray, seq_len: int, pairs_per_row: int) -> np.ndarray:
  """The first pair of each row, and the pair count at the end: pairs in order, a row closed when the next pair
  does not fit its tokens or it holds `pairs_per_row`."""
  if pairs_per_row == 1 or not len(needed):
    return np.arange(len(needed) + 1)
  starts, used, count = [0], 0, 0
  for k, n in enumerate(needed.tolist()):
    if count == pairs_per_row or used + n > seq_len:
      starts.append(k)
      used, count = 0, 0
    used, count = used + n, count + 1
  return np.asarray(starts + [len(needed)])
