"""Chunk-aligned SSD scan as Pallas kernels lowered through Triton.

The SSD algorithm of Mamba2 (Dao & Gu, arXiv 2405.21060, section 6) over the chunk-aligned
varlen layout of ``pallas_kernels.metadata``, in three launches:

1. ``chunk_state`` (grid: head × chunk): dt processing (bias, softplus, clamp; zero past
   the chunk's end), the within-chunk cumulative decay ``cum = cumsum(dt' A)``, and the
   chunk's own state from a zero start, ``Σ_j exp(cum_last − cum_j) dt'_j x_j ⊗ B_j``.
2. ``state_passing`` (grid: sequence × head × head-dim block): walks each sequence's
   chunks in order, starting from ``initial_states``, ``s ← exp(cum_last) s + chunk_state``;
   records the state entering every chunk, and the final (or every intermediate) state. It
   runs along sequences, never over a flat chunk list that crosses them.
3. ``chunk_cb`` (grid: chunk × group × row block): ``C_c B_cᵀ`` once per group, not
   once per head; ``chunk_scan`` (grid: row block × head × chunk): for each row block,
   ``y = exp(cum_i) C_i · s_in + Σ_{j ≤ i} (C_i · B_j) exp(cum_i − cum_j) dt'_j x_j`` over
   the causal column blocks only, then the D skip and the z gate. Extra programs past the
   chunks zero the bucket rows that no sequence owns.

Chunks are read straight from the packed tokens with masked loads: a short chunk is
masked, never padded in memory. Padding chunks (past ``num_chunks``) exit at once. All
accumulation is fp32; exponents of decay differences are clamped to <= 0. Offsets into
arrays over 4 GiB are 64-bit (the Pallas Triton lowering switches on the array size).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import process_dt, silu
from pallas_kernels._pallas import MIN_DOT_DIM, block_dim, dot
from pallas_kernels.metadata import ChunkMetadata

# Head-dim rows per state-passing program (16 KiB fp32 tiles at N = 128).
_STATE_PASSING_BLOCK_P = 32


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the chunk-scan kernel and launch parameters of all three kernels."""

    block_m: int = 64  # chunk rows per chunk-scan program
    block_k: int = 32  # chunk columns per step of the causal loop
    num_warps: int = 4  # warps per program
    num_stages: int = 2  # software-pipelining depth of the causal loop

    def __post_init__(self):
        for name in ("block_m", "block_k"):
            value = getattr(self, name)
            if value < MIN_DOT_DIM or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT_DIM}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"{self.num_warps=} and {self.num_stages=} must be >= 1")


def default_block_sizes(chunk_size: int, head_dim: int, state_dim: int) -> BlockSizes:
    """64-row blocks stepping 32 columns at a time (the fastest of six tilings on an H200,
    tools/profile_ssd.py: 10% under 64×64 on bamba-uniform; 128-row blocks on 8 warps were
    25% slower); 8 warps once the head or state dim passes 128."""
    cs = block_dim(chunk_size, MIN_DOT_DIM)
    wide = max(head_dim, state_dim) > 128
    return BlockSizes(block_m=min(64, cs), block_k=min(32, cs), num_warps=8 if wide else 4)


def _compiler_params(blocks: BlockSizes, num_stages: int | None = None):
    return plgpu.CompilerParams(
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages if num_stages is None else num_stages,
    )


# --------------------------------------------------------------------------- 1. chunk state


