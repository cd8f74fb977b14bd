"""The input side of a run, built with one call: `build(config.data, needs, batch_shardings, process_index,
process_count)`, where `needs` (a `Needs`) is the little the input side reads of the model and train settings.

Sources (`data.source`):
  'text'          byte-level text files (trainer/data/text.py), the default job;
  'array_record'  token shards written by scripts/prepare_data.py (trainer/data/token_shards.py);
  'mixture'       several such folders drawn by weight, with staged weights (trainer/data/mixture.py);
  'arrays'        images and labels from .npz / .npy, for classification (trainer/data/arrays.py);
  'synthetic'     for an LM random tokens of the configured shape (benchmarks); for a classifier learnable
                  images of data.image_shape (class templates plus noise; runs and tests without a dataset);
                  train batches come from a pool drawn once (trainer/data/synthetic_pool.py), so they cost nothing.
Which sources fit depends on model.task: an 'lm' reads tokens (every source but 'arrays'), a 'classifier'
reads images and labels ('arrays' or 'synthetic'); `build` refuses the other pairs.
With train.objective='dpo', 'array_record' shards of preference pairs give rows of
whole pairs, one or (data.packing) as many as fit (trainer/data/pair_rows.py).
Token sources are cut into examples by trainer/data/documents.py (stream windows,
or document packing with segment ids), then batched, sharded over processes and
made resumable by trainer/data/pipeline.py.
"""

import dataclasses
import functools
import pathlib

import grain
import jax
from absl import logging
from jax.sharding import NamedSharding

from trainer.base.errors import UserError
from trainer.data import arrays, mixture, pipeline, synthetic_pool, token_shards
from trainer.data.device_feed import DeviceFeed  # noqa: F401
from trainer.data.documents import PackedRows, StreamWindows
from trainer.data.pair_rows import PairRows, pairs_per_row
# The names the loop, job and tools use: `from trainer import data; data.build(...)`.
from trainer.data.pipeline import TrainIterator, eval_batches, to_global, train_iterator, warn_if_stalled  # noqa: F401
from trainer.data.text import TextCorpus, TextWindows, default_text_dir, load_text_corpus  # noqa: F401

SOURCES = ('text', 'array_record', 'mixture', 'arrays', 'synthetic')
CLASSIFIER_SOURCES = ('arrays', 'synthetic')
PACKED_KEYS = ('segment_ids', 'positions')
PACKED_POSITIONS = ('document', 'row')  # data.packed_positions: offsets within the document, or within the row.


