"""Configuration of the Mosaic GPU SSD chunk scan (``ssd/mosaic.py``): its block sizes,
the heuristic and the support and shared-memory checks that pick and vet them, and the
thread-block layout constants the kernels and the shared-memory estimate both use."""

from __future__ import annotations

import dataclasses
from typing import Final

import jax.numpy as jnp

from pallas_kernels._validation import check_int_fields

CONSUMERS: Final = 2
ROWS: Final = 64  # rows of a wgmma block; a chunk is chunk_size // ROWS of them
BLOCK_ROWS: Final = CONSUMERS * ROWS  # rows of a chunk one thread block computes
HEAD_DIM: Final = 64
_CHUNK_SIZES: Final = (128, 256)
_STATE_DIMS: Final = (64, 128, 256)
# Opt-in shared memory of a Hopper thread block (227 KiB), less room for the barriers.
SMEM_BUDGET: Final = 227 * 1024 - 1024
_MAX_HEADS_PER_BLOCK: Final = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the Mosaic GPU chunk-scan kernel."""

    # Heads of one group a thread block walks, reusing the chunk's C, B and C·Bᵀ. None:
    # default_heads_per_block; else it must divide the heads per group.
    heads_per_block: int | None = None
    num_stages: int = 2  # slots of the per-head TMA ring
    # Heads of one group a block of the backward's chunk_dbc sums (its dB and dC come in
    # H / G / dbc_heads_per_block partials). None: default_heads_per_block.
    dbc_heads_per_block: int | None = None

    def __post_init__(self):
        check_int_fields(self)
        for name in ("heads_per_block", "dbc_heads_per_block"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")


def default_heads_per_block(heads_per_group: int) -> int:
    """The most heads, at most 16, that divide the heads per group (16 against 8: 0.73 and
    0.78 ms for the bamba-uniform chunk scan on an H200, 0.43 and 0.47 for nemotronh-ragged)."""
    return max(d for d in range(1, _MAX_HEADS_PER_BLOCK + 1) if heads_per_group % d == 0)


def smem_bytes(*, chunk_size: int, state_dim: int, num_stages: int, itemsize: int) -> int:
    """Shared memory of one block: its rows of C, the chunk's B and then in its place the
    per-head ring, C·Bᵀ, the dt'/cum/D vectors and the consumers' output tiles."""
    c_tile = BLOCK_ROWS * state_dim * itemsize
    b_tile = chunk_size * state_dim * itemsize
    per_head = (chunk_size * HEAD_DIM + HEAD_DIM * state_dim) * itemsize
    cb = cb_blocks(chunk_size) * ROWS * ROWS * itemsize
    vectors = num_stages * (2 * chunk_size + HEAD_DIM) * 4
    staging = 2 * CONSUMERS * ROWS * HEAD_DIM * itemsize
    return c_tile + max(b_tile, num_stages * per_head) + cb + vectors + staging


# Per consumer and output slot, the backward chunk_dx's ∂dt' and q rows (fp32) on their
# way out (more than the backward rows' dy · y_ssm vector, one per consumer).
_DX_VECTOR_BYTES: Final = CONSUMERS * 2 * 2 * ROWS * 4


def backward_supports(*, chunk_size: int, state_dim: int, num_stages: int, itemsize: int) -> bool:
    """Whether the Mosaic backward's ``chunk_dx`` (``mosaic_vjp.py``) and rows
    (``mosaic.row_terms``) fit in shared memory where the forward does: the chunk scan's
    layout (for ``chunk_dx`` with B and C exchanged, dy in x's place, the state cotangent
    in the carried state's) and the rows' vectors. They do not at chunk 256 with N 256,
    where the Triton forward and backward run under differentiation."""
    need = smem_bytes(
        chunk_size=chunk_size, state_dim=state_dim, num_stages=num_stages, itemsize=itemsize
    )
    return need + _DX_VECTOR_BYTES <= SMEM_BUDGET


def chunk_dbc_supports(*, chunk_size: int, state_dim: int, num_stages: int, itemsize: int) -> bool:
    """Whether the Mosaic backward's ``chunk_dbc`` (``mosaic_vjp.py``) takes these sizes:
    its dB or dC sums ``[64, N]`` fp32 in a consumer's registers (N <= 128), and in shared
    memory the chunk's B or C, a ring of per-head slots (the block's 128 own rows, the
    chunk's other operand, the state) and the dt'/cum vectors."""
    resident = chunk_size * state_dim * itemsize
    per_head = (BLOCK_ROWS * HEAD_DIM + chunk_size * HEAD_DIM + HEAD_DIM * state_dim) * itemsize
    vectors = num_stages * 2 * chunk_size * 4
    staged = CONSUMERS * ROWS * state_dim * 4  # the sums on their way out, in the ring
    ring = max(num_stages * per_head, staged)
    return state_dim <= 128 and resident + ring + vectors <= SMEM_BUDGET


def supports(x, dt, A, B, C, *, chunk_size: int, z=None, **_) -> str | None:
    """Why the Mosaic GPU chunk scan cannot take this call (None: it can). Static facts
    only: shapes and dtypes."""
    del dt, A
    if x.dtype not in (jnp.bfloat16, jnp.float16):
        return f"x is {x.dtype}; the wgmma kernel takes bf16 or fp16"
    if B.dtype != x.dtype or C.dtype != x.dtype or (z is not None and z.dtype != x.dtype):
        return f"B, C (and z) must have x's dtype {x.dtype}"
    if x.shape[2] != HEAD_DIM:
        return f"head dim {x.shape[2]} is not {HEAD_DIM}"
    if B.shape[2] not in _STATE_DIMS:
        return f"state dim {B.shape[2]} is not one of {_STATE_DIMS}"
    if chunk_size not in _CHUNK_SIZES:
        return f"chunk_size={chunk_size} is not one of {_CHUNK_SIZES}"
    if x.shape[0] < chunk_size:
        # TMA boxes of a chunk's rows would be taller than the arrays.
        return f"T={x.shape[0]} is below chunk_size={chunk_size}"
    need = smem_bytes(
        chunk_size=chunk_size,
        state_dim=B.shape[2],
        num_stages=BlockSizes().num_stages,
        itemsize=x.dtype.itemsize,
    )
    if need > SMEM_BUDGET:
        return (
            f"chunk_size={chunk_size} with state dim {B.shape[2]} needs {need} B of shared memory"
        )
    return None


def check_block_sizes(config: BlockSizes, *, heads_per_group: int, **sizes) -> None:
    """``heads_per_block`` must divide the heads per group; the ring must fit."""
    for name in ("heads_per_block", "dbc_heads_per_block"):
        value = getattr(config, name)
        if value is not None and heads_per_group % value:
            raise ValueError(
                f"config.{name}={value} must divide the heads per group H / G = {heads_per_group}"
            )
    need = smem_bytes(num_stages=config.num_stages, **sizes)
    if need > SMEM_BUDGET:
        raise ValueError(
            f"config.num_stages={config.num_stages} needs {need} B of shared memory "
            f"(at most {SMEM_BUDGET})"
        )


def cb_blocks(chunk_size: int) -> int:
    """64 × 64 blocks of C·Bᵀ a thread block keeps: its two row blocks' causal ones, at
    most those of a chunk's last two row blocks."""
    last = chunk_size // ROWS - 1
    return last + (last + 1) if last >= 1 else 1
