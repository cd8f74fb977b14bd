"""Grouped matmuls for mixture-of-experts on NVIDIA GPUs: Pallas Triton kernels that run only the active experts.

`ragged_dot(x_AD, w_EDF, group_sizes_E)` computes what `jax.lax.ragged_dot` does (rows sorted by group; row block
g of x times w[g]) without XLA's GPU lowering of that primitive, which expands it to a dense matmul over every
expert (compiled for an H100, moe_1b's step holds bf16[8, 32768, 2048] operands: every expert on every assignment;
BENCHMARKS.md "Grouped matmul for experts").

How: each group's rows are padded to a multiple of the row tile, so every tile of rows belongs to one group; a
kernel then multiplies each tile by its group's weights (grid: row tiles x output column tiles). The backward pass
is its own (custom_vjp): the input gradient is the same kernel on the transposed weights, and the weight gradient
a second kernel that, per group and weight tile, sums x_tile^T @ dy_tile over that group's row tiles only (an
empty group gets zeros). Padding adds at most one tile of rows per group.

`interpret=True` runs the kernels in Pallas interpret mode (any backend; how tests/test_grouped_matmul.py checks
them on CPU against a dense reference).
"""

import functools

import jax
import jax.numpy as jnp

from trainer.models import row_permute

NAME = 'Pallas Triton grouped matmul (trainer/models/grouped_matmul.py)'
_TILE_CHOICES = (128, 64, 32, 16)  # Triton's dot wants power-of-two tiles of at least 16.


def _tile(n: int, largest: int = 128) -> int:
  """The largest power-of-two tile (16..largest) that divides `n`."""
  for t in _TILE_CHOICES:
    if t <= largest and n % t == 0:
      return t
  raise ValueError(f'grouped matmul: dimension {n} is not a multiple of 16')


def supports(d_in: int, d_out: int) -> bool:
  """Whether the kernels take these widths (multiples of 16)."""
  return d_in % 16 == 0 and d_out % 16 == 0


@functools.partial(jax.jit, static_argnames=('interpret', 'tile_rows'))
def ragged_dot(x_AD, w_EDF, group_sizes_E, *, interpret: bool = False, tile_rows: int = 64):
  """(A, F) = per group g, rows [start_g, start_g + size_g) of x_AD times w_EDF[g]; rows past sum(sizes) give 0."""
  A, _ = x_AD.shape
  E = w_EDF.shape[0]
  layout = _Layout.of(group_sizes_E, A, E, tile_rows)
  # Padded and unpadded by gathers both ways (row_permute): a scatter here, or indexing's scatter-add transpose, ran
  # about 39 ms of the 104 ms of moe_1b b8's grouped matmuls on an H200 (docs/moe.md).
  xp = row_permute.take(x_AD, layout.src_P, layout.dest_A)
  xp, w_EDF = row_permute.vary_alike(xp, w_EDF)
  yp = _padded_matmul(xp, w_EDF, layout.tile_group, layout.first_tile, layout.num_tiles, interpret, tile_rows, A)
  return row_permute.take(yp, layout.dest_A, layout.src_P)


