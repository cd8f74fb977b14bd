"""Attention kernels alone, as trainer/attention runs them: numerics against float32 XLA, document leaks, fwd+bwd time.

  python benchmarks/bench_attention.py                     # every kernel this platform runs (GPU: xla, cudnn)
  python benchmarks/bench_attention.py --cases=gpt2 --batch=2 --seq_len=256 --kernels=xla   # CPU, seconds

Cases (causal self-attention at the presets' head shapes): gpt2 (12 query and 12 kv heads of 64, as
configs/gpt2_124m.py), llama (32 query heads sharing 8 kv heads of 64, as configs/llama_1b.py), each unpacked and
packed (every row cut into --docs_per_row documents of random lengths, numbered 1, 2, ... as trainer/data packs
them). Per case and kernel: the relative error (|x - ref| / |ref|, Frobenius) of the output and of dq, dk, dv against
XLA in float32 on the same inputs; for packed rows the leak (the largest change in any output outside the first
document when the first document's queries, keys and values are replaced: 0 for a kernel that keeps documents
apart); the median time of a jitted forward + backward. cuDNN's packed layout is timed with its segment table
sized M = the documents a row holds (`--docs_per_row`), M = the launcher's bound (data.max_documents_per_row's
default, which trainer/models pass) and M = L (what trainer/attention takes when a model passes no bound).
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
  sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from configs import base  # noqa: E402
from trainer import attention  # noqa: E402
from trainer.attention import xla  # noqa: E402

# Case -> (batch, sequence length, query heads, kv heads, head dim), the bench rows' shapes (benchmarks/bench_gpu.py).
CASES = {'gpt2': (32, 1024, 12, 12, 64), 'llama': (16, 2048, 32, 8, 64)}
PLATFORM_KERNELS = {'gpu': ('xla', 'cudnn'), 'tpu': ('xla', 'splash'), 'cpu': ('xla',)}


def documents(batch: int, seq_len: int, docs_per_row: int, seed: int = 0) -> np.ndarray:
  """(B, L) segment ids 1..docs_per_row, each row cut at distinct random points."""
  rng = np.random.default_rng(seed)
  ids = np.empty((batch, seq_len), np.int32)
  for row in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, seq_len), docs_per_row - 1, replace=False))
    ids[row] = np.searchsorted(cuts, np.arange(seq_len), side='right') + 1
  return ids


def kernel_fn(kernel: str, max_segments: int | None = None):
  """fn(q, k, v, segment_ids) -> output, through trainer/attention's own dispatch."""
  if kernel == 'leaky':  # Ignores documents: what the leak check must catch (tests/test_bench_gpu.py).
    return lambda q, k, v, ids: xla.attention(q, k, v, causal=True)
  return lambda q, k, v, ids: attention.dot_product_attention(q, k, v, causal=True, segment_ids_BL=ids,
                                                              kernel=kernel, max_segments=max_segments)


def forward_backward(fn, dtype):
  """jit(q, k, v, ids, cotangent) -> (output, dq, dk, dv), in float32, the inputs cast to `dtype` first."""
  def run(q, k, v, ids, cotangent):
    cast = lambda x: x.astype(dtype)
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, ids), cast(q), cast(k), cast(v))
    grads = vjp(cotangent.astype(out.dtype))
    return tuple(x.astype(jnp.float32) for x in (out, *grads))
  return jax.jit(run)


def relative_error(x, ref) -> float:
  return float(jnp.linalg.norm((x - ref).ravel()) / jnp.linalg.norm(ref.ravel()))


def timed_ms(step, args, repeats: int) -> float:
  jax.block_until_ready(step(*args))  # Compile and warm up.
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    times.append(1e3 * (time.perf_counter() - start))
  return statistics.median(times)


