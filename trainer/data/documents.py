"""Documents (token arrays) and the two ways to cut them into fixed-length examples.

A `Documents` source knows each document's length up front and reads any span
of one document; that is all the cutters need, so both work the same over text
held in memory and over ArrayRecord shards read lazily from disk.

- `StreamWindows` (packing off): the documents are one stream and example i is
  tokens [i*L, i*L + L + 1) of it, shifted by one into inputs/targets. Windows
  cross document boundaries, as the default byte-level text job always did.
- `PackedRows` (packing on): each document is shifted into (input, target)
  pairs on its own, so no token ever predicts the next document's first token;
  the pairs of all documents are laid end to end and cut into rows of L. A row
  carries `segment_ids` (1, 2, ... per document piece in the row) and
  `positions` (the token's offset in its document, or with
  data.packed_positions='row' in its piece of the row), which the model's
  attention mask and RoPE use.

Documents with a loss mask (fine-tuning shards: 1 on completion tokens, 0 on
prompt tokens) give both cutters a `loss_mask` row when asked (data.loss_mask):
the mask of each pair's target, cut exactly as the targets are, so it survives
packing and windows. Nothing is padded; only the final partial row is
  dropped (the description says how many pairs). This is concat-then-split
  packing with a precomputed index, chosen over Grain's iterator-level packers
  (FirstFitPackIterDataset, ConcatThenSplitIterDataset) because it keeps the
  dataset random access: a global shuffle, the per-process split and a resume
  position counted in global examples stay exact for any process count.
"""

import numpy as np


class Documents:
  """Base: `lengths` (int64 per document) plus `span(d, a, b)` -> tokens [a, b) of document d."""

  lengths: np.ndarray
  name: str  # Where the documents come from, for messages.
  has_mask: bool = False  # `mask_span` reads a per-token loss mask.

  def span(self, d: int, a: int, b: int) -> np.ndarray:
    raise NotImplementedError

  def mask_span(self, d: int, a: int, b: int) -> np.ndarray:
    """The loss mask of tokens [a, b) of document d (1 = the token is trained as a target)."""
    raise NotImplementedError

  def stream(self, start: int, stop: int, mask: bool = False) -> np.ndarray:
    """Tokens [start, stop) of all documents laid end to end (their loss mask when `mask`)."""
    read = self.mask_span if mask else self.span
    ends = np.cumsum(self.lengths)
    d = int(np.searchsorted(ends, start, side='right'))
    parts, pos = [], start
    while pos < stop and d < len(ends):
      doc_start = ends[d] - self.lengths[d]
      take_to = min(stop, ends[d])
      if take_to > pos:
        parts.append(read(d, int(pos - doc_start), int(take_to - doc_start)))
        pos = take_to
      d += 1
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)

  @property
  def num_tokens(self) -> int:
    return int(self.lengths.sum())


class InMemoryDocuments(Documents):
  """Documents stored back to back in one array; `starts[d]` is where document d begins."""

  def __init__(self, tokens: np.ndarray, starts: np.ndarray, name: str):
    self.tokens = tokens
    self.starts = np.asarray(starts, np.int64)
    self.lengths = np.diff(np.append(self.starts, len(tokens)))
    self.name = name

  def span(self, d, a, b):
    return self.tokens[self.starts[d] + a:self.starts[d] + b]

  def stream(self, start, stop, mask=False):
    return self.tokens[start:stop]  # Contiguous already: one slice, as fast as the old byte windows.


class StreamWindows:
  """Grain random-access source: example i is stream tokens [i*L, i*L + L + 1) as inputs/targets."""

  def __init__(self, documents: Documents, seq_len: int, loss_mask: bool = False):
    self._documents = documents
    self._seq_len = seq_len
    self._num_tokens = documents.num_tokens
    self._loss_mask = loss_mask

  def __len__(self) -> int:
    return max(0, (self._num_tokens - 1) // self._seq_len)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    start = index * self._seq_len
    window = self._documents.stream(start, start + self._seq_len + 1).astype(np.int32)
    example = {'inputs': window[:-1], 'targets': window[1:]}
    if self._loss_mask:
      example['loss_mask'] = self._documents.stream(start + 1, start + self._seq_len + 1, mask=True).astype(np.int32)
    return example

  def __repr__(self) -> str:
    return f'StreamWindows(num_tokens={self._num_tokens}, seq_len={self._seq_len})'


class PackedRows:
  """Grain random-access source: row i holds (input, target) pairs [i*L, (i+1)*L) of the per-document pair stream."""

  def __init__(self, documents: Documents, seq_len: int, positions: str = 'document', loss_mask: bool = False):
    """`positions`: 'document' (a token's offset in its document) or 'row' (its offset in its piece of this row,
    always < seq_len: what a model with a learned table of seq_len positions can read)."""
    self._documents = documents
    self._seq_len = seq_len
    self._row_positions = positions == 'row'
    self._loss_mask = loss_mask
    self._pairs = np.maximum(documents.lengths - 1, 0)  # A document of n tokens has n-1 next-token pairs.
    self._first_pair = np.concatenate([[0], np.cumsum(self._pairs)])
    self.num_pairs = int(self._first_pair[-1])

  def __len__(self) -> int:
    return self.num_pairs // self._seq_len

  def most_documents_per_row(self) -> tuple[int, int]:
    """(the most documents any row holds, the first row holding that many), from the index alone.

    A row holds one document piece for its first token plus one per document that starts inside it; documents
    with no pairs (one token or none) take no room and are not counted, as `__getitem__` skips them.
    """
    rows = len(self)
    if not rows:
      return 0, 0
    starts = self._first_pair[:-1][self._pairs > 0]
    inside = starts[starts % self._seq_len != 0] // self._seq_len
    counts = np.bincount(inside[inside < rows], minlength=rows) + 1
    row = int(np.argmax(counts))
    return int(counts[row]), row

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    lo, hi = index * self._seq_len, (index + 1) * self._seq_len
    d = int(np.searchsorted(self._first_pair, lo, side='right')) - 1
    inputs, targets, segments, positions, masks = [], [], [], [], []
    while lo < hi:
      a, b = lo - self._first_pair[d], min(hi - self._first_pair[d], self._pairs[d])
      if b > a:
        tokens = self._documents.span(d, int(a), int(b) + 1).astype(np.int32)
        inputs.append(tokens[:-1])
        targets.append(tokens[1:])
        segments.append(np.full(b - a, len(segments) + 1, np.int32))
        first = 0 if self._row_positions else a
        positions.append(np.arange(first, first + b - a, dtype=np.int32))
        if self._loss_mask:  # The targets' mask: tokens a+1 .. b of the document.
          masks.append(self._documents.mask_span(d, int(a) + 1, int(b) + 1).astype(np.int32))
        lo += b - a
      d += 1
    row = {'inputs': np.concatenate(inputs), 'targets': np.concatenate(targets),
           'segment_ids': np.concatenate(segments), 'positions': np.concatenate(positions)}
    if self._loss_mask:
      row['loss_mask'] = np.concatenate(masks)
    return row

  def __repr__(self) -> str:
    return f'PackedRows(num_pairs={self.num_pairs}, seq_len={self._seq_len})'
