"""The tensors of a Hugging Face model folder's safetensors files, read a slice at a time.

A .safetensors file is an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the raw row-major bytes.
The header is parsed here and slices are read with plain file reads rather than
through a memory map: pages of a mapped file that a process touches count in its
resident memory, and reading the columns of a row-major matrix would touch all of
it. A read of rows [r0, r1) and columns [c0, c1) reads whole rows in chunks of at
most CHUNK_BYTES and keeps the columns, so a process holds its slices plus one
chunk, never a whole tensor it does not own.

A folder has `model.safetensors.index.json` (sharded: its weight_map names each
tensor's file) or one `model.safetensors`.
"""

import dataclasses
import json
import pathlib
import struct

import ml_dtypes
import numpy as np

from trainer.errors import UserError

INDEX = 'model.safetensors.index.json'
SINGLE = 'model.safetensors'
CHUNK_BYTES = 32 << 20
DTYPES = {'F64': np.float64, 'F32': np.float32, 'F16': np.float16, 'BF16': ml_dtypes.bfloat16, 'I64': np.int64,
          'I32': np.int32, 'I16': np.int16, 'I8': np.int8, 'U8': np.uint8, 'BOOL': np.bool_}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  file: pathlib.Path
  dtype: np.dtype
  shape: tuple[int, ...]
  offset: int  # Absolute byte offset of the first element in `file`.


def read_header(path: pathlib.Path) -> dict[str, TensorInfo]:
  """Every tensor of one .safetensors file, from its header alone."""
  try:
    with open(path, 'rb') as f:
      (size,) = struct.unpack('<Q', f.read(8))
      header = json.loads(f.read(size))
  except (OSError, ValueError, struct.error) as e:
    raise UserError(f'{str(path)!r} is not a readable safetensors file ({type(e).__name__}: {e}); download it '
                    f'again.') from e
  out = {}
  for name, entry in header.items():
    if name == '__metadata__':
      continue
    if entry['dtype'] not in DTYPES:
      raise UserError(f'{str(path)!r}: tensor {name!r} has dtype {entry["dtype"]}, which is not read here '
                      f'(readable: {", ".join(DTYPES)}).')
    out[name] = TensorInfo(path, np.dtype(DTYPES[entry['dtype']]), tuple(entry['shape']),
                           8 + size + entry['data_offsets'][0])
  return out


def weight_files(folder: pathlib.Path, where: str) -> list[pathlib.Path]:
  """The folder's safetensors files: the index's, or model.safetensors; one UserError when there are none."""
  index = folder / INDEX
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())['weight_map']
    except (OSError, ValueError, KeyError) as e:
      raise UserError(f'{where}: {str(index)!r} is unreadable or has no weight_map ({type(e).__name__}); download '
                      f'the model folder again.') from e
    files = [folder / name for name in sorted(set(weight_map.values()))]
    missing = [str(f.name) for f in files if not f.is_file()]
    if missing:
      raise UserError(f'{where}: {str(index)!r} lists {", ".join(missing)}, missing from the folder; download the '
                      f'whole model folder.')
    return files
  if (folder / SINGLE).is_file():
    return [folder / SINGLE]
  raise UserError(f'{where}: {str(folder)!r} has no weights: neither {INDEX} nor {SINGLE}; give a Hugging Face '
                  f'model folder with its safetensors weights (.bin and .pth files are not read).')


def read_tensors(folder: pathlib.Path, where: str) -> dict[str, TensorInfo]:
  """Name -> where to read it, for every tensor of the folder's files (headers only)."""
  tensors = {}
  for path in weight_files(folder, where):
    tensors.update(read_header(path))
  return tensors


def read_block(info: TensorInfo, rows: slice, cols: slice | None = None) -> np.ndarray:
  """Rows [rows) (and of a 2-D tensor columns [cols)) of the tensor, reading only those rows from disk."""
  shape = info.shape
  if len(shape) == 1:
    return _read(info, rows.start, rows.stop - rows.start)
  ncols = shape[1]
  if cols is None or (cols.start == 0 and cols.stop == ncols):
    return _read(info, rows.start * ncols, (rows.stop - rows.start) * ncols).reshape(-1, ncols)
  out = np.empty((rows.stop - rows.start, cols.stop - cols.start), info.dtype)
  per_chunk = max(1, CHUNK_BYTES // (ncols * info.dtype.itemsize))
  for r in range(rows.start, rows.stop, per_chunk):
    n = min(per_chunk, rows.stop - r)
    out[r - rows.start:r - rows.start + n] = _read(info, r * ncols, n * ncols).reshape(n, ncols)[:, cols]
  return out


def _read(info: TensorInfo, first: int, count: int) -> np.ndarray:
  with open(info.file, 'rb') as f:
    f.seek(info.offset + first * info.dtype.itemsize)
    data = f.read(count * info.dtype.itemsize)
  if len(data) != count * info.dtype.itemsize:
    raise UserError(f'{str(info.file)!r} is truncated (a tensor runs past its end); download it again.')
  return np.frombuffer(data, info.dtype)