def measure(case: str, packed: bool, kernel: str, shape, dtype, docs_per_row: int, repeats: int,
            max_segments: int | None = None) -> dict:
  batch, seq_len, heads, kv_heads, head_dim = shape
  keys = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(keys[0], (batch, seq_len, heads, head_dim), jnp.float32)
  k = jax.random.normal(keys[1], (batch, seq_len, kv_heads, head_dim), jnp.float32)
  v = jax.random.normal(keys[2], (batch, seq_len, kv_heads, head_dim), jnp.float32)
  cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)
  ids = jnp.asarray(documents(batch, seq_len, docs_per_row)) if packed else None
  step = forward_backward(kernel_fn(kernel, max_segments), dtype)
  got = step(q, k, v, ids, cotangent)
  ref = forward_backward(kernel_fn('xla'), jnp.float32)(q, k, v, ids, cotangent)
  row = {'case': case, 'packed': packed, 'kernel': kernel, 'dtype': jnp.dtype(dtype).name,
         'shape': f'{batch}x{seq_len} {heads}/{kv_heads}x{head_dim}',
         **{f'err_{name}': relative_error(x, r) for name, x, r in zip(('out', 'dq', 'dk', 'dv'), got, ref)}}
  if max_segments is not None:
    row['max_segments'] = max_segments
  if packed:  # Replace the first document's q, k and v; nothing outside it may move.
    first = (ids == 1)[:, :, None, None]
    noise = [jax.random.normal(keys[4], x.shape, jnp.float32) for x in (q, k, v)]
    other = step(*(jnp.where(first, n, x) for n, x in zip(noise, (q, k, v))), ids, cotangent)
    row['leak'] = float(jnp.max(jnp.where(first, 0.0, jnp.abs(other[0] - got[0]))))
  row['ms'] = timed_ms(step, (q, k, v, ids, cotangent), repeats)
  return row


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--cases', default=','.join(CASES))
  parser.add_argument('--kernels', default=None, help="Default: those the platform runs ('leaky' checks the check).")
  parser.add_argument('--dtype', default=None, help='Default: bfloat16 off CPU, float32 on CPU.')
  parser.add_argument('--batch', type=int, default=None, help="Overrides the cases' batch.")
  parser.add_argument('--seq_len', type=int, default=None, help="Overrides the cases' sequence length.")
  parser.add_argument('--docs_per_row', type=int, default=4)
  parser.add_argument('--repeats', type=int, default=10)
  parser.add_argument('--json', default=None, help='Also writes the rows to this file.')
  args = parser.parse_args(argv)
  platform = jax.devices()[0].platform
  kernels = args.kernels.split(',') if args.kernels else PLATFORM_KERNELS.get(platform, ('xla',))
  dtype = jnp.dtype(args.dtype or ('float32' if platform == 'cpu' else 'bfloat16'))
  rows = []
  print(f'# {jax.devices()[0].device_kind}, jax {jax.__version__}, {dtype.name}')
  print('| case | shape | packed | kernel | err out | err dq | err dk | err dv | leak | fwd+bwd ms |')
  print('|---|---|---|---|---|---|---|---|---|---|')
  for case in args.cases.split(','):
    batch, seq_len, *heads = CASES[case]
    shape = (args.batch or batch, args.seq_len or seq_len, *heads)
    for packed in (False, True):
      runs = [(kernel, None) for kernel in kernels]
      if packed and 'cudnn' in kernels:  # M = L first (None), then the launcher's bound, then the least.
        runs += [('cudnn', base.get_config().data.max_documents_per_row), ('cudnn', args.docs_per_row)]
      for kernel, max_segments in runs:
        row = measure(case, packed, kernel, shape, dtype, args.docs_per_row, args.repeats, max_segments)
        rows.append(row)
        name = kernel + (f' (M={max_segments or "L"})' if packed and kernel == 'cudnn' else '')
        leak = f"{row['leak']:.2g}" if packed else '-'
        print(f"| {case} | {row['shape']} | {packed} | {name} | {row['err_out']:.2g} | {row['err_dq']:.2g} | "
              f"{row['err_dk']:.2g} | {row['err_dv']:.2g} | {leak} | {row['ms']:.3g} |", flush=True)
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
  return rows


if __name__ == '__main__':
  main()
