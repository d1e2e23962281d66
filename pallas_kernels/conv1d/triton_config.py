"""Configuration of the Triton conv1d kernels: the block sizes, their heuristics and the
tail-program count that the forward (``conv1d/triton.py``) and backward
(``conv1d/triton_vjp.py``) kernels share."""

from __future__ import annotations

import dataclasses
from typing import Final

from pallas_kernels._pallas import block_dim
from pallas_kernels._validation import check_int_fields

# Programs per channel block that zero the bucket rows past the sequences (the prefill
# writes y there, its backward dx).
TAIL_PROGRAMS: Final = 8


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the conv kernels."""

    block_t: int = 128  # tokens per prefill program
    unroll_t: int = 4  # tokens per step of a prefill program's loop (>= K - 1), unrolled
    block_d: int = 256  # channels per program
    num_warps: int = 2  # warps per program

    def __post_init__(self):
        check_int_fields(self)
        for name in ("block_t", "unroll_t", "block_d"):
            value = getattr(self, name)
            if value < 4 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 4")
        if self.unroll_t > self.block_t:
            raise ValueError(f"unroll_t={self.unroll_t} must be <= block_t={self.block_t}")
        if self.num_warps < 1:
            raise ValueError(f"num_warps={self.num_warps} must be >= 1")


def default_block_sizes(dim: int, width: int) -> BlockSizes:
    """Measured on an H200 (tools/tune_conv1d.py, bamba-conv): 256 channels on two warps
    (4 channels per thread per row), 128 tokens per program in steps of 8 rows: 0.32 ms.
    Steps of 4 rows took 0.34 ms, 512-channel blocks on 4 warps 0.35 ms; before the
    activation took few instructions, 8-row steps were the slower ones (0.43 against
    0.41 ms) and one program per 16 rows (67k programs) took 0.49 ms."""
    unroll_t = max(8, block_dim(width - 1))
    return BlockSizes(
        block_t=max(128, unroll_t),
        unroll_t=unroll_t,
        block_d=min(256, block_dim(dim, 4)),
        num_warps=2,
    )


def check_block_sizes(config: BlockSizes, width: int) -> None:
    """A prefill config must step at least ``K - 1`` rows at a time (the carried window)."""
    if config.unroll_t < width - 1:
        raise ValueError(f"config.unroll_t={config.unroll_t} must be >= K - 1 = {width - 1}")


def default_update_block_sizes(dim: int) -> BlockSizes:
    """Decode moves few bytes per row: 256-channel blocks on 4 warps (``block_t`` unused)."""
    return BlockSizes(block_t=4, unroll_t=4, block_d=min(256, block_dim(dim, 4)), num_warps=4)