def _chunk_state_kernel(
    cu_ref,  # [max_chunks + 1] int32
    x_ref,  # [T, H, P]
    dt_ref,  # [T, H]
    A_ref,  # [H] fp32
    B_ref,  # [T, G, N]
    dt_bias_ref,  # [H] fp32 or None
    dt_out_ref,  # [H, max_chunks, bcs] fp32: dt' (0 past the chunk's end)
    cum_ref,  # [H, max_chunks, bcs] fp32: within-chunk cumulative dt' A
    state_ref,  # [max_chunks, H, bp, bn] fp32: the chunk's state from a zero start
    *,
    heads_per_group: int,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    head_dim: int,
    state_dim: int,
):
    # Heads vary fastest: programs in flight together read whole token rows of x and
    # share the group's B in L2 (chunk-major order would scatter 128-byte reads).
    h, c = pl.program_id(0), pl.program_id(1)
    g = h // heads_per_group
    start = cu_ref[c]
    length = cu_ref[c + 1] - start
    bcs = cum_ref.shape[2]
    bp, bn = state_ref.shape[2:]

    @pl.when(length > 0)
    def _():
        rows = jnp.arange(bcs)
        live = rows < length
        dt = plgpu.load(dt_ref.at[pl.ds(start, bcs), h], mask=live, other=0.0)
        bias = None if dt_bias_ref is None else dt_bias_ref[h]
        dt = process_dt(dt.astype(jnp.float32), bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
        dt = jnp.where(live, dt, 0.0)
        cum = jnp.cumsum(dt * A_ref[h])
        # NOTE: the chunk total is cum at the chunk's last row, copied to the masked rows
        # after it. A parallel scan rounds cum[bcs - 1] differently from cum[length - 1]
        # even though only zeros lie between; with large |A dt| that rounding, through
        # exp(cum_last - cum_j), would scale the last token's contribution.
        cum_last = jnp.sum(jnp.where(rows == length - 1, cum, 0.0))
        cum = jnp.where(live, cum, cum_last)
        dt_out_ref[h, c, :] = dt
        cum_ref[h, c, :] = cum

        p_live = jnp.arange(bp) < head_dim
        n_live = jnp.arange(bn) < state_dim
        x = plgpu.load(
            x_ref.at[pl.ds(start, bcs), h, pl.ds(0, bp)],
            mask=live[:, None] & p_live[None, :],
            other=0.0,
        )
        B = plgpu.load(
            B_ref.at[pl.ds(start, bcs), g, pl.ds(0, bn)],
            mask=live[:, None] & n_live[None, :],
            other=0.0,
        )
        weight = jnp.exp(jnp.minimum(cum_last - cum, 0.0)) * dt  # decay to the chunk end
        B_weighted = (B.astype(jnp.float32) * weight[:, None]).astype(x.dtype)
        state_ref[c, h, :, :] = dot(x, B_weighted, trans_a=True)  # [bp, bn]


# ------------------------------------------------------------------------ 2. state passing


def _state_passing_kernel(
    first_chunk_ref,  # [B] int32: each sequence's first chunk
    num_seq_chunks_ref,  # [B] int32: its number of chunks
    cum_ref,  # [H, max_chunks, bcs] fp32
    state_ref,  # [max_chunks, H, bp, bn] fp32
    initial_ref,  # [B, H, P, N] or None
    zeros_ref,  # intermediate states' initial zeros (aliased to out_ref) or None
    carried_ref,  # [max_chunks, H, bp, bn] in C's dtype: state entering each chunk
    out_ref,  # [B, H, P, N] final, or [max_chunks, H, P, N] after each chunk
    *,
    head_dim: int,
    state_dim: int,
    intermediate: bool,
    block_p: int,
):
    del zeros_ref  # only supplies out_ref's initial contents
    # One program per (sequence, head, head-dim block): the walk along a sequence is
    # sequential and latency-bound, so more independent walks keep more loads in flight.
    b, h, pb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bn = state_ref.shape[3]
    bcs = cum_ref.shape[2]
    p0 = pb * block_p
    rows = pl.ds(p0, block_p)
    mask = (p0 + jnp.arange(block_p) < head_dim)[:, None] & (jnp.arange(bn) < state_dim)[None, :]
    if initial_ref is None:
        state = jnp.zeros((block_p, bn), jnp.float32)
    else:
        state = plgpu.load(initial_ref.at[b, h, rows, pl.ds(0, bn)], mask=mask, other=0.0).astype(
            jnp.float32
        )
    first = first_chunk_ref[b]
    last_row = jnp.arange(bcs) == bcs - 1

    def step(i, state):
        c = first + i
        # Stored in the dtype the chunk scan's tensor-core dot takes it in (rounding
        # here instead of after a fp32 round trip: the same values, half the bytes).
        carried_ref[c, h, rows, :] = state.astype(carried_ref.dtype)
        chunk_total = jnp.sum(jnp.where(last_row, cum_ref[h, c, :], 0.0))
        state = jnp.exp(jnp.minimum(chunk_total, 0.0)) * state + state_ref[c, h, rows, :]
        if intermediate:
            plgpu.store(
                out_ref.at[c, h, rows, pl.ds(0, bn)], state.astype(out_ref.dtype), mask=mask
            )
        return state

    state = jax.lax.fori_loop(0, num_seq_chunks_ref[b], step, state)
    if not intermediate:
        plgpu.store(out_ref.at[b, h, rows, pl.ds(0, bn)], state.astype(out_ref.dtype), mask=mask)


# ------------------------------------------------------------------------------ 3a. C·Bᵀ


def _chunk_cb_kernel(
    cu_ref,  # [max_chunks + 1] int32
    C_ref,  # [T, G, N]
    B_ref,  # [T, G, N]
    cb_ref,  # [max_chunks, G, bcs, bcs], C's dtype
    *,
    state_dim: int,
    block_m: int,
):
    """One row block of ``C_c B_cᵀ`` per program. Shared by the ``H / G`` heads of a group,
    so the chunk scan reads it instead of recomputing it once per head."""
    c, g, m = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start = cu_ref[c]
    length = cu_ref[c + 1] - start
    row0 = m * block_m
    bcs = cb_ref.shape[2]
    bn = block_dim(state_dim, MIN_DOT_DIM)

    @pl.when(row0 < length)
    def _():
        n_live = jnp.arange(bn) < state_dim
        live_i = row0 + jnp.arange(block_m) < length
        live_j = jnp.arange(bcs) < length
        C_i = plgpu.load(
            C_ref.at[pl.ds(start + row0, block_m), g, pl.ds(0, bn)],
            mask=live_i[:, None] & n_live[None, :],
            other=0.0,
        )
        B = plgpu.load(
            B_ref.at[pl.ds(start, bcs), g, pl.ds(0, bn)],
            mask=live_j[:, None] & n_live[None, :],
            other=0.0,
        )
        cb_ref[c, g, pl.ds(row0, block_m), :] = dot(C_i, B, trans_b=True).astype(cb_ref.dtype)


# --------------------------------------------------------------------------- 3b. chunk scan


def _chunk_scan_kernel(
    cu_ref,  # [max_chunks + 1] int32
    x_ref,  # [T, H, P]
    C_ref,  # [T, G, N]
    cb_ref,  # [max_chunks, G, bcs, bcs]: C_c B_cᵀ
    dt_ref,  # [H, max_chunks, bcs] fp32: dt'
    cum_ref,  # [H, max_chunks, bcs] fp32
    carried_ref,  # [max_chunks, H, bp, bn] in C's dtype
    D_ref,  # [H, P] fp32 or None
    z_ref,  # [T, H, P] or None
    y_ref,  # [T, H, P]
    *,
    heads_per_group: int,
    head_dim: int,
    state_dim: int,
    block_m: int,
    block_k: int,
):
    # Grid axis 0 varies fastest: the row blocks of one (chunk, head) run side by side and
    # share its carried state and x in L2 instead of re-reading them from memory.
    m, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g = h // heads_per_group
    max_chunks = cu_ref.shape[0] - 1
    bp, bn = carried_ref.shape[2:]
    bcs = cum_ref.shape[2]
    p_live = jnp.arange(bp) < head_dim
    n_live = jnp.arange(bn) < state_dim

    @pl.when(c < max_chunks)
    def _chunk():
        start = cu_ref[c]
        length = cu_ref[c + 1] - start
        row0 = m * block_m

        @pl.when(row0 < length)
        def _():
            rows_i = row0 + jnp.arange(block_m)
            live_i = rows_i < length
            cum_i = cum_ref[h, c, pl.ds(row0, block_m)]
            C_i = plgpu.load(
                C_ref.at[pl.ds(start + row0, block_m), g, pl.ds(0, bn)],
                mask=live_i[:, None] & n_live[None, :],
                other=0.0,
            )
            x_i = plgpu.load(
                x_ref.at[pl.ds(start + row0, block_m), h, pl.ds(0, bp)],
                mask=live_i[:, None] & p_live[None, :],
                other=0.0,
            )
            carried = carried_ref[c, h, :, :]  # [bp, bn]
            # Off-diagonal part: the state entering the chunk, decayed to each row.
            acc = dot(C_i, carried, trans_b=True) * jnp.exp(jnp.minimum(cum_i, 0.0))[:, None]

            def causal_block(k, acc):
                col0 = k * block_k
                rows_j = col0 + jnp.arange(block_k)
                live_j = rows_j < length
                x_j = plgpu.load(
                    x_ref.at[pl.ds(start + col0, block_k), h, pl.ds(0, bp)],
                    mask=live_j[:, None] & p_live[None, :],
                    other=0.0,
                )
                cum_j = cum_ref[h, c, pl.ds(col0, block_k)]
                dt_j = dt_ref[h, c, pl.ds(col0, block_k)]
                cb = cb_ref[c, g, pl.ds(row0, block_m), pl.ds(col0, block_k)].astype(jnp.float32)
                decay = jnp.exp(jnp.minimum(cum_i[:, None] - cum_j[None, :], 0.0))
                causal = rows_i[:, None] >= rows_j[None, :]
                weights = jnp.where(causal, cb * decay * dt_j[None, :], 0.0)
                return acc + dot(weights.astype(x_j.dtype), x_j)

            # Only column blocks at or left of the diagonal, and inside the chunk.
            num_k = jnp.minimum(pl.cdiv(row0 + block_m, block_k), pl.cdiv(length, block_k))
            acc = jax.lax.fori_loop(0, num_k, causal_block, acc)
            if D_ref is not None:
                D = plgpu.load(D_ref.at[h, pl.ds(0, bp)], mask=p_live, other=0.0)
                acc = acc + D[None, :] * x_i.astype(jnp.float32)
            if z_ref is not None:
                z = plgpu.load(
                    z_ref.at[pl.ds(start + row0, block_m), h, pl.ds(0, bp)],
                    mask=live_i[:, None] & p_live[None, :],
                    other=0.0,
                )
                acc = acc * silu(z.astype(jnp.float32))
            plgpu.store(
                y_ref.at[pl.ds(start + row0, block_m), h, pl.ds(0, bp)],
                acc.astype(y_ref.dtype),
                mask=live_i[:, None] & p_live[None, :],
            )

    # Programs past the chunks zero the bucket rows no sequence owns: [total, T).
    @pl.when(c >= max_chunks)
    def _tail():
        total = cu_ref[max_chunks]
        row0 = (c - max_chunks) * bcs + m * block_m
        rows = row0 + jnp.arange(block_m)
        num_tokens = y_ref.shape[0]

        @pl.when((row0 + block_m > total) & (row0 < num_tokens))
        def _():
            dead = (rows >= total) & (rows < num_tokens)
            plgpu.store(
                y_ref.at[pl.ds(row0, block_m), h, pl.ds(0, bp)],
                jnp.zeros((block_m, bp), y_ref.dtype),
                mask=dead[:, None] & p_live[None, :],
            )


# ------------------------------------------------------------------------------- wrapper


@dataclasses.dataclass(frozen=True)
class _Shapes:
    """Static sizes shared by the three launches."""

    num_tokens: int
    heads: int
    head_dim: int
    groups: int
    state_dim: int
    num_seqs: int
    max_chunks: int
    chunk_size: int

    @property
    def block_chunk(self) -> int:  # rows of a chunk, padded to a power of two
        return block_dim(self.chunk_size, MIN_DOT_DIM)

    @property
    def block_p(self) -> int:
        return block_dim(self.head_dim, MIN_DOT_DIM)

    @property
    def block_n(self) -> int:
        return block_dim(self.state_dim, MIN_DOT_DIM)


def chunk_state(s: _Shapes, cu, x, dt, A, B, dt_bias, *, dt_softplus, dt_limit, blocks, interpret):
    """Stage 1: ``(dt'[H, max_chunks, bcs], cum[H, max_chunks, bcs],
    chunk_states[max_chunks, H, bp, bn])``, all fp32."""
    f32 = jnp.float32
    bcs = s.block_chunk
    return pl.pallas_call(
        functools.partial(
            _chunk_state_kernel,
            heads_per_group=s.heads // s.groups,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            head_dim=s.head_dim,
            state_dim=s.state_dim,
        ),
        grid=(s.heads, s.max_chunks),
        out_shape=(
            jax.ShapeDtypeStruct((s.heads, s.max_chunks, bcs), f32),
            jax.ShapeDtypeStruct((s.heads, s.max_chunks, bcs), f32),
            jax.ShapeDtypeStruct((s.max_chunks, s.heads, s.block_p, s.block_n), f32),
        ),
        compiler_params=_compiler_params(blocks, num_stages=1),
        interpret=interpret,
        name=f"ssd_chunk_state_cs{s.chunk_size}",
    )(cu, x, dt, A, B, dt_bias)


def state_passing(
    s: _Shapes,
    metadata: ChunkMetadata,
    cum,
    chunk_states,
    initial_states,
    *,
    intermediate: bool,
    state_dtype,
    carried_dtype,
    blocks,
    interpret,
):
    """Stage 2: ``(carried[max_chunks, H, bp, bn], states)``, ``carried`` being the
    state entering each chunk and ``states`` the final ``[B, H, P, N]`` or, with
    ``intermediate``, the after-each-chunk ``[max_chunks, H, P, N]`` states."""
    # Each sequence's chunk range; seq_idx is non-decreasing over the real chunks.
    seq_sorted = jnp.where(metadata.seq_idx >= 0, metadata.seq_idx, s.num_seqs)
    first_chunk = jnp.searchsorted(seq_sorted, jnp.arange(s.num_seqs), side="left")
    last = metadata.last_chunk_indices
    num_seq_chunks = jnp.where(last >= 0, last - first_chunk + 1, 0).astype(jnp.int32)
    out_rows = s.max_chunks if intermediate else s.num_seqs
    states_shape = jax.ShapeDtypeStruct((out_rows, s.heads, s.head_dim, s.state_dim), state_dtype)
    zeros = jnp.zeros(states_shape.shape, state_dtype) if intermediate else None
    args = (first_chunk.astype(jnp.int32), num_seq_chunks, cum, chunk_states, initial_states, zeros)
    # Intermediate states start as zeros so padding chunks read 0 (None args take no slot).
    zeros_index = sum(a is not None for a in args[:-1])
    block_p = min(s.block_p, _STATE_PASSING_BLOCK_P)
    return pl.pallas_call(
        functools.partial(
            _state_passing_kernel,
            intermediate=intermediate,
            head_dim=s.head_dim,
            state_dim=s.state_dim,
            block_p=block_p,
        ),
        grid=(s.num_seqs, s.heads, s.block_p // block_p),
        out_shape=(
            jax.ShapeDtypeStruct((s.max_chunks, s.heads, s.block_p, s.block_n), carried_dtype),
            states_shape,
        ),
        input_output_aliases={zeros_index: 1} if intermediate else {},
        compiler_params=_compiler_params(blocks, num_stages=1),
        interpret=interpret,
        name=f"ssd_state_passing_intermediate{int(intermediate)}",
    )(*args)


def chunk_cb(s: _Shapes, cu, C, B, *, blocks, interpret):
    """Stage 3a: ``cb[max_chunks, G, bcs, bcs] = C_c B_cᵀ`` in C's dtype."""
    bcs = s.block_chunk
    block_m = min(blocks.block_m, bcs)
    return pl.pallas_call(
        functools.partial(_chunk_cb_kernel, state_dim=s.state_dim, block_m=block_m),
        grid=(s.max_chunks, s.groups, bcs // block_m),
        out_shape=jax.ShapeDtypeStruct((s.max_chunks, s.groups, bcs, bcs), C.dtype),
        compiler_params=_compiler_params(blocks, num_stages=1),
        interpret=interpret,
        name=f"ssd_chunk_cb_cs{s.chunk_size}_bm{block_m}",
    )(cu, C, B)


def chunk_scan(s: _Shapes, cu, x, C, cb, dt_chunks, cum, carried, D, z, *, blocks, interpret):
    """Stage 3b: ``y[T, H, P]`` in ``x``'s dtype, bucket rows past the chunks zeroed."""
    bcs = s.block_chunk
    block_m, block_k = min(blocks.block_m, bcs), min(blocks.block_k, bcs)
    tail_programs = pl.cdiv(s.num_tokens, bcs)
    return pl.pallas_call(
        functools.partial(
            _chunk_scan_kernel,
            heads_per_group=s.heads // s.groups,
            block_m=block_m,
            block_k=block_k,
            head_dim=s.head_dim,
            state_dim=s.state_dim,
        ),
        grid=(bcs // block_m, s.heads, s.max_chunks + tail_programs),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=_compiler_params(blocks),
        interpret=interpret,
        name=f"ssd_chunk_scan_cs{s.chunk_size}_bm{block_m}_bk{block_k}",
    )(cu, x, C, cb, dt_chunks, cum, carried, D, z)


def ssd_scan(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    *,
    metadata: ChunkMetadata,
    chunk_size: int,
    D: jax.Array | None,
    z: jax.Array | None,
    dt_bias: jax.Array | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    initial_states: jax.Array | None,
    return_intermediate_states: bool,
    state_dtype: jnp.dtype,
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """See :func:`pallas_kernels.ssd_scan`; arguments are already validated."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    s = _Shapes(
        num_tokens=T,
        heads=H,
        head_dim=P,
        groups=G,
        state_dim=N,
        num_seqs=metadata.last_chunk_indices.shape[0],
        max_chunks=metadata.max_chunks,
        chunk_size=chunk_size,
    )
    blocks = block_sizes or default_block_sizes(chunk_size, P, N)
    f32 = jnp.float32
    cu = metadata.cu_chunk_seqlens
    dt_bias = None if dt_bias is None else dt_bias.astype(f32)
    D = None if D is None else jnp.broadcast_to(D.astype(f32).reshape(H, -1), (H, P))

    dt_chunks, cum, chunk_states = chunk_state(
        s,
        cu,
        x,
        dt,
        A.astype(f32),
        B,
        dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        blocks=blocks,
        interpret=interpret,
    )
    carried, states = state_passing(
        s,
        metadata,
        cum,
        chunk_states,
        initial_states,
        intermediate=return_intermediate_states,
        state_dtype=state_dtype,
        carried_dtype=C.dtype,
        blocks=blocks,
        interpret=interpret,
    )
    cb = chunk_cb(s, cu, C, B, blocks=blocks, interpret=interpret)
    y = chunk_scan(
        s, cu, x, C, cb, dt_chunks, cum, carried, D, z, blocks=blocks, interpret=interpret
    )
    return y, states
