"""Configuration of the Triton SSD scan: what its forward (``ssd/triton.py``) and backward
(``ssd/triton_vjp.py``) kernels both need, so that neither imports the other.

* :class:`BlockSizes` and :func:`default_block_sizes`: the forward's tiling and its
  heuristic; :class:`BackwardBlockSizes`, :func:`default_backward_block_sizes` and
  :func:`heads_per_program`: the backward's, derived from the forward's.
* :class:`ScanShapes` and :func:`sequence_chunks`: the static sizes of one scan and the
  per-sequence walk order that the forward's state scan and the backward's state pass share.
* :class:`Residuals`: what the forward keeps under differentiation for the backward.
* ``TAIL_PROGRAMS``: the programs that zero the bucket rows past the chunks, in the
  forward's chunk scan and the backward's ``chunk_dx`` alike.
"""

from __future__ import annotations

import dataclasses
from typing import Final, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels._common import search_sorted
from pallas_kernels._pallas import MIN_DOT_DIM, block_dim
from pallas_kernels._validation import check_int_fields
from pallas_kernels.metadata import ChunkMetadata

# Programs (per row block and head) that zero the bucket rows past the chunks: the
# forward's chunk scan writes y there, the backward's chunk_dx the gradients.
TAIL_PROGRAMS: Final = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the state-scan and chunk-scan kernels, launch parameters of all three."""

    block_m: int = 64  # chunk rows per chunk-scan program
    block_k: int = 32  # chunk columns per step of the causal loop
    block_t: int = 128  # chunk rows per step of the state scan
    num_warps: int = 4  # warps per program
    num_stages: int = 2  # software-pipelining depth of the causal and state-scan loops

    def __post_init__(self):
        check_int_fields(self)
        for name in ("block_m", "block_k", "block_t"):
            value = getattr(self, name)
            if value < MIN_DOT_DIM or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT_DIM}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"{self.num_warps=} and {self.num_stages=} must be >= 1")


def default_block_sizes(chunk_size: int, head_dim: int, state_dim: int) -> BlockSizes:
    """Chunk scan: 64-row blocks stepping 32 columns at a time (the fastest of six tilings
    on an H200, tools/profile_ssd.py: 10% under 64×64 on bamba-uniform; 128-row blocks on
    8 warps were 25% slower). State scan: 128-row steps (bamba-uniform 2.00 ms against
    2.16 ms with 64-row steps, bamba-short 1.70 against 1.84). 8 warps once the head or
    state dim passes 128."""
    cs = block_dim(chunk_size, MIN_DOT_DIM)
    wide = max(head_dim, state_dim) > 128
    return BlockSizes(
        block_m=min(64, cs),
        block_k=min(32, cs),
        block_t=min(128, cs),
        num_warps=8 if wide else 4,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackwardBlockSizes:
    """Tiling and launch parameters of the three backward launches."""

    block_m: int = 64  # chunk rows per chunk_dx / chunk_dbc program
    block_k: int = 32  # chunk rows per step of their loops over the chunk
    block_t: int = 128  # chunk rows per step of the state pass
    num_warps: int = 4  # warps per state-pass and chunk_dx program
    # chunk_dbc's own tiles (None: block_m, block_k): its ∂W tiles [dbc_block_m,
    # dbc_block_k] are summed over up to max_heads_per_program heads before each product
    # with B or C, so wider tiles mean fewer, larger products.
    dbc_block_m: int | None = None
    dbc_block_k: int | None = None
    dbc_num_warps: int = 8  # warps per chunk_dbc program (two [block_m, N] fp32 accumulators)
    num_stages: int = 2  # software-pipelining depth of the state pass and chunk_dx loops
    dbc_num_stages: int = 3  # the same for chunk_dbc's loops
    # Heads of a group one chunk_dbc program sums at most (a divisor of H / G is taken):
    # G = 1 with 128 heads runs 8 head splits, so a chunk's row blocks fill the device;
    # the splits' fp32 partial dB, dC ([splits, T, G, N]) are summed outside.
    max_heads_per_program: int = 16

    def __post_init__(self):
        check_int_fields(self)
        for name in ("block_m", "block_k", "block_t", "dbc_block_m", "dbc_block_k"):
            value = getattr(self, name)
            if value is None and name.startswith("dbc_"):
                continue
            if value < MIN_DOT_DIM or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT_DIM}")
        for name in (
            "num_warps",
            "dbc_num_warps",
            "num_stages",
            "dbc_num_stages",
            "max_heads_per_program",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


def default_backward_block_sizes(config: BlockSizes, dtype=jnp.bfloat16) -> BackwardBlockSizes:
    """The forward's row blocks (the backward's loops walk the same chunks), with wider
    steps over the chunk: 64 rows per chunk_dx step and ∂W tiles of 128 columns in
    chunk_dbc, pipelined 3 deep, on 8 warps at least (its two fp32 accumulators would spill
    on 4). On one H200, G 1 chunk 256 (a sweep of the backward's tilings): chunk_dx
    2.58 → 2.44 ms and chunk_dbc 6.23 → 2.97 ms against 32-row steps pipelined 2 deep;
    3 stages would slow the state pass (0.68 → 0.93 ms).

    With 4-byte inputs (``dtype``, x's) every tile is twice the size and chunk_dbc is not
    pipelined, to keep its fp32 tiles well inside Hopper's 227 KiB of shared memory. (The
    321 KiB a 4.6M-parameter fp32 hybrid's train step once asked for was the attention
    backward's dK/dV program, not this one; with it fixed, that step trains through the
    kernels on an H200, 2026-12-02.)"""
    wide = jnp.dtype(dtype).itemsize > 2
    return BackwardBlockSizes(
        block_m=config.block_m,
        block_k=min(64, config.block_m),
        block_t=config.block_t,
        num_warps=config.num_warps,
        dbc_block_k=128,
        dbc_num_warps=max(config.num_warps, 8),
        num_stages=config.num_stages,
        dbc_num_stages=1 if wide else 3,
    )


def heads_per_program(heads_per_group: int, blocks: BackwardBlockSizes) -> int:
    """Heads of a group one ``chunk_dbc`` program sums: the largest divisor of ``H / G``
    not above ``blocks.max_heads_per_program``."""
    limit = min(heads_per_group, blocks.max_heads_per_program)
    return max(d for d in range(1, limit + 1) if heads_per_group % d == 0)


class Residuals(NamedTuple):
    """What the forward under differentiation keeps for the backward (chunk-granular)."""

    dt_chunks: jax.Array  # [H, max_chunks, bcs] fp32: dt' (0 past a chunk's end)
    cum: jax.Array  # [H, max_chunks, bcs] fp32: within-chunk cumulative dt' A
    # [max_chunks, H, bp, bn]: the state entering each chunk, fp32 (Triton forward) or in
    # C's dtype (the Mosaic forward: what its chunk scan consumed).
    carried: jax.Array
    # [max_chunks, G, bcs, bcs]: C_c B_cᵀ (None where the backward's chunk_dx forms its own)
    cb: jax.Array | None
    y_ssm: jax.Array  # [T, H, P] fp32: y before the D skip and the z gate


@dataclasses.dataclass(frozen=True)
class ScanShapes:
    """Static sizes shared by the three launches: ``x[T, H, P]``, ``B, C[T, G, N]`` and the
    metadata's B sequences in ``max_chunks`` chunk slots of ``chunk_size`` rows."""

    heads: int  # H
    head_dim: int  # P
    groups: int  # G
    state_dim: int  # N
    num_seqs: int  # B
    max_chunks: int
    chunk_size: int

    @classmethod
    def of(cls, x: jax.Array, B: jax.Array, metadata: ChunkMetadata) -> ScanShapes:
        """The sizes of a scan of ``x`` and ``B`` over ``metadata``'s chunks."""
        _, H, P = x.shape
        G, N = B.shape[1:]
        return cls(
            heads=H,
            head_dim=P,
            groups=G,
            state_dim=N,
            num_seqs=metadata.last_chunk_indices.shape[0],
            max_chunks=metadata.max_chunks,
            chunk_size=metadata.chunk_size,
        )

    @property
    def block_chunk(self) -> int:  # rows of a chunk, padded to a power of two
        return block_dim(self.chunk_size, MIN_DOT_DIM)

    @property
    def block_p(self) -> int:
        return block_dim(self.head_dim, MIN_DOT_DIM)

    @property
    def block_n(self) -> int:
        return block_dim(self.state_dim, MIN_DOT_DIM)


def sequence_chunks(s: ScanShapes, metadata: ChunkMetadata) -> tuple[jax.Array, ...]:
    """``(order, first_chunk, num_seq_chunks)``, int32 ``[B]`` each: the sequences longest
    walk first (so the last state-scan programs to start are short ones), each sequence's
    first chunk and its number of chunks (seq_idx is non-decreasing over the real
    chunks)."""
    seq_sorted = jnp.where(metadata.seq_idx >= 0, metadata.seq_idx, s.num_seqs)
    first_chunk = search_sorted(seq_sorted, jnp.arange(s.num_seqs), side="left")
    last = metadata.last_chunk_indices
    num_seq_chunks = jnp.where(last >= 0, last - first_chunk + 1, 0).astype(jnp.int32)
    order = jnp.argsort(-num_seq_chunks, stable=True).astype(jnp.int32)
    return order, first_chunk.astype(jnp.int32), num_seq_chunks
