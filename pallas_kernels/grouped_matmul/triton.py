"""Grouped (MoE expert) matmul as Pallas kernels lowered through Triton.

The grouped GEMM of MegaBlocks (arXiv 2211.15841, section 5) and vLLM's ``fused_moe``:

1. Tile schedule, in the wrapper (``jax.numpy``, jittable, no host sync): each expert's
   rows are cut into row tiles of ``block_m`` rows counted from the expert's *first* row,
   so a tile never holds rows of two experts and no two tiles write the same row. The rows
   past ``sum(group_sizes)`` form tiles of their own that write zeros. The number of tiles
   has a static bound (:func:`num_row_tiles`); tiles past the live ones are empty and
   their programs exit at once.
2. One program per (row tile, ``block_n`` columns of N): it streams its rows of ``x`` and
   the tile's expert's ``w[e, :, cols]`` in ``block_k`` steps (masked loads: rows outside
   the tile read 0, never the neighbouring expert's rows) and accumulates in fp32. With
   ``narrow_m``, a tile of at most ``narrow_m`` live rows runs a ``narrow_m``-row dot
   instead: decode routing gives most experts a few rows and some many, and one tile size
   cannot serve both (small tiles cut a busy expert into many programs that each stream
   its weights; large ones spend a full tile of MMA on a handful of rows).

Worked example, ``block_m = 4``, ``group_sizes = [6, 0, 3]``, ``M = 12``::

    rows          0 1 2 3 | 4 5 | 6 7 8 | 9 10 11
    tile          0       | 1   | 2     | 3
    tile_expert   0         0     2       3 (= E: past sum(group_sizes), writes zeros)
    row_start     0         4     6       9
    row_end       4         6     9       12
    tiles 4, 5: padding up to the static bound (12 + 4 * 3) // 4 = 6 (row_end = row_start)

The backward pass (``jax.custom_vjp``, wired here) runs the same tile kernel for
``dx = grouped_matmul(dy, w[e]ᵀ)`` and the per-expert kernel of ``grouped_matmul/triton_vjp.py``
for ``dw[e] = x_eᵀ dy_e``. Block sizes and their heuristic are in
``grouped_matmul/triton_config.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import search_sorted
from pallas_kernels._pallas import (
    compiler_params,
    dot,
    masked_load,
    outer_mask,
    tail_mask,
)
from pallas_kernels.backend import pallas_dtypes
from pallas_kernels.grouped_matmul import triton_vjp
from pallas_kernels.grouped_matmul.triton_config import BlockSizes


def num_row_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """Static bound on the row tiles of any ``group_sizes``: each of at most
    ``min(E + 1, M)`` non-empty groups (the experts and the rows past their sum) ends in at
    most one partial tile, so ``sum_g cdiv(g, bm) <= (M + groups * (bm - 1)) // bm``."""
    groups = min(num_experts + 1, num_rows)
    return (num_rows + groups * (block_m - 1)) // block_m


