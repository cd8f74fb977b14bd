"""In-memory arrays from `.npz` / `.npy` (images and labels for classification), and synthetic examples.

`data.path` is either an `.npz` file holding `images` and `labels`, or a folder
holding `images.npy` and `labels.npy`. Example i is `{'images': images[i],
'labels': labels[i]}` with the image as float32 (uint8 images scaled to [0, 1]);
a fixed hash of the index holds `data.eval_percent` of the rows out for eval,
the same on every host.
"""

import pathlib

import numpy as np

from trainer.base.errors import UserError

KEYS = ('images', 'labels')


class ArrayExamples:
  """Grain random-access source over rows of equally long arrays."""

  def __init__(self, arrays: dict[str, np.ndarray], rows: np.ndarray):
    self._arrays, self._rows = arrays, rows

  def __len__(self) -> int:
    return len(self._rows)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    row = self._rows[index]
    example = {key: value[row] for key, value in self._arrays.items()}
    if 'images' in example:  # Converted per example: a memory-mapped folder is never read whole.
      example['images'] = as_float_image(example['images'])
    return example


def as_float_image(image: np.ndarray) -> np.ndarray:
  """The float32 image a model sees: uint8 pixels scaled to [0, 1], any other dtype converted as is."""
  if image.dtype == np.uint8:
    return image.astype(np.float32) / np.float32(255)
  return image.astype(np.float32)


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
  return {'images': images, 'labels': np.asarray(labels).astype(np.int32)}


def check_image_shape(shape) -> None:
  """data.image_shape is (height, width, channels) of positive integers; UserError naming the key if not."""
  if (not isinstance(shape, (tuple, list)) or len(shape) != 3
      or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)):
    raise UserError(f'data.image_shape={shape!r} must be 3 positive integers (height, width, channels), '
                    f'e.g. --config.data.image_shape="(32, 32, 3)".')


def check_arrays(arrays: dict[str, np.ndarray], image_shape, num_classes: int, path) -> None:
  """The images have data.image_shape and every label is a class of the model; UserError naming the key if not."""
  shape = tuple(arrays['images'].shape[1:])
  if shape != tuple(image_shape):
    raise UserError(f'{str(path)!r} holds images of shape {shape} but data.image_shape={tuple(image_shape)}; set '
                    f'--config.data.image_shape="{shape}" (and a model.patch_size dividing its height and width).')
  labels = arrays['labels']
  low, high = int(labels.min()), int(labels.max())
  if low < 0 or high >= num_classes:
    raise UserError(f'{str(path)!r} holds labels from {low} to {high} but model.num_classes={num_classes} needs '
                    f'them in [0, {num_classes}); set --config.model.num_classes={high + 1} if the labels are right.')


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


class SyntheticImages:
  """Learnable synthetic images, a pure function of (seed, index): for classifier runs and tests, no I/O.

  Example i draws a label uniformly, then gives that class's fixed template plus Gaussian noise. A template is a
  coarse 4x4 grid of random colours per class, upsampled to the image (seeded by `template_seed` and the label
  alone, so every split and host sees the same classes): the class shows both in the mean colour and in the
  spatial pattern, and a small ViT learns it within tens of steps. The held-out split uses another `seed` with the
  same `template_seed`.
  """

  GRID = 4  # Template cells per side.
  NOISE_STD = 0.5  # Per-pixel noise; the templates span [0, 1].

  def __init__(self, image_shape, num_classes: int, seed: int, template_seed: int, num_examples: int = 2**30):
    self._shape, self._num_classes = tuple(image_shape), num_classes
    self._seed, self._template_seed, self._num_examples = seed, template_seed, num_examples

  def __len__(self) -> int:
    return self._num_examples

  def template(self, label: int) -> np.ndarray:
    height, width, channels = self._shape
    grid = np.random.default_rng((self._template_seed, label)).random((self.GRID, self.GRID, channels), np.float32)
    rows, cols = np.arange(height) * self.GRID // height, np.arange(width) * self.GRID // width
    return grid[rows[:, None], cols[None, :]]

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng((self._seed, index))
    label = int(rng.integers(self._num_classes))
    noise = rng.standard_normal(self._shape, np.float32) * np.float32(self.NOISE_STD)
    return {'images': self.template(label) + noise, 'labels': np.int32(label)}
