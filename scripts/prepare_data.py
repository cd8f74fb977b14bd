"""Turns a corpus into ArrayRecord token shards for `data.source='array_record'` (or one source of `data.mixture`).

  python scripts/prepare_data.py --input=DIR|FILE --output=OUT [--glob='**/*.txt'] [--tokenizer=FILE]
      [--text_column=text] [--split=train] [--workers=4] [--vocab_size=N | --model=HF_FOLDER|configs/X.py]
      [--num_shards=8] [--eval_percent=5]

--input is a folder of text files or .npy token arrays, a Parquet file or a
folder of them, a Hugging Face `save_to_disk` folder, or a .jsonl file; rows of
Parquet, arrow and JSONL are documents, their text in --text_column
(trainer/data/corpus_formats.py). Tokenizing runs in --workers processes with a
progress line and tokens/s; interrupted, the same command again resumes where it
stopped (trainer/data/tokenize_job.py). meta.json records each split's document
and token counts. --vocab_size or --model (a Hugging Face model folder, or a
configs/*.py file) gives the model's vocabulary: a tokenizer larger than it is
refused. User errors end in one line and exit status 2.

--input=FILE.jsonl reads fine-tuning pairs instead: one {"prompt": ...,
"completion": ...} object a line, or a chat {"messages": [...]} rendered with the
tokenizer's chat template, each a document whose tokens carry a loss mask (1 on
the completion and its EOS or on the assistant turns, 0 on the rest;
trainer/data/finetune_jsonl.py),
for runs with --config.data.loss_mask=True (configs/finetune_llama.py). A .jsonl
file whose first line has "chosen" and "rejected" is preference pairs for
--config.train.objective=dpo (trainer/data/preference_jsonl.py, docs/dpo.md):
each pair two documents, the prompt with each answer, the answer masked.

Each input file is one document. Text is tokenized as raw bytes (vocabulary
256) unless --tokenizer names a LOCAL tokenizer: a Hugging Face model folder
holding tokenizer.json, or a tokenizer.json file (the tokenizers package; BOS and
EOS around each document as the tokenizer_config.json beside it says; the files
are kept in OUT/tokenizer/ for scripts/export_hf.py and scripts/sample.py), a
SentencePiece model (`*.model`, needs the sentencepiece package) or a tiktoken BPE
file (`*.tiktoken`, needs tiktoken; the cl100k split pattern is used). Nothing is
downloaded. `.npy` files (1-D integer arrays) are taken as tokens already.
A hash of each file's path holds --eval_percent of the files out as the eval
split. Documents of fewer than 2 tokens (no next-token target) are skipped and
counted. A .jsonl file is fine-tuning data when its first line has "prompt" or
"messages", unless --text_column is given. OUT appears only when complete: the
run works in OUT.partial/ and renames its result (trainer/data/staged_output.py).
Ctrl-C, SIGTERM and SIGHUP end it with one line and exit status 128 + the signal,
what was tokenized kept for the same command to resume. Then train with:

  python launch.py --config=configs/default.py --workdir=W --config.data.source=array_record --config.data.path=OUT
"""

import argparse
import dataclasses
import json
import multiprocessing
import multiprocessing.util
import os
import pathlib
import shutil
import signal
import sys
import zlib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from trainer.safety.startup_signals import STOP_SIGNALS  # noqa: E402 - light: in place before numpy loads.


@dataclasses.dataclass
class _Run:
  """What the line of a stop signal reports: this run's stage (trainer/data/staged_output.py), once it has one."""
  stage: 'staged_output.Stage | None' = None
  stopping: bool = False  # A second signal while the first one's line is written changes nothing.


_RUN = _Run()


def _stopped_line(what: str) -> str:
  stage = _RUN.stage
  if stage is None:
    return f'prepare_data.py: interrupted by {what} before anything was written; run the same command again.'
  if stage.published:
    return f'prepare_data.py: interrupted by {what} after {stage.out} was complete; it is intact.'
  kept = stage.chunks()
  if not kept:
    stage.discard_if_empty()
    return (f'prepare_data.py: interrupted by {what}: nothing was written to {stage.out} nor kept; run the same '
            f'command again.')
  return (f'prepare_data.py: interrupted by {what}: nothing was written to {stage.out} yet; {kept} tokenized '
          f'chunk(s) are kept in {stage.work}: run the same command again to resume.')


