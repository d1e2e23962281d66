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

The backward pass (``jax.custom_vjp``) runs the same tile kernel for
``dx = grouped_matmul(dy, w[e]ᵀ)`` and a per-expert kernel for ``dw[e] = x_eᵀ dy_e``
(one program per ``[block_k, block_n]`` tile of ``dw[e]``, looping over the expert's rows).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import search_sorted
from pallas_kernels._pallas import MIN_DOT_DIM, block_dim, compiler_params, dot, masked_load
from pallas_kernels._validation import check_int_fields
from pallas_kernels.backend import pallas_dtypes

# Rows per expert from which a call is compute-bound (prefill): 128-row tiles keep the
# tensor cores fed; below it a call streams weights and smaller row tiles waste less.
_COMPUTE_BOUND_ROWS = 128
# Row tiles of a weight-streaming call (see default_block_sizes).
_WIDE_TILE_ROWS = 64


def _is_power_of_2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the grouped matmul kernels."""

    block_m: int = 128  # rows of x per program (a row tile never spans two experts)
    block_n: int = 128  # output columns per program
    block_k: int = 64  # contraction step of the K loop
    num_warps: int = 4  # warps per program
    num_stages: int = 3  # software-pipelining depth of the K loop
    narrow_m: int | None = None  # rows of the dot of tiles with at most this many rows

    def __post_init__(self):
        check_int_fields(self)
        for name in ("block_m", "block_n", "block_k", "narrow_m"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_power_of_2(value) or value < MIN_DOT_DIM:
                raise ValueError(
                    f"{name}={value} must be a power of two >= {MIN_DOT_DIM} "
                    "(Triton's tensor-core dot)"
                )
        if self.narrow_m is not None and self.narrow_m >= self.block_m:
            raise ValueError(f"narrow_m={self.narrow_m} must be below block_m={self.block_m}")
        if not _is_power_of_2(self.num_warps):
            raise ValueError(f"num_warps={self.num_warps} must be a power of two")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")


def _block_k(k: int, dtype: jnp.dtype, preferred: int) -> int:
    """The largest power of two <= ``preferred`` (and >= 16) that divides K, so the K loop
    needs no masks; ``preferred`` when none does (the last step is masked)."""
    for block in (preferred, preferred // 2, preferred // 4):
        if block >= MIN_DOT_DIM and k % block == 0:
            return min(block, block_dim(k, MIN_DOT_DIM))
    return min(preferred, block_dim(k, MIN_DOT_DIM))


def _block_n(n: int, candidates: tuple[int, ...]) -> int:
    """The candidate (widest first) whose last column block wastes the fewest columns."""
    waste = {b: pl.cdiv(n, b) * b - n for b in candidates}
    best = min(waste.values())
    return min(max(b for b in candidates if waste[b] == best), block_dim(n, MIN_DOT_DIM))


def default_block_sizes(m: int, k: int, n: int, num_experts: int, dtype) -> BlockSizes:
    """Heuristic, from the mean rows per expert ``m / E``:

    * compute-bound (>= 128 rows per expert, e.g. 8192-token prefill): 128-row tiles and
      128×256 or 128×128 output tiles with 64-deep K steps, 3-4 stages: the tile shapes of
      Triton's Hopper matmul tutorial (wgmma on 8 or 4 warps; 48 KiB or 32 KiB of shared
      memory per stage in bf16);
    * weight-streaming (fewer rows, e.g. decode): 64-row tiles, so an expert that draws
      many rows streams its weights once per 64 rows from few programs, with a narrow path
      for the tiles of the experts that draw a few: the smallest power of two >= the mean
      rows per expert (at least 16 for the dot). A call of at most that many rows, or
      whose mean reaches 64, has one tile size. K in 128-deep steps (wide loads), 4 stages.

    fp32 inputs use half-depth K steps (twice the bytes per element).
    """
    itemsize = jnp.dtype(dtype).itemsize
    rows = pl.cdiv(m, max(num_experts, 1))
    if rows >= _COMPUTE_BOUND_ROWS:
        block_n = _block_n(n, (256, 128) if itemsize <= 2 else (128,))
        return BlockSizes(
            block_m=128,
            block_n=block_n,
            block_k=_block_k(k, dtype, 64 if itemsize <= 2 else 32),
            num_warps=8 if block_n == 256 else 4,
            num_stages=3 if block_n == 256 else 4,
        )
    narrow = max(MIN_DOT_DIM, block_dim(rows))
    wide = _WIDE_TILE_ROWS if m > narrow and narrow < _WIDE_TILE_ROWS else None
    return BlockSizes(
        block_m=wide or narrow,
        narrow_m=narrow if wide else None,
        block_n=_block_n(n, (128, 64)),
        block_k=_block_k(k, dtype, 128 if itemsize <= 2 else 64),
        num_warps=4,
        num_stages=4,
    )


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


def _both(a: jax.Array | None, b: jax.Array | None, shape: tuple[int, int]) -> jax.Array | None:
    """The ``shape`` mask ``a[:, None] & b[None, :]``; either may be None (no mask on that
    axis), both None gives None (an unmasked load)."""
    if a is None and b is None:
        return None
    a = jnp.ones((shape[0],), jnp.bool_) if a is None else a
    b = jnp.ones((shape[1],), jnp.bool_) if b is None else b
    return a[:, None] & b[None, :]


def _tail_mask(start, block: int, size: int) -> jax.Array | None:
    """``start + arange(block) < size``, or None when every block is full."""
    if size % block == 0:
        return None
    return start + jnp.arange(block) < size


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
    col_live = _tail_mask(col0, block_n, out_cols)
    cols = pl.ds(col0, block_n)
    live_rows = row_end - row0

    def matmul_rows(num: int) -> None:
        """The tile's first ``num`` rows (those past ``row_end`` masked) times the expert."""
        row_live = jnp.arange(num) < live_rows
        rows = pl.ds(row0, num)

        def step(k, acc):
            k0 = pl.multiple_of(k * block_k, block_k)
            ks = pl.ds(k0, block_k)
            k_live = _tail_mask(k0, block_k, contract)
            a = masked_load(x_ref.at[rows, ks], _both(row_live, k_live, (num, block_k)))
            if transpose_w:
                b = masked_load(
                    w_ref.at[expert, cols, ks], _both(col_live, k_live, (block_n, block_k))
                )
                return acc + dot(a, b, trans_b=True)
            b = masked_load(w_ref.at[expert, ks, cols], _both(k_live, col_live, (block_k, block_n)))
            return acc + dot(a, b)

        acc = jnp.zeros((num, block_n), jnp.float32)
        acc = jax.lax.fori_loop(0, pl.cdiv(contract, block_k), step, acc)
        out_mask = _both(row_live, col_live, (num, block_n))
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
        out_mask = _both(row_live, col_live, (block_m, block_n))
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


