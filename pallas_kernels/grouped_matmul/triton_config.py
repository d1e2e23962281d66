"""Configuration of the Triton grouped matmul: the block sizes and their heuristic, which
the forward (``grouped_matmul/triton.py``) and backward (``grouped_matmul/triton_vjp.py``)
kernels share."""

from __future__ import annotations

import dataclasses
from typing import Final

import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import MIN_DOT_DIM, block_dim
from pallas_kernels._validation import check_int_fields

# Rows per expert from which a call is compute-bound (prefill): 128-row tiles keep the
# tensor cores fed; below it a call streams weights and smaller row tiles waste less.
_COMPUTE_BOUND_ROWS: Final = 128
# Row tiles of a weight-streaming call (see default_block_sizes).
_WIDE_TILE_ROWS: Final = 64


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