def _on_stop_signal(signum, frame) -> None:  # noqa: ARG001
  """One line and exit 128 + signum at once, as launch.py's start-up (trainer/safety/startup_signals.py): whatever
  was being written is a .tmp chunk or the stage's output/, both redone by the rerun."""
  if _RUN.stopping:
    return
  _RUN.stopping = True
  workers = multiprocessing.active_children()  # The tokenizer workers, which ignore stop signals.
  for worker in workers:
    os.kill(worker.pid, signal.SIGKILL)
  try:
    for worker in workers:
      worker.join(5)  # Gone before the chunks are counted: one could be renaming its chunk as it was killed.
    what = 'Ctrl-C (SIGINT)' if signum == signal.SIGINT else signal.Signals(signum).name
    os.write(2, (_stopped_line(what) + '\n').encode())  # Not print(): the main thread may hold sys.stderr's lock.
    # The pool's semaphores, unlinked as at a normal exit (their finalizers' priority is 0): otherwise
    # multiprocessing's resource tracker finds them leaked once this process is gone and warns on stderr.
    multiprocessing.util._run_finalizers(0)  # noqa: SLF001 - no public call runs them without a full shutdown.
  finally:
    os._exit(128 + signum)


if __name__ == '__main__':
  for stop_signal in STOP_SIGNALS:
    signal.signal(stop_signal, _on_stop_signal)

import numpy as np  # noqa: E402

from trainer.base import confined  # noqa: E402
from trainer.base.errors import UserError  # noqa: E402
from trainer.data import (corpus_formats, finetune_jsonl, hf_tokenizer, preference_jsonl,  # noqa: E402
                          staged_output, token_shards, tokenize_job)

load_tokenizer = tokenize_job.load_tokenizer  # The name other scripts and tests use.


class UserExit(SystemExit):
  """Exit status 2 (a retry cannot fix it), whose text is the one line printed, for callers that catch it."""

  def __init__(self, message: str):
    super().__init__(2)
    self.message = message

  def __str__(self) -> str:
    return self.message


def read_finetune_jsonl(path: pathlib.Path, tokenizer_path: str | None, encode, tokenizer: str, reader=finetune_jsonl):
  """(name, tokens, loss mask) per prompt/completion line (`reader`=preference_jsonl: (name, chosen, rejected) per
  pair); a Hugging Face tokenizer adds its document prefix (BOS) before the prompt and its EOS after the completion."""
  if not path.is_file():
    raise UserError(f'--input={str(path)!r} is not a file; give a .jsonl file of {{"prompt", "completion"}} lines.')
  prefix, end, render = (), (), None
  if tokenizer.startswith('hf:'):
    tok = hf_tokenizer.load(tokenizer_path)
    encode = lambda text: tok.encode(text, document=False)
    prefix, end = tok.prefix, ((tok.eos_id,) if tok.eos_id is not None else tok.suffix)
    render = tok.render_chat if tok.chat_template else None
  return reader.read(path, lambda text: np.asarray(encode(text)).tolist(), prefix, end, render)


