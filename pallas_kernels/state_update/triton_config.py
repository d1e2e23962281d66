"""Configuration of the Triton decode SSM step: the block sizes and their heuristic,
which the forward (``state_update/triton.py``), the fused Mamba2 decode step and the
api share."""

from __future__ import annotations

import dataclasses
from typing import Final

from jax.experimental import pallas as pl

from pallas_kernels._pallas import block_dim
from pallas_kernels._validation import check_int_fields

# Programs per launch below which heads are not grouped: 4 per SM of an H200 (132 SMs).
_MIN_PROGRAMS: Final = 512
# Heads per program at most (measured best on the H200, below).
_MAX_BLOCK_H: Final = 16
# Heads per program of an unrolled loop (``BlockSizes.unroll_heads``; best on the H200).
_UNROLLED_HEADS: Final = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the state-update kernel."""

    block_p: int = 32  # head-dim rows of the state tile per program
    block_h: int = 1  # heads per program, a loop (a power of two)
    num_warps: int = 4  # warps per program
    num_stages: int = 1  # software-pipelining depth of the loop over heads
    # The loop over heads unrolled, each head's dt', decay and D computed for the whole
    # block as vectors before it, and B and C loaded once when the block's heads share a
    # group: the loads of every head's state tile can then be issued at once.
    unroll_heads: bool = False

    def __post_init__(self):
        check_int_fields(self)
        for name in ("block_p", "block_h"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two")
        for name in ("num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


def default_block_sizes(
    head_dim: int, state_dim: int, *, rows: int = 1, num_heads: int = 1, gated: bool = False
) -> BlockSizes:
    """Heuristic: tiles of up to 8k elements with 8 warps (32 fp32 registers per thread),
    a whole head of Mamba2's 64 × 128 states per program; that reached 85-86% of the copy
    rate on the H200 (64 and 256 rows, H 128, P 64, N 128, fp32 states) with the state
    loads kept in L2 for their write-back, against 82% for 4k tiles with 4 warps. With
    many rows, up to 16 heads per program in a 2-stage loop at 16 warps, as long as the
    launch keeps ``_MIN_PROGRAMS`` programs: 88-89% at 64 and 256 rows (2 heads 86-87%,
    4 heads 86-88%, 8 heads at 8 warps 85-89%; benchmarks/results/nvidia_h200.json).
    With the z gate (``gated``) the 16-warp whole-head tiles fall to 74-75% of copy; half
    heads (32 × 128) at 8 warps keep 87-88% (H200, 2026-11-27, same run). Without it, where
    the loop would take 4 heads or more, 4 heads unrolled at 16 warps instead: 89.3 / 89.3%
    of copy at 64 / 256 rows against the 16-head loop's 86.9 / 87.3% (H200, 2026-11-28, same
    run; 89.2-89.3 / 89.2-89.4 against 88.2-88.3 / 88.5-88.8 in others; benchmarks/results/
    nvidia_h200_ssu_variants.json). Since the row became the slowest dimension of the launch
    (``triton.launch_grid``), those 4 heads in half-head tiles at 8 warps: 91.1-91.4 /
    91.5-92.5% against 89.8-90.7 / 90.3-91.5% for whole heads at 16 warps (H200, 2026-11-29,
    two processes); gated, 4 heads unrolled in quarter-head tiles at 4 warps: 90.1 / 90.4%
    against the 16-head loop's 87.2 / 88.0% (same day, one process). Both keep 16 fp32
    state elements a thread a head. Below half ``_MIN_PROGRAMS`` whole-head programs (a
    one-row step), half-head tiles."""
    block_p = max(1, min(block_dim(head_dim), 8192 // block_dim(state_dim)))
    programs = rows * pl.cdiv(head_dim, block_p) * num_heads
    if programs < _MIN_PROGRAMS // 2 and block_p > 32:
        # Too few programs to keep the loads in flight (one row: 128): half-head tiles
        # double them. 2.61 µs against 2.88 for the one-row update of Bamba-9B's 128
        # heads (H200, 2026-11-27, same run).
        block_p //= 2
        programs *= 2
    block_h = 1
    while block_h < _MAX_BLOCK_H and programs // (2 * block_h) >= _MIN_PROGRAMS:
        block_h *= 2
    if block_h == 1:
        return BlockSizes(block_p=block_p, num_warps=8)
    if block_h >= _UNROLLED_HEADS:
        # Gated, quarter-head tiles at 4 warps: half-head ones at 8 ran 88.3 / 89.4%.
        tile, warps = (2048, 4) if gated else (4096, 8)
        block_p = max(1, min(block_p, tile // block_dim(state_dim)))
        return BlockSizes(
            block_p=block_p, block_h=_UNROLLED_HEADS, num_warps=warps, unroll_heads=True
        )
    if gated:
        block_p = max(1, min(block_p, 4096 // block_dim(state_dim)))
        return BlockSizes(block_p=block_p, block_h=block_h, num_warps=8, num_stages=2)
    return BlockSizes(block_p=block_p, block_h=block_h, num_warps=16, num_stages=2)
