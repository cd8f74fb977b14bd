"""Tokenizing a corpus in worker processes, resumable: what scripts/prepare_data.py runs between reading and writing.

Documents are cut into chunks of `chunk_docs` in corpus order; each chunk is tokenized by a worker process (spawned,
so a parent that has imported jax is never forked) into `WORK/chunk-NNNNNN.npz` (tokens end to end, each document's
length, and whether the hash of its key holds it out for eval), written under a temporary name and renamed, so a
chunk file is either whole or absent. A rerun after an interruption finds the chunks already there and tokenizes
only the rest: the corpus is read again (cheap next to tokenizing) but its finished chunks are not sent to a worker.
A progress line on stderr gives the documents and tokens done and tokens/s.

Stop signals (Ctrl-C, SIGTERM, SIGHUP) are the parent's to answer (scripts/prepare_data.py: one line, the workers
killed, exit 128 + the signal). A worker ignores them, or Ctrl-C, which reaches the whole process group, would
print a KeyboardInterrupt traceback from each worker and break the pool under the parent. They are blocked while
a worker is spawned, so a new interpreter starts with them blocked and cannot take one before `_init_worker`
ignores them.
"""

import concurrent.futures
import dataclasses
import multiprocessing
import os
import pathlib
import signal
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from trainer.base import confined
from trainer.data.corpus_formats import Document

_ENCODE: Callable | None = None  # The worker's tokenizer, loaded once by `_init`.
# The signals scripts/prepare_data.py stops on (those of trainer/safety/startup_signals.py).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


def load_tokenizer(path: str | None):
  """(encode: str -> token ids, vocab_size, description) from a local file; bytes when `path` is None."""
  from trainer.data import file_tokenizers
  from trainer.data import hf_tokenizer
  if not path:
    return (lambda text: np.frombuffer(text.encode(), np.uint8)), 256, 'bytes'
  if hf_tokenizer.is_hf_tokenizer(path):
    tok = hf_tokenizer.load(path)
    return tok.encode, tok.vocab_size, f'hf:{pathlib.Path(path).resolve()}'
  tok = file_tokenizers.load(path)
  return tok.encode, tok.vocab_size, tok.name


def _init(tokenizer_path: str | None) -> None:
  global _ENCODE
  os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')  # One thread a worker: the workers are the parallelism.
  _ENCODE = load_tokenizer(tokenizer_path)[0]


def _init_worker(tokenizer_path: str | None) -> None:
  for signum in _STOP_SIGNALS:
    signal.signal(signum, signal.SIG_IGN)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # Blocked by the parent while it spawned this process.
  _init(tokenizer_path)


def _submit(pool, *args):
  """pool.submit, which may spawn a worker: with the stop signals blocked meanwhile, so it starts with them blocked
  (a signal that comes meanwhile reaches the parent as soon as they are unblocked)."""
  before = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
  try:
    return pool.submit(*args)
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, before)


def chunk_path(work: pathlib.Path, index: int) -> pathlib.Path:
  return work / f'chunk-{index:06d}.npz'


