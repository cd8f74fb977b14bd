"""Measures data preparation and mixtures: prepare_data.py's tokens/s by worker count on a Parquet corpus, and the
loader's rows/s for a three-source mixture against one source of the same rows (a ratio, measured side by side).

  python benchmarks/bench_mixture.py --megabytes=50 --workers=1,2 [--tokenizer=tests/fixtures/hf/tokenizer]

The corpus is synthetic English-like text (words drawn from a fixed list) written as Parquet files with a `text`
column under --scratch; each prepare_data.py run is a fresh subprocess, timed end to end (reading, tokenizing,
writing the shards). Prints Markdown table rows.
"""

import argparse
import pathlib
import re
import shutil
import subprocess
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORDS = ('the of and to in is was for on that with as by at from his her an which were are this be had not or '
         'have one all their they there been has when who more will would can said time into some could them other '
         'model data training token parallel device mixture weight source corpus document parquet').split()


def make_corpus(root: pathlib.Path, megabytes: int, files: int = 8) -> int:
  """Parquet files of ~`megabytes` MB of text in documents of 200-4000 words; returns the text bytes."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  root.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(0)
  words = np.array(WORDS)
  total, per_file = 0, megabytes * 1_000_000 // files
  for f in range(files):
    texts, size = [], 0
    while size < per_file:
      text = ' '.join(words[rng.integers(0, len(words), int(rng.integers(200, 4000)))])
      texts.append(text)
      size += len(text)
    pq.write_table(pa.table({'text': texts}), root / f'part-{f:03d}.parquet')
    total += size
  return total


def prepare(corpus: pathlib.Path, out: pathlib.Path, workers: int, tokenizer: str | None,
            chunk_docs: int) -> tuple[float, int, str]:
  """(seconds end to end, tokens, the progress line's tokens/s) of one prepare_data.py run."""
  shutil.rmtree(out, ignore_errors=True)
  command = [sys.executable, str(REPO / 'scripts/prepare_data.py'), f'--input={corpus}', f'--output={out}',
             f'--workers={workers}', f'--chunk_docs={chunk_docs}', '--eval_percent=0'] + ([f'--tokenizer={tokenizer}'] if tokenizer else [])
  start = time.perf_counter()
  result = subprocess.run(command, capture_output=True, text=True, check=True)
  seconds = time.perf_counter() - start
  tokens = int(re.search(r"'train': '\d+ documents, (\d+) tokens'", result.stdout).group(1))
  rate = re.findall(r'([\d,]+) tokens/s', result.stderr)[-1]
  return seconds, tokens, rate


def loader_rows_per_s(folders: list[str], weights, batches: int) -> float:
  from configs import tiny
  from trainer import data
  config = tiny.get_config()
  config.data.update(source='mixture', mixture=tuple(zip(folders, weights)), packing=True, seq_len=512,
                     prefetch=0, worker_count=0)
  config.train.batch_size = 32
  it = data.train_iterator_for(config)
  next(it)  # Opening shards and starting threads is not the steady state.
  start = time.perf_counter()
  for _ in range(batches):
    next(it)
  it.close()
  return batches * config.train.batch_size / (time.perf_counter() - start)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--megabytes', type=int, default=50)
  parser.add_argument('--workers', default='1,2')
  parser.add_argument('--tokenizer', default=str(REPO / 'tests/fixtures/hf/tokenizer'))
  parser.add_argument('--scratch', default='/tmp/bench_mixture')
  parser.add_argument('--loader_batches', type=int, default=200)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--chunk_docs', type=int, default=200)
  args = parser.parse_args()
  scratch = pathlib.Path(args.scratch)
  corpus = scratch / 'corpus'
  shutil.rmtree(scratch, ignore_errors=True)
  size = make_corpus(corpus, args.megabytes)
  print(f'corpus: {size / 1e6:.1f} MB of text in Parquet ({sum(p.stat().st_size for p in corpus.iterdir()) / 1e6:.1f}'
        f' MB on disk), tokenizer {args.tokenizer}')
  print('| workers | end to end (s) | tokens | tokens/s end to end | tokens/s while tokenizing |')
  print('|---|---|---|---|---|')
  for workers in map(int, args.workers.split(',')):
    seconds, tokens, rate = prepare(corpus, scratch / f'out-{workers}', workers, args.tokenizer, args.chunk_docs)
    print(f'| {workers} | {seconds:.1f} | {tokens} | {tokens / seconds:,.0f} | {rate} |', flush=True)
  # The loader: three sources cut from the prepared corpus by thirds of its files, against the whole as one.
  parts = []
  for i, files in enumerate(np.array_split(sorted(corpus.iterdir()), 3)):
    part = scratch / f'part{i}'
    part.mkdir()
    for f in files:
      shutil.copy(f, part / f.name)
    subprocess.run([sys.executable, str(REPO / 'scripts/prepare_data.py'), f'--input={part}',
                    f'--output={scratch / f"src{i}"}', '--workers=1', '--eval_percent=0',
                    f'--tokenizer={args.tokenizer}'], check=True, capture_output=True)
    parts.append(str(scratch / f'src{i}'))
  whole = str(scratch / f'out-{args.workers.split(",")[0]}')
  ratios = []
  print('| repeat | one source rows/s | 3-source mixture rows/s | mixture / one |')
  print('|---|---|---|---|')
  loader_rows_per_s([whole], (1.0,), 5)  # Imports and first-use costs, outside the comparison.
  for r in range(args.repeats):  # Alternating which goes first, so neither always gets the warmer cache.
    if r % 2:
      mixed = loader_rows_per_s(parts, (0.5, 0.3, 0.2), args.loader_batches)
      one = loader_rows_per_s([whole], (1.0,), args.loader_batches)
    else:
      one = loader_rows_per_s([whole], (1.0,), args.loader_batches)
      mixed = loader_rows_per_s(parts, (0.5, 0.3, 0.2), args.loader_batches)
    ratios.append(mixed / one)
    print(f'| {r + 1} | {one:,.0f} | {mixed:,.0f} | {mixed / one:.2f} |', flush=True)
  print(f'median ratio mixture / one source: {np.median(ratios):.2f}')


if __name__ == '__main__':
  main()
