"""Weighted mixtures of prepared sources (`data.source='mixture'`), with weights that change by stage.

`data.mixture = (('/data/web', 0.7), ('/data/code', 0.2), ('/data/math', 0.1))` names folders written by
scripts/prepare_data.py; each is cut into rows as a single `array_record` source would be (packed or windows),
shuffled and repeated on its own (seed `train.seed + i`), and Grain's `MapDataset.mix` interleaves them by weight.
Grain's mix is a deterministic interleave, not a random draw: after n rows each source has given its share of n
to within one row, so shares hold exactly from the first batch.

Stages: `data.mixture_stages = ((1000, (0.5, 0.3, 0.2)), ...)` sets new weights from a step on. The global row
sequence is a list of segments, each a mix at one set of weights that starts at a global row and where each
source had got to (`Segment.offsets`): a source continues where it stopped, so a weight change neither repeats
nor skips its rows. The segments are the data item of each checkpoint. A relaunch with the same settings rebuilds
the same segments (the same rows, exactly); a relaunch whose weights at the resumed step differ from the saved
ones starts a new segment at the resumed row, with each source continuing from its saved position.

Sharding over processes and the resume position are the pipeline's (trainer/data/pipeline.py): the global row
sequence does not depend on the process or device count.
"""

import dataclasses
import functools
import pathlib
from typing import Any

import grain
import numpy as np

from trainer.base.errors import UserError
from trainer.data import pipeline, token_shards

ENDLESS = 1 << 62  # Rows in the last segment: Grain concatenates only finite datasets, and no run reads this many.


@dataclasses.dataclass(frozen=True)
class Segment:
  start: int  # Global row where these weights start.
  weights: tuple[float, ...]  # One per source; 0 = not drawn in this segment.
  offsets: tuple[int, ...]  # Rows each source had given before `start` (into its shuffled, repeated order).


@dataclasses.dataclass(frozen=True)
class Source:
  name: str  # The folder's name, e.g. 'web': the suffix of its metrics.
  path: str
  train: Any  # Random-access rows (PackedRows or StreamWindows).
  eval: Any  # The held-out rows, or None.
  tokens: int  # Train tokens in the folder.


def parse(data_config) -> tuple[list[str], tuple[float, ...]]:
  """(folders, weights) of data.mixture; one UserError for a malformed, negative or all-zero mixture."""
  pairs = data_config.get('mixture') or ()
  if not pairs:
    raise UserError("data.source='mixture' needs data.mixture: ((folder, weight), ...), e.g. "
                    "--config.data.mixture=\"(('/data/web', 0.7), ('/data/code', 0.3))\".")
  if not all(isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) for p in pairs):
    raise UserError(f'data.mixture={pairs!r}: give (folder, weight) pairs, e.g. ((\'/data/web\', 0.7), '
                    f'(\'/data/code\', 0.3)).')
  paths = [p[0] for p in pairs]
  names = [pathlib.Path(p).name for p in paths]
  if len(set(names)) != len(names):
    raise UserError(f'data.mixture names folders {names}: each source is logged by its folder name, so the names '
                    f'must differ; rename or link a folder.')
  return paths, check_weights(tuple(p[1] for p in pairs), 'data.mixture', len(paths))


def check_weights(weights, setting: str, count: int) -> tuple[float, ...]:
  if len(weights) != count or not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
    raise UserError(f'{setting}: {weights!r} must be {count} numbers, one weight per source of data.mixture.')
  if any(w < 0 or not np.isfinite(w) for w in weights):
    raise UserError(f'{setting}: weights {tuple(weights)} include a negative or non-finite one; weights are >= 0.')
  if sum(weights) <= 0:
    raise UserError(f'{setting}: weights {tuple(weights)} sum to 0; at least one source needs a positive weight.')
  return tuple(float(w) for w in weights)


def stages(data_config, batch_size: int, count: int) -> list[tuple[int, tuple[float, ...]]]:
  """(first global row, weights) of each stage, the first at row 0 with data.mixture's weights."""
  result = [(0, parse(data_config)[1])]
  last = 0
  for item in data_config.get('mixture_stages') or ():
    if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], int) and item[0] > last):
      raise UserError(f'data.mixture_stages={data_config.mixture_stages!r}: give (step, weights) pairs with steps '
                      f'> 0 and increasing, e.g. ((1000, (0.5, 0.5)),).')
    last = item[0]
    result.append((item[0] * batch_size, check_weights(tuple(item[1]), f'data.mixture_stages step {item[0]}', count)))
  return result