def tile_schedule(
    group_sizes: jax.Array, num_rows: int, block_m: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(tile_expert, tile_row_start, tile_row_end)``, int32[num_row_tiles] each (see the
    module's worked example). ``group_sizes`` are non-negative and sum to at most M (the
    api clamps them). ``tile_expert == E`` marks the tiles of rows past the sum (zeros);
    padding tiles have ``row_end == row_start``."""
    num_experts = group_sizes.shape[0]
    num_tiles = num_row_tiles(num_rows, num_experts, block_m)
    ends = jnp.cumsum(group_sizes, dtype=jnp.int32)
    # Group E: the rows past sum(group_sizes).
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])  # int32[E + 1]
    sizes = jnp.concatenate([group_sizes, num_rows - ends[-1:]]).astype(jnp.int32)
    tiles = (sizes + block_m - 1) // block_m
    tile_ends = jnp.cumsum(tiles, dtype=jnp.int32)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    group = search_sorted(tile_ends, t, side="right").astype(jnp.int32)
    live = group <= num_experts
    group = jnp.minimum(group, num_experts)
    row_start = starts[group] + (t - (tile_ends[group] - tiles[group])) * block_m
    row_end = jnp.minimum(row_start + block_m, starts[group] + sizes[group])
    row_start = jnp.where(live, row_start, 0)
    row_end = jnp.where(live, row_end, 0)
    return group, row_start, row_end


def _tile_kernel(
    expert_ref,  # [num_tiles] int32
    start_ref,  # [num_tiles] int32
    end_ref,  # [num_tiles] int32
    x_ref,  # [M, C] (C: the contraction)
    w_ref,  # [E, C, O], or [E, O, C] with transpose_w
    y_ref,  # [M, O]
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    num_col_blocks: int,
    transpose_w: bool,
    narrow_m: int | None,
):
    pid = pl.program_id(0)
    # Column blocks of one row tile are neighbours: they share the tile's rows of x and
    # stream the same expert's weights.
    tile = jax.lax.div(pid, num_col_blocks)
    col0 = pl.multiple_of(jax.lax.rem(pid, num_col_blocks) * block_n, block_n)
    expert, row0, row_end = expert_ref[tile], start_ref[tile], end_ref[tile]
    num_experts = w_ref.shape[0]
    contract, out_cols = x_ref.shape[1], y_ref.shape[1]
    col_live = tail_mask(col0, block_n, out_cols)
    cols = pl.ds(col0, block_n)
    live_rows = row_end - row0

    def matmul_rows(num: int) -> None:
        """The tile's first ``num`` rows (those past ``row_end`` masked) times the expert."""
        row_live = jnp.arange(num) < live_rows
        rows = pl.ds(row0, num)

        def step(k, acc):
            k0 = pl.multiple_of(k * block_k, block_k)
            ks = pl.ds(k0, block_k)
            k_live = tail_mask(k0, block_k, contract)
            a = masked_load(x_ref.at[rows, ks], outer_mask(row_live, k_live, (num, block_k)))
            if transpose_w:
                b = masked_load(
                    w_ref.at[expert, cols, ks], outer_mask(col_live, k_live, (block_n, block_k))
                )
                return acc + dot(a, b, trans_b=True)
            b = masked_load(
                w_ref.at[expert, ks, cols], outer_mask(k_live, col_live, (block_k, block_n))
            )
            return acc + dot(a, b)

        acc = jnp.zeros((num, block_n), jnp.float32)
        acc = jax.lax.fori_loop(0, pl.cdiv(contract, block_k), step, acc)
        out_mask = outer_mask(row_live, col_live, (num, block_n))
        plgpu.store(y_ref.at[rows, cols], acc.astype(y_ref.dtype), mask=out_mask)

    compute = (live_rows > 0) & (expert < num_experts)
    if narrow_m is None:
        pl.when(compute)(lambda: matmul_rows(block_m))
    else:
        pl.when(compute & (live_rows <= narrow_m))(lambda: matmul_rows(narrow_m))
        pl.when(compute & (live_rows > narrow_m))(lambda: matmul_rows(block_m))

    @pl.when((live_rows > 0) & (expert >= num_experts))
    def _():
        # Rows past sum(group_sizes): zeros, nothing read.
        row_live = jnp.arange(block_m) < live_rows
        zeros = jnp.zeros((block_m, block_n), y_ref.dtype)
        out_mask = outer_mask(row_live, col_live, (block_m, block_n))
        plgpu.store(y_ref.at[pl.ds(row0, block_m), cols], zeros, mask=out_mask)


def _tiled_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    transpose_w: bool,
    config: BlockSizes,
    interpret: bool,
) -> jax.Array:
    """``y[r] = x[r] @ w[e]`` (``w[e]ᵀ`` with ``transpose_w``) over the tile schedule."""
    num_rows = x.shape[0]
    out_cols = w.shape[1] if transpose_w else w.shape[2]
    blocks = config
    schedule = tile_schedule(group_sizes, num_rows, blocks.block_m)
    num_col_blocks = pl.cdiv(out_cols, blocks.block_n)
    name = "grouped_matmul_dx" if transpose_w else "grouped_matmul"
    return pl.pallas_call(
        functools.partial(
            _tile_kernel,
            block_m=blocks.block_m,
            block_n=blocks.block_n,
            block_k=blocks.block_k,
            num_col_blocks=num_col_blocks,
            transpose_w=transpose_w,
            narrow_m=blocks.narrow_m,
        ),
        grid=(schedule[0].shape[0] * num_col_blocks,),
        out_shape=jax.ShapeDtypeStruct((num_rows, out_cols), x.dtype),
        compiler_params=compiler_params(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=(
            f"{name}_bm{blocks.block_m}_bn{blocks.block_n}_bk{blocks.block_k}"
            f"_w{blocks.num_warps}_s{blocks.num_stages}"
            + ("" if blocks.narrow_m is None else f"_nm{blocks.narrow_m}")
        ),
    )(*schedule, x, w)


def backward(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    dy: jax.Array,
    *,
    config: BlockSizes,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Pallas backward kernels of ``y = grouped_matmul(x, w, group_sizes)``: ``dy[M, N]``
    -> ``(dx[M, K], dw[E, K, N])``. ``dx`` is the forward tile kernel on ``w[e]ᵀ``, ``dw[e]``
    the per-expert ``x_eᵀ dy_e`` (``triton_vjp.weight_grad``); rows past
    ``sum(group_sizes)`` contribute nothing."""
    dy = dy.astype(x.dtype)
    with pallas_dtypes():
        dx = _tiled_matmul(dy, w, group_sizes, transpose_w=True, config=config, interpret=interpret)
        dw = triton_vjp.weight_grad(x, dy, group_sizes, config=config, interpret=interpret)
    return dx, dw


@functools.cache
def _differentiable(config: BlockSizes, interpret: bool):
    """The forward kernel with its Pallas backward kernels, for one config."""

    @jax.custom_vjp
    def matmul(x, w, group_sizes):
        return _tiled_matmul(
            x, w, group_sizes, transpose_w=False, config=config, interpret=interpret
        )

    def forward(x, w, group_sizes):
        return matmul(x, w, group_sizes), (x, w, group_sizes)

    def backward_rule(residuals, dy):
        x, w, group_sizes = residuals
        return (*backward(x, w, group_sizes, dy, config=config, interpret=interpret), None)

    matmul.defvjp(forward, backward_rule)
    return matmul


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    config: BlockSizes,
    interpret: bool = False,
) -> jax.Array:
    """See :func:`pallas_kernels.grouped_matmul`; arguments are already validated
    (``group_sizes`` int32, non-negative, summing to at most M)."""
    return _differentiable(config, interpret)(x, w, group_sizes)
