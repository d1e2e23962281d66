"""Configuration of the Triton norm kernels: the block sizes and their heuristic, which
the forward (``norm/triton.py``) and backward (``norm/triton_vjp.py``) kernels share."""

from __future__ import annotations

import dataclasses
from typing import Final

from pallas_kernels._pallas import block_dim
from pallas_kernels._validation import check_int_fields

# Elements of one program's tile: 32 fp32 registers per thread at 8 warps.
_TILE_ELEMENTS: Final = 8192


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the norm kernel."""

    block_rows: int = 1  # rows per program
    num_warps: int = 8  # warps per program

    def __post_init__(self):
        check_int_fields(self)
        if self.block_rows < 1 or self.block_rows & (self.block_rows - 1):
            raise ValueError(f"block_rows={self.block_rows} must be a power of two")
        if self.num_warps < 1:
            raise ValueError(f"num_warps={self.num_warps} must be >= 1")


def default_block_sizes(group_size: int) -> BlockSizes:
    """Heuristic: tiles of about 8k elements, so small groups still move a useful amount
    per program; 4 warps once the tile is small enough to be spread thin over 8."""
    block_rows = max(1, _TILE_ELEMENTS // block_dim(group_size))
    num_warps = 8 if block_rows * block_dim(group_size) >= 4096 else 4
    return BlockSizes(block_rows=block_rows, num_warps=num_warps)