def _grain_proportions(weights: tuple[float, ...]) -> list[int]:
  """The integers Grain's mix turns weights into (grain 0.2.18 mix.py `_float_to_int_proportions`); the tests
  check `counts` against a real mix, so a Grain that changes this fails them."""
  scale = 100 / min(weights)
  return [int(w * scale) for w in weights]


def counts(rows: int, weights: tuple[float, ...]) -> np.ndarray:
  """How many of the first `rows` rows of a segment each source gives (0 for a weight of 0)."""
  active = [i for i, w in enumerate(weights) if w > 0]
  result = np.zeros(len(weights), np.int64)
  remaining, left = sum(_grain_proportions(tuple(weights[i] for i in active))), rows
  for i, p in zip(active, _grain_proportions(tuple(weights[i] for i in active))):
    # Grain hands source i its share p/remaining of what is left, rounded down in what it leaves to the rest.
    rest = left * (remaining - p) // remaining
    result[i], left, remaining = left - rest, rest, remaining - p
  return result


def position(segments: list[Segment], row: int) -> np.ndarray:
  """Rows each source has given before global row `row`."""
  segment = [s for s in segments if s.start <= row][-1]
  return np.asarray(segment.offsets, np.int64) + counts(row - segment.start, segment.weights)


def plan(stage_list: list[tuple[int, tuple[float, ...]]], saved: list[Segment] | None = None,
         row: int = 0) -> list[Segment]:
  """The segments of a run: the stages as planned, or after a resume at global `row` the saved segments up to it,
  a new one there if the weights now differ, then the stages still ahead."""
  count = len(stage_list[0][1])
  segments: list[Segment] = []
  ahead = stage_list
  if saved:
    segments = [s for s in saved if s.start <= row]
    now = [w for start, w in stage_list if start <= row][-1]
    if segments[-1].weights != now:
      segments.append(Segment(row, now, tuple(int(x) for x in position(segments, row))))
    ahead = [(start, w) for start, w in stage_list if start > row]
  for start, weights in ahead:
    if segments and segments[-1].weights == weights:
      continue
    offsets = position(segments, start) if segments else np.zeros(count, np.int64)
    segments.append(Segment(start, weights, tuple(int(x) for x in offsets)))
  return segments


def tag(row: dict[str, np.ndarray], source: int) -> dict[str, np.ndarray]:
  """The row with `source_ids`: its source's index + 1 at every position (what the loss per source reads)."""
  return {**row, 'source_ids': np.full(row['inputs'].shape, source + 1, np.int32)}


def global_rows(sources: list, seed: int, segments: list[Segment]) -> grain.MapDataset:
  """Every global row of the run, in order: each segment a Grain mix of the sources from their offsets on."""
  shuffled = [pipeline.global_examples(rows, seed + i).map(functools.partial(tag, source=i))
              for i, rows in enumerate(sources)]
  parts = []
  for segment, following in zip(segments, segments[1:] + [None]):
    active = [i for i, w in enumerate(segment.weights) if w > 0]
    mixed = grain.MapDataset.mix([shuffled[i][segment.offsets[i]:] for i in active],
                                 [segment.weights[i] for i in active])
    parts.append(mixed[:(following.start if following else ENDLESS) - segment.start])
  return parts[0] if len(parts) == 1 else grain.MapDataset.concatenate(parts)


class MixtureIterator(pipeline.TrainIterator):
  """The train iterator of a mixture: its state adds the segments, so a relaunch can change the weights."""

  def __init__(self, sources: list, data_config, batch_size: int, seed: int, process_index: int,
               process_count: int, stage_list, fingerprint: dict[str, Any]):
    self._stages, self._sources, self._seed = stage_list, sources, seed
    self.segments = plan(stage_list)
    make = lambda start: pipeline.to_iterator(pipeline.process_batches(
        global_rows(self._sources, self._seed, self.segments), batch_size, process_index, process_count, start),
        data_config)
    super().__init__(make, batch_size, {**fingerprint, 'seq_len': data_config.seq_len, 'seed': seed,
                                        'num_examples': int(sum(len(s) for s in sources))})

  def source_rows(self) -> np.ndarray:
    """Rows each source has given to the steps so far."""
    return position(self.segments, self._consumed)

  def get_state(self) -> dict[str, Any]:
    return {**super().get_state(), 'segments': [[s.start, list(s.weights), list(s.offsets)] for s in self.segments]}

  def set_state(self, state: dict[str, Any]) -> None:
    super().set_state(state)
    saved = [Segment(int(a), tuple(w), tuple(int(x) for x in o)) for a, w, o in state['segments']]
    self.segments = plan(self._stages, saved, self._consumed)


