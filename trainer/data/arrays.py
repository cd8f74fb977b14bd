"""In-memory arrays from `.npz` / `.npy` (images and labels for classification), and synthetic batches.

`data.path` is either an `.npz` file holding `images` and `labels`, or a folder
holding `images.npy` and `labels.npy`. Example i is `{'images': images[i],
'labels': labels[i]}`; a fixed hash of the index holds `data.eval_percent` of
the rows out for eval, the same on every host.
"""

import pathlib

import numpy as np

from trainer.errors import UserError

KEYS = ('images', 'labels')


class ArrayExamples:
  """Grain random-access source over rows of equally long arrays."""

  def __init__(self, arrays: dict[str, np.ndarray], rows: np.ndarray):
    self._arrays, self._rows = arrays, rows

  def __len__(self) -> int:
    return len(self._rows)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    row = self._rows[index]
    return {key: value[row] for key, value in self._arrays.items()}


def load_arrays(data_config) -> dict[str, np.ndarray]:
  """Reads the images and labels; raises UserError naming the file and the fix when they are unusable."""
  if not data_config.path:
    raise UserError("data.source='arrays' needs data.path: an .npz file with 'images' and 'labels', or a folder "
                    "holding images.npy and labels.npy.")
  path = pathlib.Path(data_config.path)
  try:
    if path.is_dir():
      arrays = {key: np.load(path / f'{key}.npy', mmap_mode='r') for key in KEYS}
    else:
      with np.load(path) as npz:
        missing = [key for key in KEYS if key not in npz.files]
        if missing:
          raise UserError(f'{str(path)!r} has no array(s) {missing} (it holds {npz.files}); save the examples as '
                          f"np.savez(path, images=..., labels=...).")
        arrays = {key: npz[key] for key in KEYS}
  except (OSError, ValueError) as e:
    raise UserError(f'data.path={str(path)!r} cannot be read as .npz or a folder of images.npy and labels.npy '
                    f'({type(e).__name__}: {e}); check the path.') from e
  images, labels = arrays['images'], arrays['labels']
  if len(images) != len(labels):
    raise UserError(f'{str(path)!r}: images has {len(images)} rows but labels has {len(labels)}; every image needs '
                    f'exactly one label: save arrays of equal length.')
  if not len(images):
    raise UserError(f'{str(path)!r} holds no examples (0 rows); save some images and labels there.')
  return {'images': images, 'labels': labels.astype(np.int32)}


def split_rows(num_rows: int, eval_percent: int, split: str) -> np.ndarray:
  """Rows of `split`: a multiplicative hash of the row index, fixed on every host."""
  held_out = (np.arange(num_rows, dtype=np.uint64) * np.uint64(2654435761) % np.uint64(2**32)) % 100 < eval_percent
  return np.flatnonzero(held_out if split == 'eval' else ~held_out)


class SyntheticTokens:
  """Random tokens of the configured shape, a pure function of (seed, index): for benchmarks, no I/O."""

  def __init__(self, seq_len: int, vocab_size: int, seed: int, num_examples: int = 2**30):
    self._seq_len, self._vocab_size, self._seed, self._num_examples = seq_len, vocab_size, seed, num_examples

  def __len__(self) -> int:
    return self._num_examples

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    tokens = np.random.default_rng((self._seed, index)).integers(0, self._vocab_size, self._seq_len + 1, np.int32)
    return {'inputs': tokens[:-1], 'targets': tokens[1:]}