def check_config(data_config) -> None:
  """The data.* values that can be judged without reading anything."""
  if data_config.source not in SOURCES:
    raise UserError(f'data.source={data_config.source!r}: choose one of {SOURCES}.')
  for key in ('worker_count', 'prefetch'):
    value = data_config[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
      raise UserError(f'data.{key}={value!r} must be an integer >= 0 (0 = off).')
  if data_config.source == 'mixture':
    folders, _ = mixture.parse(data_config)
    mixture.stages(data_config, 1, len(folders))
  if data_config.packing and data_config.source not in ('text', 'array_record', 'mixture'):
    raise UserError(f'data.packing=True packs documents of tokens; data.source={data_config.source!r} has none. '
                    f"Set data.packing=False, or use data.source='text', 'array_record' or 'mixture'.")


def batch_keys(data_config) -> tuple[str, ...]:
  """The keys of every LM batch: inputs and targets, plus segment ids and positions when packing, plus the
  targets' loss mask with data.loss_mask."""
  masked = ('loss_mask',) if data_config.get('loss_mask', False) else ()  # A run from before the key: none.
  tagged = ('source_ids',) if data_config.source == 'mixture' else ()  # Each row's source, for the loss per source.
  return ('inputs', 'targets') + (PACKED_KEYS if data_config.packing else ()) + masked + tagged


def mixture_names(data_config) -> tuple[str, ...]:
  """The names of a mixture's sources (their folders' names); () for any other source."""
  if data_config.source != 'mixture':
    return ()
  return tuple(pathlib.Path(folder).name for folder in mixture.parse(data_config)[0])


@dataclasses.dataclass(frozen=True)
class Needs:
  """What the input side reads besides config.data: a few model and train settings, taken once (`Needs.of`)."""
  task: str  # model.task: an 'lm' reads tokens, a 'classifier' images and labels.
  model_name: str  # model.name, for the message when the task and the source disagree.
  vocab_size: int  # model.vocab_size: synthetic tokens, and the bound a prepared folder's vocabulary must fit in.
  num_classes: int | None  # model.num_classes: a classifier's labels.
  pretrained: bool  # model.init_from is set: a vocabulary too large is fixed by its tokenizer, not model.vocab_size.
  batch_size: int  # train.batch_size, the global batch.
  seed: int  # train.seed: shuffling and synthetic draws.
  steps: int  # train.steps: a mixture's staged weights are described over the run.
  eval_batches: int  # train.eval_batches.
  objective: str = 'task'  # train.objective: 'dpo' reads rows of preference pairs (trainer/data/pair_rows.py).

  @classmethod
  def of(cls, model, train) -> 'Needs':
    """From config.model and config.train."""
    return cls(task=model.task, model_name=model.name, vocab_size=model.vocab_size,
               num_classes=model.get('num_classes'), pretrained=bool(model.get('init_from')),
               batch_size=train.batch_size, seed=train.seed, steps=train.steps, eval_batches=train.eval_batches,
               objective=train.get('objective', 'task'))  # A run's config.json from before the key: its task's.


def check_task(d, needs: Needs) -> None:
  """The data source fits model.task: tokens for an 'lm', images and labels for a 'classifier'."""
  task = needs.task
  if task == 'lm' and d.source == 'arrays':
    raise UserError(f"data.source='arrays' gives images and labels for classification, but model.task='lm': "
                    f"model.name={needs.model_name!r} is a language model; use data.source='text', 'array_record' "
                    f"or 'synthetic', or set model.task='classifier' with an image model.")
  if task == 'classifier':
    if d.source not in CLASSIFIER_SOURCES:
      raise UserError(f"data.source={d.source!r} gives tokens, but model.task='classifier' trains on images and "
                      f"labels; set --config.data.source=arrays (with data.path to an .npz) or "
                      f"--config.data.source=synthetic.")
    arrays.check_image_shape(d.image_shape)


@dataclasses.dataclass
class Inputs:
  train: TrainIterator  # This process's rows of each global batch, numpy; checkpointed with the state.
  eval_batches: list[dict[str, jax.Array]]  # Fixed held-out global batches, already on the batch sharding.
  description: str  # One line for the log: what is read from where, and how much.
  # A mixture: each source's own held-out batches, by source name (their union is `eval_batches`).
  eval_by_source: dict[str, list[dict[str, jax.Array]]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Sources:
  train: object  # Random-access Grain sources (len, getitem).
  eval: object | None
  description: str
  mixed: list | None = None  # data.source='mixture': its mixture.Source list (`train` is then the first's rows).


def load_sources(config) -> Sources:
  """`read_sources` of a whole config (tools and tests)."""
  return read_sources(config.data, Needs.of(config.model, config.train))


def read_sources(d, needs: Needs) -> Sources:
  """Reads or opens the configured source and cuts it into train and eval examples; checks it before training."""
  check_config(d)
  if d.source == 'arrays':
    loaded = arrays.load_arrays(d)
    arrays.check_arrays(loaded, d.image_shape, needs.num_classes, d.path)
    n = len(loaded['labels'])
    train = arrays.ArrayExamples(loaded, arrays.split_rows(n, d.eval_percent, 'train'))
    eval_ = arrays.ArrayExamples(loaded, arrays.split_rows(n, d.eval_percent, 'eval'))
    shape = 'x'.join(map(str, loaded['images'].shape[1:]))
    return Sources(train, eval_ if len(eval_) else None,
                   f'{len(train)} train / {len(eval_)} held-out images ({shape}) with labels from {d.path}')
  if d.source == 'synthetic' and needs.task == 'classifier':
    shape, classes, seed = tuple(d.image_shape), needs.num_classes, needs.seed
    return Sources(arrays.SyntheticImages(shape, classes, seed, template_seed=seed),
                   arrays.SyntheticImages(shape, classes, seed + 1, template_seed=seed, num_examples=1 << 16),
                   f"synthetic images ({'x'.join(map(str, shape))}, {classes} classes: class templates plus noise)")
  if d.source == 'synthetic':
    vocab = needs.vocab_size
    return Sources(arrays.SyntheticTokens(d.seq_len, vocab, needs.seed),
                   arrays.SyntheticTokens(d.seq_len, vocab, needs.seed + 1, num_examples=1 << 16),
                   f'synthetic random tokens (vocab {vocab}, seq_len {d.seq_len})')
  if d.source == 'mixture':
    return _mixture_sources(d, needs)
  if needs.objective == 'dpo':
    return _pair_sources(d, needs)
  if d.source == 'text':
    corpus = load_text_corpus(d)
    train_docs, eval_docs = corpus.documents('train'), corpus.documents('eval')
    held = (f'{corpus.num_eval_files} held out' if corpus.num_eval_files or not corpus.eval_tokens.size else
            f'the last {d.eval_percent}% of their bytes held out')  # Too few files to hold any out (text.py).
    where = (f'{corpus.num_train_files} train files ({corpus.train_tokens.size} bytes), {held} '
             f'({corpus.eval_tokens.size} bytes) from {corpus.root}')
    if not d.eval_percent:
      eval_docs = None
  else:
    train_docs, eval_docs, where = _token_shards(d, needs)
  cut = _cutter(d, _check_loss_mask(d, train_docs))
  train = cut(train_docs, 'train')
  eval_ = cut(eval_docs, 'eval') if eval_docs is not None and eval_docs.num_tokens else None
  how = f'packed by document into rows of {d.seq_len}' if d.packing else f'windows of {d.seq_len} over the stream'
  return Sources(train, eval_, f'{where}; {how}')


def _pair_sources(d, needs: Needs) -> Sources:
  """train.objective='dpo': the prepared pairs of data.path, one a row of data.seq_len."""
  train_docs, eval_docs, where = _token_shards(d, needs)
  if not token_shards.read_meta(pathlib.Path(d.path)).get('pairs'):
    raise UserError(f"train.objective='dpo' trains on preference pairs, but data.path={d.path!r} holds other "
                    f'documents: prepare {{"prompt", "chosen", "rejected"}} JSONL with scripts/prepare_data.py.')
  most = pairs_per_row(d)
  train = PairRows(train_docs, d.seq_len, 'train', most)
  eval_ = PairRows(eval_docs, d.seq_len, 'eval', most) if eval_docs is not None and eval_docs.num_tokens else None
  how = f'up to {most} pairs' if most > 1 else 'one pair'
  return Sources(train, eval_, f'{where.replace("documents", "answers")}; {how} a row of {d.seq_len}')


def _cutter(d, masked: bool):
  """documents, split -> rows of data.seq_len, packed or windows, with the packed rows' document bound checked."""
  if d.packing:
    positions = d.get('packed_positions', 'document')  # A run's config.json from before the key has none.
    if positions not in PACKED_POSITIONS:
      raise UserError(f'data.packed_positions={positions!r}: choose one of {PACKED_POSITIONS}.')
    make = functools.partial(PackedRows, positions=positions, loss_mask=masked)
  else:
    make = functools.partial(StreamWindows, loss_mask=masked)

  def cut(documents, split):
    rows = make(documents, d.seq_len)
    if d.packing:
      _check_documents_per_row(rows, d, split)
    return rows
  return cut


def _mixture_sources(d, needs: Needs) -> Sources:
  folders, _ = mixture.parse(d)
  cut = _cutter(d, bool(d.get('loss_mask', False)))
  mixed = mixture.load(folders, needs.vocab_size, bool(d.eval_percent),
                       lambda documents: cut(documents, f'{documents.name}'), bool(d.get('loss_mask', False)))
  how = f'packed by document into rows of {d.seq_len}' if d.packing else f'windows of {d.seq_len} over the stream'
  stage_list = mixture.stages(d, needs.batch_size, len(mixed))
  description = mixture.describe(mixed, stage_list, needs.batch_size, needs.steps, d.seq_len)
  return Sources(mixed[0].train, None, f'{description}; {how}', mixed=mixed)


def _check_loss_mask(d, documents) -> bool:
  """Whether batches carry a loss mask: data.loss_mask, which needs documents that have one."""
  if not d.get('loss_mask', False):
    if getattr(documents, 'has_mask', False):
      logging.warning('%s carry a loss mask (fine-tuning data), but data.loss_mask=False: every token is trained, '
                      'prompts too. Set --config.data.loss_mask=True to train on completions only.', documents.name)
    return False
  if not getattr(documents, 'has_mask', False):
    raise UserError(f"data.loss_mask=True needs documents with a loss mask: shards that scripts/prepare_data.py wrote "
                    f"from prompt/completion JSONL (data.source='array_record'); {documents.name} have none.")
  return True


def _check_documents_per_row(rows: PackedRows, d, split: str) -> None:
  """UserError when a packed row of `split` holds more documents than data.max_documents_per_row.

  Checked on every platform, so that a config that packs on a laptop also packs on a GPU, where cuDNN's attention
  is sized by that bound (trainer/attention/cudnn.py) and a row past it would lose its last documents.
  """
  most, row = rows.most_documents_per_row()
  if most > d.max_documents_per_row:
    raise UserError(f'data.max_documents_per_row={d.max_documents_per_row}, but packed row {row} of the {split} split '
                    f'holds {most} documents. Set --config.data.max_documents_per_row={most} (or more), or lower '
                    f'data.seq_len.')


def _token_shards(d, needs: Needs):
  if not d.path:
    raise UserError("data.source='array_record' needs data.path: a folder written by scripts/prepare_data.py.")
  root = pathlib.Path(d.path)
  train_docs = token_shards.load_documents(root, 'train')
  if train_docs is None:
    raise UserError(f'data.path={str(root)!r} has no train split; {token_shards.REPREPARE}.')
  vocab = token_shards.read_meta(root)['vocab_size']
  if vocab > needs.vocab_size:
    fix = ("prepare the data with model.init_from's own tokenizer (scripts/prepare_data.py --tokenizer=FOLDER)"
           if needs.pretrained else f'set --config.model.vocab_size={vocab} (or more)')
    raise UserError(f'the shards in {str(root)!r} use a vocabulary of {vocab} tokens but model.vocab_size='
                    f'{needs.vocab_size}; {fix}.')
  eval_docs = token_shards.load_documents(root, 'eval') if d.eval_percent else None
  return train_docs, eval_docs, (f'{len(train_docs.lengths)} train documents ({train_docs.num_tokens} tokens), '
                                 f'{0 if eval_docs is None else len(eval_docs.lengths)} held out, from {root}')


def train_iterator_for(config, process_index: int = 0, process_count: int = 1) -> TrainIterator:
  """Just the resumable train iterator of a whole `config` (tools and tests that save or restore a data position)."""
  needs = Needs.of(config.model, config.train)
  return _train_iterator(config.data, needs, read_sources(config.data, needs), process_index, process_count)


def _train_iterator(d, needs: Needs, sources: Sources, process_index: int, process_count: int) -> TrainIterator:
  if d.source == 'synthetic':  # Never the bottleneck of a benchmark: a pool of batches drawn once.
    return synthetic_pool.pooled_train_iterator(sources.train, needs.batch_size, needs.seed,
                                                process_index, process_count,
                                                {'source': d.source, 'packing': d.packing, 'seq_len': d.seq_len})
  if sources.mixed is not None:
    return mixture.MixtureIterator([s.train for s in sources.mixed], d, needs.batch_size, needs.seed,
                                   process_index, process_count,
                                   mixture.stages(d, needs.batch_size, len(sources.mixed)),
                                   {'source': d.source, 'packing': d.packing,
                                    'sources': [[s.path, len(s.train)] for s in sources.mixed]})
  return train_iterator(sources.train, d, needs.batch_size, needs.seed, process_index, process_count,
                        {'source': d.source, 'packing': d.packing})


def accounting(d, needs: Needs, inputs: Inputs) -> 'mixture.Accounting | None':
  """A mixture's per-source accounting for the loop (tokens seen, eval loss per source); None for one source."""
  if d.source != 'mixture':
    return None
  return mixture.Accounting(list(mixture_names(d)), inputs.train, needs.batch_size, d.seq_len, inputs.eval_by_source)


def _mixture_evals(needs: Needs, sources: Sources, batch_shardings, process_index: int, process_count: int):
  """({source name: its held-out global batches}, the description) of a mixture; ({}, description) otherwise."""
  by_source, batch_size = {}, needs.batch_size
  for i, source in enumerate(sources.mixed or ()):
    if source.eval is not None and needs.eval_batches and len(source.eval) >= batch_size:
      held_out = grain.MapDataset.source(source.eval).map(functools.partial(mixture.tag, source=i))
      by_source[source.name] = [to_global(b, batch_shardings, process_count) for b in eval_batches(
          held_out, batch_size, needs.eval_batches, process_index, process_count)]
  unevaluated = [s.name for s in sources.mixed or () if s.name not in by_source]
  if unevaluated and needs.eval_batches:
    return by_source, (f'{sources.description}; no eval for {unevaluated} (fewer held-out rows than '
                       f'train.batch_size)')
  return by_source, sources.description


def build(d, needs: Needs, batch_shardings: dict[str, NamedSharding], process_index: int,
          process_count: int) -> Inputs:
  """Everything the loop reads of config.data (`d`) and `needs`: the resumable train iterator, the eval batches and
  a description."""
  batch_size = needs.batch_size
  check_task(d, needs)
  sources = read_sources(d, needs)
  shorter = 'lower train.batch_size' if needs.task == 'classifier' else 'lower data.seq_len or train.batch_size'
  if sources.mixed is None:  # A mixture's sources repeat endlessly: one row each is enough (mixture.load).
    pipeline.check_enough(sources.train, batch_size, f'the train split ({sources.description})',
                          f'add data, or {shorter}.')
  train = _train_iterator(d, needs, sources, process_index, process_count)
  by_source, description = _mixture_evals(needs, sources, batch_shardings, process_index, process_count)
  evals = [b for batches in by_source.values() for b in batches]
  if sources.eval is not None and needs.eval_batches:
    pipeline.check_enough(sources.eval, batch_size, f'the held-out split ({sources.description})',
                          f'add data, {shorter}, or set data.eval_percent=0.')
    evals = [to_global(b, batch_shardings, process_count) for b in eval_batches(
        sources.eval, batch_size, needs.eval_batches, process_index, process_count)]
  rows = sum(len(m.train) for m in sources.mixed) if sources.mixed else len(sources.train)
  description = (f'{description}; {rows} train examples, {len(evals)} eval batches; '
                 f'{d.worker_count} worker process(es), {d.num_threads} read threads, prefetch {d.prefetch}')
  return Inputs(train, evals, description, by_source)