def _tokenize_chunk(index: int, docs: list[Document], eval_percent: int, work: pathlib.Path) -> tuple[int, int, int]:
  """Tokenizes one chunk into its file; returns (index, documents, tokens)."""
  pieces = [d.payload.astype(np.int64) if isinstance(d.payload, np.ndarray) else np.asarray(_ENCODE(d.payload),
                                                                                            np.int64)
            for d in docs]
  lengths = np.array([len(p) for p in pieces], np.int64)
  held_out = np.array([zlib.crc32(d.key) % 100 < eval_percent for d in docs], bool)
  tokens = np.concatenate(pieces).astype(np.int32) if pieces else np.zeros((0,), np.int32)  # Half of int64's disk.
  final = chunk_path(work, index)
  temporary = final.with_name(final.name + '.tmp.npz')
  with os.fdopen(confined.open_fd(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 'wb') as f:  # Not via a link.
    np.savez(f, tokens=tokens, lengths=lengths, held_out=held_out)
  os.replace(temporary, final)  # Atomic: an interrupted chunk leaves only a .tmp file, redone on the rerun.
  return index, len(docs), int(tokens.size)


def _chunks(documents: Iterable[Document], chunk_docs: int) -> Iterator[tuple[int, list[Document]]]:
  chunk, index = [], 0
  for doc in documents:
    chunk.append(doc)
    if len(chunk) == chunk_docs:
      yield index, chunk
      chunk, index = [], index + 1
  if chunk:
    yield index, chunk


@dataclasses.dataclass
class Progress:
  """The stderr progress line: documents and tokens tokenized now, and tokens/s."""
  stream: object = None  # None: sys.stderr at the time of printing.
  documents: int = 0
  tokens: int = 0
  chunks: int = 0
  resumed: int = 0  # Chunks found already tokenized.
  started: float = dataclasses.field(default_factory=time.perf_counter)
  _shown: float = 0.0
  _counts_shown: tuple = ()  # What the last line said, but its rate: a log file does not get the same line twice.

  @property
  def tokens_per_s(self) -> float:
    return self.tokens / max(time.perf_counter() - self.started, 1e-9)

  def add(self, documents: int, tokens: int) -> None:
    self.documents, self.tokens, self.chunks = self.documents + documents, self.tokens + tokens, self.chunks + 1
    self.show()

  def show(self, final: bool = False) -> None:
    """Every second: one line rewritten in place on a terminal, a new line (every 10 s) in a log file."""
    stream = self.stream or sys.stderr
    tty = getattr(stream, 'isatty', lambda: False)()
    now = time.perf_counter()
    if final or now - self._shown >= (1.0 if tty else 10.0):
      self._shown = now
      again = f', {self.resumed} chunk(s) kept from before' if self.resumed else ''
      line = (f'tokenized {self.documents} documents, {self.tokens} tokens in {self.chunks} chunk(s){again}: '
              f'{self.tokens_per_s:,.0f} tokens/s')
      counts = (self.documents, self.tokens, self.chunks, self.resumed)
      if final and not tty and counts == self._counts_shown:
        return  # Off a terminal the last chunk's line already said it all (a one-chunk corpus printed it twice).
      self._counts_shown = counts
      print(('\r' if tty else '') + line, end='\n' if final or not tty else '', file=stream, flush=True)


def tokenize(documents: Iterable[Document], work: pathlib.Path, tokenizer_path: str | None, eval_percent: int,
             chunk_docs: int, workers: int, progress: Progress) -> int:
  """Tokenizes every chunk not yet in `work` with `workers` processes (<= 1: in this process); returns the number
  of chunks of the corpus."""
  work.mkdir(parents=True, exist_ok=True)
  todo = _todo(_chunks(documents, chunk_docs), work, progress)
  first = next(todo, None)
  second = next(todo, None)
  if first is None:
    progress.show(final=True)
    return progress.resumed
  if workers <= 1 or second is None:  # One chunk left (small corpora, tests) does not pay for starting workers.
    _init(tokenizer_path)
    for index, docs in _chain(first, second, todo):
      progress.add(*_tokenize_chunk(index, docs, eval_percent, work)[1:])
  else:
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context('spawn'),
                                                initializer=_init_worker, initargs=(tokenizer_path,)) as pool:
      running = set()
      for index, docs in _chain(first, second, todo):
        running.add(_submit(pool, _tokenize_chunk, index, docs, eval_percent, work))
        if len(running) >= 2 * workers:  # Bounded: the corpus is never read far ahead of the workers.
          done, running = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
          for future in done:
            progress.add(*future.result()[1:])
      for future in concurrent.futures.as_completed(running):
        progress.add(*future.result()[1:])
  progress.show(final=True)
  return progress.chunks + progress.resumed


def _chain(first, second, rest):
  yield first
  if second is not None:
    yield second
  yield from rest


def _todo(chunks, work: pathlib.Path, progress: Progress):
  for index, docs in chunks:
    if chunk_path(work, index).is_file():
      progress.resumed += 1
      continue
    yield index, docs


def read_chunks(work: pathlib.Path, count: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """(tokens, lengths, held_out) of each chunk, in corpus order."""
  for index in range(count):
    with np.load(chunk_path(work, index)) as chunk:
      yield chunk['tokens'], chunk['lengths'], chunk['held_out']
