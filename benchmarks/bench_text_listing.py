"""How long does listing the default text corpus take? One pathlib glob vs the listing the loader uses.

  python benchmarks/bench_text_listing.py [--text_dir=DIR] [--file_glob='**/*.py'] [--repeats=5]

Both list the files under text_dir (default: this Python's standard library) that match file_glob and lie outside
site-packages/dist-packages; the script checks the two lists are equal and prints the best of --repeats for each.
"""

import argparse
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from trainer.data import text  # noqa: E402


def one_glob(root: pathlib.Path, file_glob: str) -> list[pathlib.Path]:
  return sorted(p for p in root.glob(file_glob)
                if p.is_file() and not {'site-packages', 'dist-packages'} & set(p.relative_to(root).parts))


def best_of(fn, repeats: int) -> tuple[float, list]:
  times, result = [], None
  for _ in range(repeats):
    start = time.perf_counter()
    result = fn()
    times.append(time.perf_counter() - start)
  return min(times), result


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--text_dir', default=str(text.default_text_dir()))
  parser.add_argument('--file_glob', default='**/*.py')
  parser.add_argument('--repeats', type=int, default=5)
  args = parser.parse_args()
  root = pathlib.Path(args.text_dir)
  entries = sum(len(dirs) + len(files) for _, dirs, files in os.walk(root))
  glob_s, expected = best_of(lambda: one_glob(root, args.file_glob), args.repeats)
  listing_s, found = best_of(lambda: text._matching_files(root, args.file_glob), args.repeats)
  assert found == expected, 'the listing differs from one glob'
  print(f'{root}: {entries} entries, {len(found)} files kept; one glob {glob_s:.3f} s, the loader\'s listing '
        f'{listing_s:.3f} s (best of {args.repeats})')


if __name__ == '__main__':
  main()
