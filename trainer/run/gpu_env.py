"""XLA flags every run on NVIDIA GPUs gets, set in the environment before jax loads (launch.py calls `apply`).

Imports no jax: XLA reads XLA_FLAGS once, when the backend starts, so they must be in place before that.

cuDNN calls out of CUDA graphs (`--xla_gpu_enable_command_buffer=-CUDNN`): on one H100 (jax 0.11.2, CUDA 13,
2026-11-26; ../shared/GPU.md and issue 38) two of four fresh launches of configs/default.py died at their first step
with `cuda_graph_end_capture ... capturing stream has unjoined work` from cuDNN's graph (`cuda_dnn.cc`,
`graph.deserialize`) while XLA recorded it into a command buffer, and one more ended in a segmentation fault; with
`--xla_gpu_enable_command_buffer=` (no command buffers) the job ran (901k tokens/s against 957k for the one launch
that survived with them). Only cuDNN is taken out: the `-TYPE` form removes one type from XLA's defaults and keeps
fusions and cuBLAS in graphs, where they cut launch overhead. In the pinned jaxlib (0.10.2) the defaults are FUSION,
CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN, CONDITIONAL and DYNAMIC_SLICE_FUSION, and `-CUDNN` leaves the other six
(tests/test_gpu_env.py reads them back from XLA's dumped debug options). With `-CUDNN` and the
device feed held until the first step completes (trainer/data), 0 of 14 fresh launches crashed on an H100 (jax
0.11.2, 2026-11-26, benchmarks/bench_gpu_acceptance.py; BENCHMARKS.md, issue 38); which of the two removed the crash
is not separated, so both stay.
"""

import os
from collections.abc import Mapping, MutableMapping

COMMAND_BUFFER_FLAG = '--xla_gpu_enable_command_buffer'
FLAGS = (f'{COMMAND_BUFFER_FLAG}=-CUDNN',)


def nvidia_gpu_visible(environ: Mapping[str, str], device_files: list[str]) -> bool:
  """Whether jax will run on NVIDIA GPUs: a device file /dev/nvidiaN exists and neither JAX_PLATFORMS nor
  CUDA_VISIBLE_DEVICES rules the GPUs out."""
  platforms = environ.get('JAX_PLATFORMS', '').lower()
  if platforms and not {'cuda', 'gpu'} & {p.strip() for p in platforms.split(',')}:
    return False
  if environ.get('CUDA_VISIBLE_DEVICES', None) in ('', '-1'):
    return False
  return any(name.startswith('nvidia') and name[len('nvidia'):].isdigit() for name in device_files)


def with_gpu_flags(xla_flags: str) -> str:
  """`xla_flags` with FLAGS in front; a flag the user already set keeps the user's value (XLA takes the last value
  of a repeated flag, and one the user names is not added at all)."""
  given = {f.split('=', 1)[0] for f in xla_flags.split()}
  added = [f for f in FLAGS if f.split('=', 1)[0] not in given]
  return ' '.join([*added, *xla_flags.split()])


def apply(environ: MutableMapping[str, str] | None = None, device_files: list[str] | None = None) -> bool:
  """Puts FLAGS into XLA_FLAGS when this process will run on NVIDIA GPUs; returns whether it did."""
  environ = os.environ if environ is None else environ
  if device_files is None:
    device_files = os.listdir('/dev') if os.path.isdir('/dev') else []
  if not nvidia_gpu_visible(environ, device_files):
    return False
  environ['XLA_FLAGS'] = with_gpu_flags(environ.get('XLA_FLAGS', ''))
  return True