class _Layout:
  """Where each row goes in the padded layout (dest_A; `rows` for none) and which row each padded row holds (src_P; A
  for none: padding), and which group each row tile belongs to (all traced values)."""

  def __init__(self, dest_A, src_P, tile_group, first_tile, num_tiles, rows):
    self.dest_A, self.src_P, self.tile_group, self.first_tile, self.num_tiles, self.rows = (
        dest_A, src_P, tile_group, first_tile, num_tiles, rows)

  @classmethod
  def of(cls, group_sizes_E, A: int, E: int, tile: int) -> '_Layout':
    sizes = group_sizes_E.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    num_tiles = (sizes + tile - 1) // tile
    first_tile = jnp.cumsum(num_tiles) - num_tiles
    rows = (-(-A // tile) + E) * tile  # Static bound: every group rounded up adds under one tile.
    row_A = jnp.arange(A, dtype=jnp.int32)
    group_A = jnp.searchsorted(ends, row_A, side='right').astype(jnp.int32)
    in_group = group_A < E  # Rows past sum(sizes) belong to no group: dropped, and read back as 0.
    group_A = jnp.minimum(group_A, E - 1)
    dest_A = jnp.where(in_group, first_tile[group_A] * tile + row_A - starts[group_A], rows)
    tile_ends = jnp.cumsum(num_tiles)
    # Tiles past the last group's get E, which the kernel skips: a receive buffer with room for N times the rows
    # routed (trainer/models/expert_ragged.py) costs the rows it holds, not its size.
    tile_group = jnp.searchsorted(tile_ends, jnp.arange(rows // tile), side='right').astype(jnp.int32)
    # The inverse of dest_A, computed rather than scattered: padded row p of group g's tiles holds row start_g + offset.
    row_P = jnp.arange(rows, dtype=jnp.int32)
    group_P = tile_group[row_P // tile]
    held_P = jnp.minimum(group_P, E - 1)
    offset_P = row_P - first_tile[held_P] * tile
    src_P = jnp.where((group_P < E) & (offset_P < sizes[held_P]), starts[held_P] + offset_P, A)
    return cls(dest_A, src_P, tile_group, first_tile.astype(jnp.int32), num_tiles.astype(jnp.int32), rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _padded_matmul(xp, w, tile_group, first_tile, num_tiles, interpret, tile_rows, rows):
  return _tiles_times_weights(xp, w, tile_group, interpret, tile_rows, rows)


def _padded_fwd(xp, w, tile_group, first_tile, num_tiles, interpret, tile_rows, rows):
  out = _tiles_times_weights(xp, w, tile_group, interpret, tile_rows, rows)
  return out, (xp, w, tile_group, first_tile, num_tiles)


def _padded_bwd(interpret, tile_rows, rows, residuals, dy):
  xp, w, tile_group, first_tile, num_tiles = residuals
  dx = _tiles_times_weights(dy, jnp.swapaxes(w, 1, 2), tile_group, interpret, tile_rows, rows)
  dw = _weight_gradient(xp, dy, first_tile, num_tiles, w.dtype, interpret, tile_rows, rows)
  return dx, dw, None, None, None


_padded_matmul.defvjp(_padded_fwd, _padded_bwd)


def _pallas():
  """jax's Pallas and its Triton backend, imported when a kernel is first traced: every launch imports this module
  (trainer/models/moe.py), and the import took 0.1-0.2 s of CPU (benchmarks/bench_launch_imports.py)."""
  from jax.experimental import pallas as pl  # pylint: disable=import-outside-toplevel
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=import-outside-toplevel
  return pl, plgpu


def _like(x, shape, dtype) -> jax.ShapeDtypeStruct:
  """An output varying over the manual mesh axes `x` varies over: under shard_map (trainer/models/expert_parallel.py)
  pallas_call asks for them."""
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(x).mat)


def _tiles_times_weights(xp, w, tile_group, interpret: bool, tile_rows: int, useful_rows: int):
  """(rows, F): row tile i times w[tile_group[i]]; declares 2 * useful_rows * D * F FLOPs (the padding is not
  useful work)."""
  pl, plgpu = _pallas()
  rows, D = xp.shape
  F = w.shape[2]
  bm, bk, bn = tile_rows, _tile(D, 64), _tile(F)

  E = w.shape[0]

  def kernel(group_ref, x_ref, w_ref, o_ref):
    i, j = pl.program_id(0), pl.program_id(1)
    g = group_ref[i]

    def body(k, acc):
      a = x_ref[pl.ds(i * bm, bm), pl.ds(k * bk, bk)]
      b = w_ref[g, pl.ds(k * bk, bk), pl.ds(j * bn, bn)]
      return acc + plgpu.dot(a, b, precision=jax.lax.Precision.HIGHEST if interpret else None)

    @pl.when(g < E)  # A tile of no group (past the rows held): skipped, its output never read.
    def _():
      acc = jax.lax.fori_loop(0, D // bk, body, jnp.zeros((bm, bn), jnp.float32))
      o_ref[pl.ds(i * bm, bm), pl.ds(j * bn, bn)] = acc.astype(o_ref.dtype)

  return pl.pallas_call(kernel, out_shape=_like(xp, (rows, F), xp.dtype), grid=(rows // bm, F // bn),
                        interpret=interpret, name='grouped_matmul',
                        cost_estimate=pl.CostEstimate(flops=2 * useful_rows * D * F, transcendentals=0,
                                                      bytes_accessed=xp.nbytes + w.nbytes + rows * F * xp.itemsize),
                        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=3),
                        )(tile_group, xp, w)


def _weight_gradient(xp, dy, first_tile, num_tiles, dtype, interpret: bool, tile_rows: int, useful_rows: int):
  """(E, D, F): per group, the sum over its row tiles of x_tile^T @ dy_tile; zeros for an empty group."""
  pl, plgpu = _pallas()
  _, D = xp.shape
  F = dy.shape[1]
  E = first_tile.shape[0]
  bm, bd, bf = tile_rows, _tile(D, 64), _tile(F, 64)

  def kernel(first_ref, count_ref, x_ref, dy_ref, o_ref):
    e, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first, count = first_ref[e], count_ref[e]

    def body(t, acc):
      a = x_ref[pl.ds((first + t) * bm, bm), pl.ds(i * bd, bd)]
      b = dy_ref[pl.ds((first + t) * bm, bm), pl.ds(j * bf, bf)]
      return acc + plgpu.dot(a, b, trans_a=True, precision=jax.lax.Precision.HIGHEST if interpret else None)

    acc = jax.lax.fori_loop(0, count, body, jnp.zeros((bd, bf), jnp.float32))
    o_ref[e, pl.ds(i * bd, bd), pl.ds(j * bf, bf)] = acc.astype(o_ref.dtype)

  return pl.pallas_call(kernel, out_shape=_like(xp, (E, D, F), dtype), grid=(E, D // bd, F // bf),
                        interpret=interpret, name='grouped_matmul_weight_grad',
                        cost_estimate=pl.CostEstimate(flops=2 * useful_rows * D * F, transcendentals=0,
                                                      bytes_accessed=xp.nbytes + dy.nbytes + E * D * F * 4),
                        compiler_params=None if interpret else plgpu.CompilerParams(num_warps=4, num_stages=3),
                        )(first_tile, num_tiles, xp, dy)
