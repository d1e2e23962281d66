"""Gated grouped RMSNorm as a Pallas kernel lowered through Triton.

One program per (row block, group): the group's ``group_size`` channels of a few rows are
loaded once, the gate applied (before or after the norm), the mean square taken in fp32
and the result written once. Memory-bound: x and z are read once, y written once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import silu
from pallas_kernels._pallas import block_dim, compiler_params

# Elements of one program's tile: 32 fp32 registers per thread at 8 warps.
_TILE_ELEMENTS = 8192


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the norm kernel."""

    block_rows: int = 1  # rows per program
    num_warps: int = 8  # warps per program

    def __post_init__(self):
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


def _kernel(
    x_ref,  # [T, Dm]
    z_ref,  # [T, Dm] or None
    w_ref,  # [Dm]
    y_ref,  # [T, Dm]
    *,
    group_size: int,
    block_rows: int,
    eps: float,
    norm_before_gate: bool,
):
    i, g = pl.program_id(0), pl.program_id(1)
    num_rows = x_ref.shape[0]
    block_cols = block_dim(group_size)
    row0, col0 = i * block_rows, g * group_size
    row_live = row0 + jnp.arange(block_rows) < num_rows
    col_live = jnp.arange(block_cols) < group_size
    tile = row_live[:, None] & col_live[None, :]
    rows, cols = pl.ds(row0, block_rows), pl.ds(col0, block_cols)
    u = plgpu.load(x_ref.at[rows, cols], mask=tile, other=0.0).astype(jnp.float32)
    gate = None
    if z_ref is not None:
        z = plgpu.load(z_ref.at[rows, cols], mask=tile, other=0.0)
        gate = silu(z.astype(jnp.float32))
    if gate is not None and not norm_before_gate:
        u = u * gate
    inv_rms = jax.lax.rsqrt(jnp.sum(u * u, axis=1) / group_size + eps)
    w = plgpu.load(w_ref.at[cols], mask=col_live, other=0.0).astype(jnp.float32)
    y = u * inv_rms[:, None] * w[None, :]
    if gate is not None and norm_before_gate:
        y = y * gate
    plgpu.store(y_ref.at[rows, cols], y.astype(y_ref.dtype), mask=tile)


def gated_rms_norm(
    x: jax.Array,
    z: jax.Array | None,
    weight: jax.Array,
    *,
    group_size: int,
    eps: float,
    norm_before_gate: bool,
    config: BlockSizes,
    interpret: bool = False,
) -> jax.Array:
    """See :func:`pallas_kernels.gated_rms_norm`; arguments are already validated."""
    num_rows, dim = x.shape
    blocks = config
    return pl.pallas_call(
        functools.partial(
            _kernel,
            group_size=group_size,
            block_rows=blocks.block_rows,
            eps=eps,
            norm_before_gate=norm_before_gate,
        ),
        grid=(pl.cdiv(num_rows, blocks.block_rows), dim // group_size),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=compiler_params(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name=f"gated_rms_norm_gs{group_size}_rows{blocks.block_rows}",
    )(x, z, weight)