def _weight_grad_kernel(
    offset_ref,  # [E + 1] int32: expert e owns rows [offset[e], offset[e + 1])
    x_ref,  # [M, K]
    dy_ref,  # [M, N]
    dw_ref,  # [E, K, N]
    *,
    block_m: int,
    block_k: int,
    block_n: int,
    num_k_blocks: int,
    num_n_blocks: int,
):
    pid = pl.program_id(0)
    blocks_per_expert = num_k_blocks * num_n_blocks
    e = jax.lax.div(pid, blocks_per_expert)
    r = jax.lax.rem(pid, blocks_per_expert)
    k0 = pl.multiple_of(jax.lax.div(r, num_n_blocks) * block_k, block_k)
    n0 = pl.multiple_of(jax.lax.rem(r, num_n_blocks) * block_n, block_n)
    K, N = dw_ref.shape[1:]
    k_live, n_live = _tail_mask(k0, block_k, K), _tail_mask(n0, block_n, N)
    ks, ns = pl.ds(k0, block_k), pl.ds(n0, block_n)
    start, end = offset_ref[e], offset_ref[e + 1]

    def step(i, acc):
        r0 = start + i * block_m
        live = jnp.arange(block_m) < end - r0
        rows = pl.ds(r0, block_m)
        a = masked_load(x_ref.at[rows, ks], _both(live, k_live, (block_m, block_k)))
        b = masked_load(dy_ref.at[rows, ns], _both(live, n_live, (block_m, block_n)))
        return acc + dot(a, b, trans_a=True)

    # lax.div: the row count is >= 0, and jnp's floor division does not lower through Triton.
    num_steps = jax.lax.div(end - start + block_m - 1, block_m)
    acc = jax.lax.fori_loop(0, num_steps, step, jnp.zeros((block_k, block_n), jnp.float32))
    plgpu.store(
        dw_ref.at[e, ks, ns],
        acc.astype(dw_ref.dtype),
        mask=_both(k_live, n_live, (block_k, block_n)),
    )


def _weight_grad(
    x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *, config: BlockSizes, interpret: bool
) -> jax.Array:
    """``dw[e] = x_eᵀ dy_e`` over each expert's rows (0 for an expert without rows)."""
    (_, K), N, E = x.shape, dy.shape[1], group_sizes.shape[0]
    blocks = config
    offsets = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes, dtype=jnp.int32)]
    )
    num_k_blocks, num_n_blocks = pl.cdiv(K, blocks.block_k), pl.cdiv(N, blocks.block_n)
    return pl.pallas_call(
        functools.partial(
            _weight_grad_kernel,
            block_m=blocks.block_m,
            block_k=blocks.block_k,
            block_n=blocks.block_n,
            num_k_blocks=num_k_blocks,
            num_n_blocks=num_n_blocks,
        ),
        grid=(E * num_k_blocks * num_n_blocks,),
        out_shape=jax.ShapeDtypeStruct((E, K, N), x.dtype),
        compiler_params=compiler_params(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"grouped_matmul_dw_bm{blocks.block_m}_bk{blocks.block_k}_bn{blocks.block_n}",
    )(offsets, x, dy)


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
    the per-expert ``x_eᵀ dy_e``; rows past ``sum(group_sizes)`` contribute nothing."""
    dy = dy.astype(x.dtype)
    with pallas_dtypes():
        dx = _tiled_matmul(dy, w, group_sizes, transpose_w=True, config=config, interpret=interpret)
        dw = _weight_grad(x, dy, group_sizes, config=config, interpret=interpret)
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