def load(folders: list[str], vocab_size: int, eval_wanted: bool, cut, loss_mask: bool = False) -> list[Source]:
  """Each folder's train (and held-out) rows; one UserError for a folder that is not prepared, or sources made
  with different tokenizers or vocabularies."""
  metas = []
  for folder in folders:
    try:
      metas.append(token_shards.read_meta(pathlib.Path(folder)))
    except UserError as e:
      raise UserError(f'data.mixture source {folder!r}: {e}') from None
  # The tokenizer's files' hash where prepare_data.py recorded it: one tokenizer read from two paths is the same.
  made = {(m.get('tokenizer_sha256') or m.get('tokenizer'), m['vocab_size']) for m in metas}
  if len(made) > 1:
    listed = ', '.join(f'{f}: {m.get("tokenizer")} ({m["vocab_size"]} tokens)' for f, m in zip(folders, metas))
    raise UserError(f'the sources of data.mixture were prepared with different tokenizers or vocabularies ({listed});'
                    f' prepare every source with the same --tokenizer.')
  if metas[0]['vocab_size'] > vocab_size:
    raise UserError(f'the sources of data.mixture use a vocabulary of {metas[0]["vocab_size"]} tokens but '
                    f'model.vocab_size={vocab_size}; set --config.model.vocab_size={metas[0]["vocab_size"]} (or more).')
  sources = []
  for folder in folders:
    root = pathlib.Path(folder)
    train = token_shards.load_documents(root, 'train')
    if loss_mask and not train.has_mask:
      raise UserError(f'data.loss_mask=True needs every source of data.mixture to carry a loss mask (prompt/completion '
                      f'JSONL through scripts/prepare_data.py); {folder!r} has none.')
    held = token_shards.load_documents(root, 'eval') if eval_wanted else None
    rows = cut(train)
    if not len(rows):
      raise UserError(f'data.mixture source {folder!r} makes no train rows of data.seq_len; add data to it or lower '
                      f'data.seq_len.')
    held_rows = cut(held) if held is not None and held.num_tokens else None
    sources.append(Source(root.name, folder, rows, held_rows if held_rows is not None and len(held_rows) else None,
                          train.num_tokens))
  return sources


class Accounting:
  """What the loop logs per source of a mixture: tokens seen so far, and the eval loss on each source's held-out
  rows (the training loss per source comes from the step: trainer/training/objectives.py)."""

  def __init__(self, names: list[str], iterator: MixtureIterator, batch_size: int, seq_len: int,
               eval_by_source: dict[str, list]):
    self._names, self._iterator, self._batch_size, self._seq_len = names, iterator, batch_size, seq_len
    self._eval_by_source = eval_by_source

  def tokens_seen(self, step: int) -> dict[str, float]:
    """Tokens each source gave to steps 1..`step` (every row is seq_len tokens: no padding, in both cutters)."""
    rows = position(self._iterator.segments, step * self._batch_size)
    return {f'tokens_seen/{name}': float(n * self._seq_len) for name, n in zip(self._names, rows)}

  def evaluate(self, evaluate) -> dict[str, float]:
    """`evaluate(batches) -> {'eval_loss': ...}` on each source's held-out batches."""
    return {f'eval_loss/{name}': evaluate(batches)['eval_loss'] for name, batches in self._eval_by_source.items()}


def describe(sources: list[Source], stage_list, batch_size: int, steps: int, seq_len: int) -> str:
  """The data line: each source's size, weight (and later weights) and the epochs of it the run reads."""
  read = position(plan(stage_list), steps * batch_size)
  parts = []
  for i, s in enumerate(sources):
    later = ''.join(f', {w[i]:g} from step {start // batch_size}' for start, w in stage_list[1:])
    parts.append(f'{s.name} ({s.path}: {len(s.train)} rows, {s.tokens} tokens; weight {stage_list[0][1][i]:g}{later};'
                 f' {read[i] / len(s.train):.2f} epochs in {steps} steps)')
  return f'mixture of {len(sources)} sources of rows of {seq_len}: ' + ', '.join(parts)