def model_vocab_size(model: str) -> int:
  """The vocabulary of --model: a Hugging Face model folder (config.json) or a configs/*.py file."""
  path = pathlib.Path(model)
  if path.is_dir() and (path / 'config.json').is_file():
    vocab = json.loads(confined.inside(path, 'config.json', '--model').read_text()).get('vocab_size')
  elif path.suffix == '.py' and path.is_file():
    import importlib.util
    spec = importlib.util.spec_from_file_location('model_config', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    vocab = module.get_config().model.vocab_size
  else:
    raise UserError(f'--model={model!r} is neither a Hugging Face model folder (with config.json) nor a configs/*.py '
                    f'file; give one, or give --vocab_size.')
  if not isinstance(vocab, int) or vocab <= 0:
    raise UserError(f'--model={model!r} names no vocab_size; give --vocab_size instead.')
  return vocab


def check_vocabulary(args, tokenizer_vocab: int, tokenizer: str) -> int | None:
  """The model's vocabulary from --vocab_size / --model (None without either); refuses a larger tokenizer."""
  limits = [(v, f) for v, f in ((args.vocab_size, '--vocab_size'), (args.model and model_vocab_size(args.model),
                                                                     f'--model={args.model}')) if v]
  if not limits:
    return None
  vocab, flag = min(limits)
  if tokenizer != 'bytes' and tokenizer_vocab > vocab:
    raise UserError(f'the tokenizer ({tokenizer}) has {tokenizer_vocab} tokens but {flag} gives a vocabulary of '
                    f'{vocab}: its ids would index past the embedding table. Use the model\'s own tokenizer, or a '
                    f'model with model.vocab_size >= {tokenizer_vocab}.')
  return vocab


def _tokenizer_files(path: str | None, tokenizer: str) -> list[pathlib.Path]:
  """The files of --tokenizer: kept with the shards, and part of what a resume checks is unchanged."""
  if tokenizer.startswith('hf:'):
    return list(hf_tokenizer.load(path).files)
  return [] if tokenizer == 'bytes' else [pathlib.Path(path)]


def _tokenized_corpus(args, source: pathlib.Path, out: pathlib.Path, tokenizer: str,
                      tokenizer_files: list[pathlib.Path]):
  """Reads and tokenizes the corpus into the stage's chunks (resumable); returns (stage, chunk count, format)."""
  kind = corpus_formats.detect(source, args.glob)
  if kind in ('files', 'parquet') and source.is_dir() and source.resolve() in staged_output.stage_path(out).parents:
    raise UserError(f'--output={args.output!r} is inside --input={args.input!r}, whose files would then include '
                    f'the run\'s own; choose a folder outside it.')
  settings = {'input': str(source.resolve()), 'format': kind, 'glob': args.glob, 'tokenizer': tokenizer,
              'text_column': args.text_column or 'text', 'split': args.split, 'eval_percent': args.eval_percent,
              'chunk_docs': args.chunk_docs}
  files = corpus_formats.input_files(source, kind, args.glob, args.split) + tokenizer_files
  _RUN.stage = stage = staged_output.open_stage(out, settings, staged_output.identity(files))
  replaced = corpus_formats.Replaced()
  documents = corpus_formats.read(source, kind, args.glob, args.text_column or 'text', args.split,
                                  replaced=replaced)
  try:
    count = tokenize_job.tokenize(documents, stage.work, args.tokenizer, args.eval_percent, args.chunk_docs,
                                  args.workers, tokenize_job.Progress())
  except UserError:
    stage.discard()  # Bad input: fixing it changes the input, which a resume of these chunks would refuse.
    raise
  staged_output.check_unchanged(stage, staged_output.identity(files))
  if warning := replaced.warning():
    print(f'prepare_data.py: warning: {warning}', file=sys.stderr)
  return stage, count, kind


def _write_chunks(out: pathlib.Path, work: pathlib.Path, count: int, vocab_size: int | None, tokenizer: str,
                  num_shards: int) -> tuple[dict, int]:
  """The shards of every chunk's documents of 2 tokens or more; returns (meta, documents skipped)."""
  lengths, skipped, largest, smallest = {'train': [], 'eval': []}, 0, -1, 0
  for tokens, lens, held_out in tokenize_job.read_chunks(work, count):
    kept = lens >= 2
    skipped += int((~kept).sum())
    for split, where in (('train', kept & ~held_out), ('eval', kept & held_out)):
      lengths[split].append(lens[where])
    if tokens.size:
      largest, smallest = max(largest, int(tokens.max())), min(smallest, int(tokens.min()))
  lengths = {split: np.concatenate(parts) if parts else np.zeros(0, np.int64) for split, parts in lengths.items()}
  total = sum(len(v) for v in lengths.values())
  if not total:
    raise UserError(f'every document of the corpus has fewer than 2 tokens ({skipped} read); nothing to train on.')
  if not len(lengths['train']):
    raise UserError(f'all {total} documents fell in the eval split; lower --eval_percent or add documents.')
  vocab_size = vocab_size or (largest + 1 if tokenizer == 'bytes' and largest >= 256 else
                              (256 if tokenizer == 'bytes' else None))
  if largest >= vocab_size or smallest < 0:
    raise UserError(f'token ids must lie in [0, {vocab_size}) but reach {largest}; set --vocab_size.')
  dtype = token_shards.token_dtype(vocab_size)
  meta = token_shards.new_meta(vocab_size, tokenizer, dtype)
  for split in ('train', 'eval'):
    if len(lengths[split]):
      records = _records(work, count, split == 'eval')
      meta['splits'][split] = token_shards.write_split(out, split, lengths[split], records, num_shards, dtype)
  meta['skipped_documents'] = skipped
  return meta, skipped


def _records(work: pathlib.Path, count: int, eval_split: bool):
  for tokens, lens, held_out in tokenize_job.read_chunks(work, count):
    ends = np.cumsum(lens)
    for end, n, out in zip(ends, lens, held_out):
      if n >= 2 and out == eval_split:
        yield tokens[end - n:end]


def _finetune(args, source: pathlib.Path, out: pathlib.Path, encode, tokenizer_vocab: int, tokenizer: str,
              vocab_size: int | None) -> tuple[dict, int]:
  """Writes the fine-tuning examples into `out` (the stage's output folder); returns (meta, lines skipped)."""
  pairs = next((preference_jsonl.is_preference_record(r) for _, r in corpus_formats.json_lines(source)), False)
  if pairs:  # Each pair as two documents in a row, named alike so that both fall in one split.
    docs = [(name, *doc) for name, *both in read_finetune_jsonl(source, args.tokenizer, encode, tokenizer,
                                                               preference_jsonl) for doc in both]
  else:
    docs = read_finetune_jsonl(source, args.tokenizer, encode, tokenizer)
  kept = [(name, tokens, mask) for name, tokens, mask in docs if len(tokens) >= 2]
  if not kept:
    raise UserError(f'every line of --input={args.input!r} has fewer than 2 tokens; nothing to train on.')
  largest = max(int(tokens.max()) for _, tokens, _ in kept)
  vocab_size = vocab_size or (tokenizer_vocab if tokenizer != 'bytes' or largest < 256 else largest + 1)
  if largest >= vocab_size or min(int(tokens.min()) for _, tokens, _ in kept) < 0:
    raise UserError(f'token ids must lie in [0, {vocab_size}) but reach {largest}; set --vocab_size.')
  splits, masks = {'train': [], 'eval': []}, {'train': [], 'eval': []}
  for name, tokens, mask in kept:
    split = 'eval' if zlib.crc32(name.encode()) % 100 < args.eval_percent else 'train'
    splits[split].append(tokens)
    masks[split].append(mask)
  if not splits['eval']:
    del splits['eval']
  if not splits.get('train'):
    raise UserError(f'all {len(kept)} documents fell in the eval split; lower --eval_percent or add lines.')
  meta = token_shards.write_shards(out, splits, vocab_size, tokenizer, args.num_shards, masks)
  meta['trained_tokens'] = sum(int(m.sum()) for split in splits for m in masks[split])
  meta['skipped_documents'] = len(docs) - len(kept)
  if pairs:
    meta['pairs'] = True  # trainer/data/pair_rows.py reads documents 2i and 2i + 1 as pair i.
  token_shards.write_meta(out, meta)
  return meta, len(docs) - len(kept)


def _prepare(args, source: pathlib.Path, out: pathlib.Path) -> tuple[dict, int, str]:
  """Writes the shards into the stage and renames them to --output; returns (meta, documents skipped, tokenizer)."""
  if args.chunk_docs < 1:
    raise UserError(f'--chunk_docs={args.chunk_docs} must be at least 1.')
  encode, tokenizer_vocab, tokenizer = load_tokenizer(args.tokenizer)
  vocab_size = check_vocabulary(args, tokenizer_vocab, tokenizer)
  if tokenizer != 'bytes':
    vocab_size = max(vocab_size or 0, tokenizer_vocab)
  tokenizer_files = _tokenizer_files(args.tokenizer, tokenizer)
  if source.suffix == '.jsonl' and source.is_file() and corpus_formats.is_finetune_jsonl(source, args.text_column):
    # Read whole and written at once: nothing to resume, so the stage holds only the output being written.
    _RUN.stage = stage = staged_output.open_stage(out, {'input': str(source.resolve()), 'format': 'finetune'}, [])
    meta, skipped = _finetune(args, source, stage.fresh_output(), encode, tokenizer_vocab, tokenizer, vocab_size)
  else:
    stage, count, kind = _tokenized_corpus(args, source, out, tokenizer, tokenizer_files)
    meta, skipped = _write_chunks(stage.fresh_output(), stage.work, count, vocab_size, tokenizer, args.num_shards)
    meta['source'] = {'input': str(source.resolve()), 'format': kind}
  # Kept with the data: export_hf.py ships them, sample.py encodes and decodes with them.
  if tokenizer_files:
    kept = stage.output / 'tokenizer'
    kept.mkdir()
    for file in tokenizer_files:
      confined.copy(file, kept / file.name)  # hf_tokenizer.load kept each to its folder.
    # What data.mixture and an imported model compare: the same files wherever they were read from.
    meta['tokenizer_sha256'] = hf_tokenizer.files_sha256(kept.iterdir())
  token_shards.write_meta(stage.output, meta)
  stage.publish()
  return meta, skipped, tokenizer


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--input', required=True)
  parser.add_argument('--output', required=True)
  parser.add_argument('--glob', default='**/*')
  parser.add_argument('--tokenizer', default=None)
  parser.add_argument('--text_column', default=None,
                      help='Parquet/arrow column or JSONL field holding the text (default: text); given, a .jsonl '
                           'file is read as documents even where its lines have "prompt" or "messages"')
  parser.add_argument('--split', default='train', help='the split of a save_to_disk DatasetDict')
  parser.add_argument('--vocab_size', type=int, default=None,
                      help="the model's vocabulary: a larger tokenizer is refused (.npy input: default max+1)")
  parser.add_argument('--model', default=None, help='a Hugging Face model folder or configs/*.py: its vocabulary')
  parser.add_argument('--workers', type=int, default=min(4, os.cpu_count() or 1), help='tokenizer processes')
  parser.add_argument('--chunk_docs', type=int, default=1000, help='documents per unit of work (and of resume)')
  parser.add_argument('--num_shards', type=int, default=8)
  parser.add_argument('--eval_percent', type=int, default=5)
  args = parser.parse_args(argv)
  out, source = pathlib.Path(os.path.abspath(args.output)), pathlib.Path(args.input)  # '.' and '..' named.
  _RUN.stage = None  # main() is also called in-process, once per test.
  try:
    staged_output.check_output(out)
    meta, skipped, tokenizer = _prepare(args, source, out)
  except UserError as e:
    if _RUN.stage is not None:
      _RUN.stage.discard_if_empty()  # A run that kept nothing leaves nothing in the corrected command's way.
    print(f'prepare_data.py: error: {e}', file=sys.stderr)
    raise UserExit(f'prepare_data.py: error: {e}') from None
  except KeyboardInterrupt:  # Raised, not signalled: run as a script, Ctrl-C goes to _on_stop_signal.
    print(_stopped_line('Ctrl-C (SIGINT)'), file=sys.stderr)
    sys.exit(130)
  finally:
    if _RUN.stage is not None:
      _RUN.stage.close()  # Its lock: main() is also called in-process.
  counts = {split: f"{s['documents']} documents, {s['tokens']} tokens" for split, s in meta['splits'].items()}
  if 'trained_tokens' in meta:
    counts['trained'] = f"{meta['trained_tokens']} completion tokens"
  print(f"wrote {out}: {counts}; skipped {skipped} document(s) of fewer than 2 tokens; "
        f"vocab {meta['vocab_size']} ({tokenizer})")


if __name__ == '__main__':
  main()
