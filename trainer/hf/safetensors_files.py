"""The tensors of a Hugging Face model folder's safetensors files, read a slice at a time.

Headers and slices are read by the safetensors package: `safe_open(file, framework='numpy')`
gives each tensor's dtype and shape from the header (and refuses a corrupt or truncated file
there, before any compile), and `get_slice(name)[rows, cols]` copies only those elements out
of the memory-mapped file (bfloat16 comes back as ml_dtypes.bfloat16). The file is opened for
one read and closed after it, so the mapped pages a read touches (for a column slice of a
row-major matrix, every page of its rows) leave the process's resident memory with the read.

Measured against the hand-written reader this replaced (plain file reads in 32 MiB chunks;
benchmarks/bench_hf_import.py's 1B import, 2 processes x 4 CPU devices, 2026-11-25, BENCHMARKS.md):
peak RSS 3.10-3.31 GB a process against 2.93-2.94 GB (the mapped pages of the read in flight),
import 11-21 s against 36-43 s. safe_open's `backend='pread'` reads a whole tensor to slice
it: 2.97 GB but 56 s, hence the default (mmap).

A folder has `model.safetensors.index.json` (sharded: its weight_map names each
tensor's file) or one `model.safetensors`.
"""

import contextlib
import dataclasses
import json
import pathlib

import numpy as np
import safetensors

from trainer.base import confined
from trainer.base.errors import UserError

INDEX = 'model.safetensors.index.json'
SINGLE = 'model.safetensors'
# The dtypes safetensors 0.8.0 reads into numpy; it knows F8_* and sub-byte floats too, but its numpy
# framework fails on them (numpy has no float8 types), so they are refused with the header, before any compile.
READABLE = ('F64', 'F32', 'F16', 'BF16', 'I64', 'I32', 'I16', 'I8', 'U8', 'BOOL')
FLOATS = ('F64', 'F32', 'F16', 'BF16')  # What a float parameter is read from; an integer tensor would be cast.


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  file: pathlib.Path
  name: str
  dtype: str  # The header's dtype code, e.g. 'BF16'.
  shape: tuple[int, ...]


@contextlib.contextmanager
def _open(path: pathlib.Path):
  """safe_open(path), its failures (a corrupt or truncated file, checked against the header) one UserError."""
  try:
    with safetensors.safe_open(path, framework='numpy') as f:
      yield f
  except (OSError, safetensors.SafetensorError) as e:
    raise UserError(f'{str(path)!r} is not a readable safetensors file ({type(e).__name__}: {e}); download it '
                    f'again.') from e


def read_header(path: pathlib.Path) -> dict[str, TensorInfo]:
  """Every tensor of one .safetensors file, from its header alone."""
  with _open(path) as f:
    slices = {name: f.get_slice(name) for name in f.keys()}
    out = {name: TensorInfo(path, name, s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}
  for name, info in out.items():
    if info.dtype not in READABLE:
      raise UserError(f'{str(path)!r}: tensor {name!r} has dtype {info.dtype}, which is not read here '
                      f'(readable: {", ".join(READABLE)}).')
  return out


def weight_files(folder: pathlib.Path, where: str) -> list[pathlib.Path]:
  """The folder's safetensors files: the index's, or model.safetensors; one UserError when there are none."""
  index = confined.inside(folder, INDEX, where)
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text())['weight_map']
    except (OSError, ValueError, KeyError) as e:
      raise UserError(f'{where}: {str(index)!r} is unreadable or has no weight_map ({type(e).__name__}); download '
                      f'the model folder again.') from e
    # The folder's own files only: a name with '..', an absolute one, or a link out of the folder is refused.
    files = [confined.inside(folder, str(name), f'{where}: {INDEX}') for name in sorted(set(weight_map.values()))]
    missing = [str(f.name) for f in files if not f.is_file()]
    if missing:
      raise UserError(f'{where}: {str(index)!r} lists {", ".join(missing)}, missing from the folder; download the '
                      f'whole model folder.')
    return files
  if confined.inside(folder, SINGLE, where).is_file():
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
  """Rows [rows) (and of a 2-D tensor columns [cols)) of the tensor, reading only those elements from the file."""
  index = (rows,) if len(info.shape) == 1 else (rows, slice(None) if cols is None else cols)
  with _open(info.file) as f:
    return f.get_slice(info.name)[index]
