"""Chunk-aligned SSD scan as Pallas kernels lowered through Triton.

The SSD algorithm of Mamba2 (Dao & Gu, arXiv 2405.21060, section 6) over the chunk-aligned
varlen layout of ``pallas_kernels.metadata``, in three launches:

1. ``state_scan`` (grid: head × sequence, longest sequences first): walks each sequence's
   chunks in order, ``block_t`` rows per step, starting from ``initial_states``: dt
   processing (bias, softplus, clamp; zero past the chunk's end), the within-chunk
   cumulative decay ``cum = cumsum(dt' A)``, and the state recursion
   ``s ← exp(Σ_step dt' A) s + Σ_j exp(cum_end − cum_j) dt'_j x_j ⊗ B_j``; records the
   state entering every chunk and the final (or every intermediate) state. It runs along
   sequences, never over a flat chunk list that crosses them, and no per-chunk state
   ever goes through memory (a separate chunk-state stage would write and re-read
   ``[chunks, H, P, N]`` fp32, a third of the scan's bytes).
2. ``chunk_cb`` (grid: chunk × group × row block): ``C_c B_cᵀ`` once per group, not
   once per head.
3. ``chunk_scan`` (grid: row block × head × chunk): for each row block,
   ``y = exp(cum_i) C_i · s_in + Σ_{j ≤ i} (C_i · B_j) exp(cum_i − cum_j) dt'_j x_j`` over
   the causal column blocks only, then the D skip and the z gate. A few extra programs
   zero the bucket rows that no sequence owns.

Chunks are read straight from the packed tokens with masked loads: a short chunk is
masked, never padded in memory. Padding chunks (past ``num_chunks``) exit at once. All
accumulation is fp32; exponents of decay differences are clamped to <= 0. Offsets into
arrays over 4 GiB are 64-bit (the Pallas Triton lowering switches on the array size).

Gradients (``jax.custom_vjp``): outside differentiation the scan is the three launches
above, unchanged. Under differentiation the state scan keeps the carried states in fp32
and the chunk scan also writes y before the D skip and the gate; with dt', the cumulative
decay and C·Bᵀ they are the residuals of the Pallas backward kernels in
``ssd/triton_vjp.py`` (chunk-granular: no per-token state is stored or recomputed). The
Mosaic GPU backend's stages save only dt', the cumulative decay and the carried states
(``residual_stages``): its backward kernels form C·Bᵀ and y before the gate themselves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import decay_factor, process_dt, silu
from pallas_kernels._pallas import (
    MIN_DOT_DIM,
    block_dim,
    compiler_params,
    dot,
    for_each_tail_block,
    static_index,
)
from pallas_kernels.metadata import ChunkMetadata
from pallas_kernels.ssd import triton_vjp
from pallas_kernels.ssd.triton_config import (
    TAIL_PROGRAMS,
    BlockSizes,
    Residuals,
    ScanShapes,
    default_backward_block_sizes,
    sequence_chunks,
)

# ----------------------------------------------------------- 1. chunk states, passed along


def _state_scan_kernel(
    order_ref,  # [B] int32: the sequences, longest first
    first_chunk_ref,  # [B] int32: each sequence's first chunk
    num_seq_chunks_ref,  # [B] int32: its number of chunks
    cu_ref,  # [max_chunks + 1] int32
    x_ref,  # [T, H, P]
    dt_ref,  # [T, H]
    A_ref,  # [H] fp32
    B_ref,  # [T, G, N]
    dt_bias_ref,  # [H] fp32 or None
    initial_ref,  # [B, H, P, N] or None
    zeros_ref,  # intermediate states' initial zeros (aliased to out_ref) or None
    dt_out_ref,  # [H, max_chunks, bcs] fp32: dt' (0 past the chunk's end)
    cum_ref,  # [H, max_chunks, bcs] fp32: within-chunk cumulative dt' A
    carried_ref,  # [max_chunks, H, bp, bn] in C's dtype: the state entering each chunk
    out_ref,  # [B, H, P, N] final, or [max_chunks, H, P, N] after each chunk
    *,
    heads_per_group: int,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    head_dim: int,
    state_dim: int,
    block_t: int,
    intermediate: bool,
):
    del zeros_ref  # only supplies out_ref's initial contents
    # Heads vary fastest: programs in flight together read whole token rows of x and
    # share the group's B in L2.
    h, b = pl.program_id(0), order_ref[pl.program_id(1)]
    g = h // heads_per_group
    bp, bn = carried_ref.shape[2:]
    bcs = cum_ref.shape[2]
    steps_per_chunk = bcs // block_t
    rows = jnp.arange(block_t)
    p_live = jnp.arange(bp) < head_dim
    n_live = jnp.arange(bn) < state_dim
    state_mask = p_live[:, None] & n_live[None, :]
    bias = None if dt_bias_ref is None else dt_bias_ref[h]
    if initial_ref is None:
        state = jnp.zeros((bp, bn), jnp.float32)
    else:
        state = plgpu.load(
            initial_ref.at[b, h, pl.ds(static_index(0), bp), pl.ds(static_index(0), bn)],
            mask=state_mask,
            other=0.0,
        ).astype(jnp.float32)
    first = first_chunk_ref[b]

    def step(i, carry):
        # One block_t-row step of chunk c. The state recursion runs at step granularity,
        # s <- exp(Σ_step dt'A) s + Σ_j exp(end - cum_j) dt'_j x_j ⊗ B_j, so a chunk's
        # state never needs its rows all at once and the loads pipeline across steps.
        state, prefix = carry  # prefix: cum at the end of the chunk's previous step
        # lax.div/rem: i >= 0, and jnp's floor semantics do not lower through Triton.
        c = first + jax.lax.div(i, steps_per_chunk)
        row0 = pl.multiple_of(jax.lax.rem(i, steps_per_chunk) * block_t, block_t)
        start = cu_ref[c] + row0
        num_live = cu_ref[c + 1] - start  # may be <= 0 (past a short chunk's end) or > block_t
        live = rows < num_live
        dt = plgpu.load(dt_ref.at[pl.ds(start, block_t), h], mask=live, other=0.0)
        dt = process_dt(dt.astype(jnp.float32), bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
        dt = jnp.where(live, dt, 0.0)
        cum = prefix + jnp.cumsum(dt * A_ref[h])
        # NOTE: the step's total is cum at its last live row, copied to the masked rows
        # after it. A parallel scan rounds cum[block_t - 1] differently from the last live
        # row's even though only zeros lie between; with large |A dt| that rounding,
        # through exp(end - cum_j), would scale the last token's contribution.
        last_row = jnp.minimum(num_live, block_t) - 1
        end = jnp.where(num_live > 0, jnp.sum(jnp.where(rows == last_row, cum, 0.0)), prefix)
        cum = jnp.where(live, cum, end)
        dt_out_ref[h, c, pl.ds(row0, block_t)] = dt
        cum_ref[h, c, pl.ds(row0, block_t)] = cum

        x = plgpu.load(
            x_ref.at[pl.ds(start, block_t), h, pl.ds(static_index(0), bp)],
            mask=live[:, None] & p_live[None, :],
            other=0.0,
        )
        B = plgpu.load(
            B_ref.at[pl.ds(start, block_t), g, pl.ds(static_index(0), bn)],
            mask=live[:, None] & n_live[None, :],
            other=0.0,
        )
        # Weighting x (P columns) rather than B (N >= P columns) halves the elementwise work.
        weight = decay_factor(end - cum) * dt  # decay to the step's end
        x_weighted = (x.astype(jnp.float32) * weight[:, None]).astype(x.dtype)

        @pl.when(row0 == 0)
        def _():
            # Stored in the dtype the chunk scan's tensor-core dot takes it in.
            carried_ref[c, h, :, :] = state.astype(carried_ref.dtype)

        decay = decay_factor(end - prefix)
        state = decay * state + dot(x_weighted, B.astype(x.dtype), trans_a=True)  # [bp, bn]
        last_step = row0 == bcs - block_t
        if intermediate:

            @pl.when(last_step)
            def _():
                plgpu.store(
                    out_ref.at[c, h, pl.ds(static_index(0), bp), pl.ds(static_index(0), bn)],
                    state.astype(out_ref.dtype),
                    mask=state_mask,
                )

        return state, jnp.where(last_step, 0.0, end)

    num_steps = num_seq_chunks_ref[b] * steps_per_chunk
    state, _ = jax.lax.fori_loop(0, num_steps, step, (state, jnp.float32(0.0)))
    if not intermediate:
        plgpu.store(
            out_ref.at[b, h, pl.ds(static_index(0), bp), pl.ds(static_index(0), bn)],
            state.astype(out_ref.dtype),
            mask=state_mask,
        )


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
            C_ref.at[pl.ds(start + row0, block_m), g, pl.ds(static_index(0), bn)],
            mask=live_i[:, None] & n_live[None, :],
            other=0.0,
        )
        B = plgpu.load(
            B_ref.at[pl.ds(start, bcs), g, pl.ds(static_index(0), bn)],
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
    carried_ref,  # [max_chunks, H, bp, bn] in C's dtype (fp32 under differentiation)
    D_ref,  # [H, P] fp32 or None
    z_ref,  # [T, H, P] or None
    y_ref,  # [T, H, P]
    y_ssm_ref,  # [T, H, P] fp32 or None: y before the D skip and the z gate (the backward's)
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
                C_ref.at[pl.ds(start + row0, block_m), g, pl.ds(static_index(0), bn)],
                mask=live_i[:, None] & n_live[None, :],
                other=0.0,
            )
            x_i = plgpu.load(
                x_ref.at[pl.ds(start + row0, block_m), h, pl.ds(static_index(0), bp)],
                mask=live_i[:, None] & p_live[None, :],
                other=0.0,
            )
            # fp32 under differentiation (the backward's residual), else already C's dtype.
            carried = carried_ref[c, h, :, :].astype(C_i.dtype)  # [bp, bn]
            # Off-diagonal part: the state entering the chunk, decayed to each row.
            acc = dot(C_i, carried, trans_b=True) * decay_factor(cum_i)[:, None]

            # Column blocks left of the row block (every row sees all their columns), then
            # the ones on the diagonal, inside the chunk.
            num_k = jnp.minimum(pl.cdiv(row0 + block_m, block_k), pl.cdiv(length, block_k))
            num_full = jnp.minimum(row0 // block_k, num_k)

            def causal_block(k, acc, *, diagonal: bool):
                col0 = k * block_k
                rows_j = col0 + jnp.arange(block_k)
                live_j = rows_j < length
                x_j = plgpu.load(
                    x_ref.at[pl.ds(start + col0, block_k), h, pl.ds(static_index(0), bp)],
                    mask=live_j[:, None] & p_live[None, :],
                    other=0.0,
                )
                cum_j = cum_ref[h, c, pl.ds(col0, block_k)]
                dt_j = dt_ref[h, c, pl.ds(col0, block_k)]
                cb = cb_ref[c, g, pl.ds(row0, block_m), pl.ds(col0, block_k)].astype(jnp.float32)
                decay = decay_factor(cum_i[:, None] - cum_j[None, :])
                weights = cb * decay * dt_j[None, :]
                if diagonal:
                    weights = jnp.where(rows_i[:, None] >= rows_j[None, :], weights, 0.0)
                    # 0 · NaN is NaN inside the dot: a non-finite x of this row block's own
                    # rows enters as 0 (the rows that see it are marked after the loop).
                    # Only diagonal blocks pay for it; the others keep their plain loads.
                    x_j = jnp.where((rows_j >= row0)[:, None] & ~jnp.isfinite(x_j), 0.0, x_j)
                return acc + dot(weights.astype(x_j.dtype), x_j)

            acc = jax.lax.fori_loop(
                0, num_full, functools.partial(causal_block, diagonal=False), acc
            )
            acc = jax.lax.fori_loop(
                num_full, num_k, functools.partial(causal_block, diagonal=True), acc
            )
            # Rows at or after the block's first non-finite x (per column) see it: NaN there.
            first_bad = jnp.min(jnp.where(jnp.isfinite(x_i), length, rows_i[:, None]), axis=0)
            acc = jnp.where(rows_i[:, None] >= first_bad[None, :], jnp.nan, acc)
            if y_ssm_ref is not None:
                plgpu.store(
                    y_ssm_ref.at[pl.ds(start + row0, block_m), h, pl.ds(static_index(0), bp)],
                    acc.astype(y_ssm_ref.dtype),
                    mask=live_i[:, None] & p_live[None, :],
                )
            if D_ref is not None:
                D = plgpu.load(D_ref.at[h, pl.ds(static_index(0), bp)], mask=p_live, other=0.0)
                acc = acc + D[None, :] * x_i.astype(jnp.float32)
            if z_ref is not None:
                z = plgpu.load(
                    z_ref.at[pl.ds(start + row0, block_m), h, pl.ds(static_index(0), bp)],
                    mask=live_i[:, None] & p_live[None, :],
                    other=0.0,
                )
                acc = acc * silu(z.astype(jnp.float32))
            plgpu.store(
                y_ref.at[pl.ds(start + row0, block_m), h, pl.ds(static_index(0), bp)],
                acc.astype(y_ref.dtype),
                mask=live_i[:, None] & p_live[None, :],
            )

    # Programs past the chunks zero the bucket rows no sequence owns: [total, T).
    @pl.when(c >= max_chunks)
    def _tail():
        num_tokens = y_ref.shape[0]

        def zero(row0):
            rows = row0 + m * block_m + jnp.arange(block_m)
            plgpu.store(
                y_ref.at[pl.ds(row0 + m * block_m, block_m), h, pl.ds(static_index(0), bp)],
                jnp.zeros((block_m, bp), y_ref.dtype),
                mask=(rows < num_tokens)[:, None] & p_live[None, :],
            )

        for_each_tail_block(
            zero,
            total=cu_ref[max_chunks],
            num_rows=num_tokens,
            block=bcs,
            program=c - max_chunks,
            num_programs=TAIL_PROGRAMS,
        )


# ------------------------------------------------------------------------------- wrapper


def _chunk_decay_kernel(
    cu_ref,  # [max_chunks + 1] int32
    dt_ref,  # [T, H]
    A_ref,  # [H] fp32
    dt_bias_ref,  # [H] fp32 or None
    dt_out_ref,  # [H, max_chunks, cs] fp32: dt' (0 past the chunk's end)
    cum_ref,  # [H, max_chunks, cs] fp32: within-chunk cumulative dt' A
    weight_ref,  # [H, max_chunks, cs] fp32: exp(cum_end - cum_j) dt'_j
    decay_ref,  # [H, max_chunks] fp32: exp(cum_end)
    *,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    block_h: int,
):
    c, h0 = pl.program_id(0), pl.program_id(1) * block_h
    cs = cum_ref.shape[2]
    start = cu_ref[c]
    num_live = cu_ref[c + 1] - start
    rows = jnp.arange(cs)
    heads = pl.ds(h0, block_h)
    head_live = h0 + jnp.arange(block_h) < dt_ref.shape[1]
    live = rows < num_live

    @pl.when(num_live > 0)  # padding chunks: nothing reads their rows
    def _chunk():
        mask = live[:, None] & head_live[None, :]
        dt = plgpu.load(dt_ref.at[pl.ds(start, cs), heads], mask=mask, other=0.0)
        bias = None
        if dt_bias_ref is not None:
            bias = plgpu.load(dt_bias_ref.at[heads], mask=head_live, other=0.0)[None, :]
        dt = process_dt(dt.astype(jnp.float32), bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
        dt = jnp.where(live[:, None], dt, 0.0)
        A = plgpu.load(A_ref.at[heads], mask=head_live, other=0.0)
        cum = jnp.cumsum(dt * A[None, :], axis=0)
        # The chunk's total is cum at its last live row, copied to the rows after it (as
        # the state scan does: a parallel scan may round cum[cs - 1] differently).
        last_row = jnp.minimum(num_live, cs) - 1
        end = jnp.sum(jnp.where(rows[:, None] == last_row, cum, 0.0), axis=0)
        cum = jnp.where(live[:, None], cum, end[None, :])
        weight = decay_factor(end[None, :] - cum) * dt
        out = pl.ds(static_index(0), cs)
        store_mask = head_live[:, None]
        plgpu.store(dt_out_ref.at[heads, c, out], dt.T, mask=store_mask)
        plgpu.store(cum_ref.at[heads, c, out], cum.T, mask=store_mask)
        plgpu.store(weight_ref.at[heads, c, out], weight.T, mask=store_mask)
        plgpu.store(decay_ref.at[heads, c], decay_factor(end), mask=head_live)


def chunk_decay(
    s: ScanShapes,
    metadata: ChunkMetadata,
    dt,
    A,
    dt_bias,
    *,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    interpret: bool = False,
):
    """What the Mosaic state and chunk scans take of dt, in one launch (one program per
    chunk and 16 heads; padding chunks exit at once and their rows stay unwritten):
    ``(dt'[H, max_chunks, cs], cum[H, max_chunks, cs], weight[H, max_chunks, cs],
    decay[H, max_chunks])``, fp32: dt' and the within-chunk cumulative decay as
    :func:`state_scan` writes them, ``weight_j = exp(cum_end − cum_j) dt'_j`` and the
    chunk's decay ``exp(cum_end)``. For power-of-two chunk sizes."""
    f32 = jnp.float32
    cs = s.chunk_size
    if cs != block_dim(cs):
        raise ValueError(f"chunk_size={cs} must be a power of two")
    block_h = min(16, block_dim(s.heads))
    chunked = jax.ShapeDtypeStruct((s.heads, s.max_chunks, cs), f32)
    return pl.pallas_call(
        functools.partial(
            _chunk_decay_kernel, dt_softplus=dt_softplus, dt_limit=dt_limit, block_h=block_h
        ),
        grid=(s.max_chunks, pl.cdiv(s.heads, block_h)),
        out_shape=(chunked, chunked, chunked, jax.ShapeDtypeStruct((s.heads, s.max_chunks), f32)),
        compiler_params=compiler_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"ssd_chunk_decay_cs{cs}_bh{block_h}",
    )(metadata.cu_chunk_seqlens, dt, A.astype(f32), dt_bias)


def state_scan(
    s: ScanShapes,
    metadata: ChunkMetadata,
    x,
    dt,
    A,
    B,
    dt_bias,
    initial_states,
    *,
    dt_softplus,
    dt_limit,
    intermediate: bool,
    state_dtype,
    carried_dtype,
    blocks,
    interpret,
):
    """Stage 1: ``(dt'[H, max_chunks, bcs], cum[H, max_chunks, bcs],
    carried[max_chunks, H, bp, bn], states)``: dt' and the within-chunk cumulative decay
    (fp32), the state entering each chunk, and the final ``[B, H, P, N]`` or, with
    ``intermediate``, the after-each-chunk ``[max_chunks, H, P, N]`` states."""
    f32 = jnp.float32
    bcs = s.block_chunk
    block_t = min(blocks.block_t, bcs)
    order, first_chunk, num_seq_chunks = sequence_chunks(s, metadata)
    out_rows = s.max_chunks if intermediate else s.num_seqs
    states_shape = jax.ShapeDtypeStruct((out_rows, s.heads, s.head_dim, s.state_dim), state_dtype)
    zeros = jnp.zeros(states_shape.shape, state_dtype) if intermediate else None
    args = (
        order,
        first_chunk,
        num_seq_chunks,
        metadata.cu_chunk_seqlens,
        x,
        dt,
        A,
        B,
        dt_bias,
        initial_states,
        zeros,
    )
    # Intermediate states start as zeros so padding chunks read 0 (None args take no slot).
    zeros_index = sum(a is not None for a in args[:-1])
    return pl.pallas_call(
        functools.partial(
            _state_scan_kernel,
            heads_per_group=s.heads // s.groups,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            head_dim=s.head_dim,
            state_dim=s.state_dim,
            block_t=block_t,
            intermediate=intermediate,
        ),
        grid=(s.heads, s.num_seqs),
        out_shape=(
            jax.ShapeDtypeStruct((s.heads, s.max_chunks, bcs), f32),
            jax.ShapeDtypeStruct((s.heads, s.max_chunks, bcs), f32),
            jax.ShapeDtypeStruct((s.max_chunks, s.heads, s.block_p, s.block_n), carried_dtype),
            states_shape,
        ),
        input_output_aliases={zeros_index: 3} if intermediate else {},
        compiler_params=compiler_params(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"ssd_state_scan_cs{s.chunk_size}_bt{block_t}_intermediate{int(intermediate)}",
    )(*args)


def chunk_cb(s: ScanShapes, cu, C, B, *, blocks, interpret):
    """Stage 3a: ``cb[max_chunks, G, bcs, bcs] = C_c B_cᵀ`` in C's dtype."""
    bcs = s.block_chunk
    block_m = min(blocks.block_m, bcs)
    return pl.pallas_call(
        functools.partial(_chunk_cb_kernel, state_dim=s.state_dim, block_m=block_m),
        grid=(s.max_chunks, s.groups, bcs // block_m),
        out_shape=jax.ShapeDtypeStruct((s.max_chunks, s.groups, bcs, bcs), C.dtype),
        compiler_params=compiler_params(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name=f"ssd_chunk_cb_cs{s.chunk_size}_bm{block_m}",
    )(cu, C, B)


def chunk_scan(
    s: ScanShapes,
    cu,
    x,
    C,
    cb,
    dt_chunks,
    cum,
    carried,
    D,
    z,
    *,
    blocks,
    interpret,
    with_ssm: bool = False,
):
    """Stage 3b: ``y[T, H, P]`` in ``x``'s dtype, bucket rows past the chunks zeroed; with
    ``with_ssm``, ``(y, y_ssm)``: also y before the D skip and the z gate (rows of the
    chunks only), which the backward reads instead of recomputing it."""
    bcs = s.block_chunk
    block_m, block_k = min(blocks.block_m, bcs), min(blocks.block_k, bcs)
    y, y_ssm = pl.pallas_call(
        functools.partial(
            _chunk_scan_kernel,
            heads_per_group=s.heads // s.groups,
            block_m=block_m,
            block_k=block_k,
            head_dim=s.head_dim,
            state_dim=s.state_dim,
        ),
        grid=(bcs // block_m, s.heads, s.max_chunks + TAIL_PROGRAMS),
        out_shape=(
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            # fp32: the backward's decay cotangent dy · y_ssm − dt' x · g cancels, and is
            # summed along the chunk; bf16 rounding of y_ssm there cost dt_bias 4% (bf16
            # inputs, tests/kernels/test_ssd_gradients.py).
            jax.ShapeDtypeStruct(x.shape, jnp.float32) if with_ssm else None,
        ),
        compiler_params=compiler_params(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"ssd_chunk_scan_cs{s.chunk_size}_bm{block_m}_bk{block_k}",
    )(cu, x, C, cb, dt_chunks, cum, carried, D, z)
    return (y, y_ssm) if with_ssm else y


def _forward(
    x,
    dt,
    A,
    B,
    C,
    D,
    z,
    dt_bias,
    initial_states,
    metadata: ChunkMetadata,
    *,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    return_intermediate_states: bool,
    state_dtype,
    config: BlockSizes,
    interpret: bool,
    residuals: bool = False,
    state_scan_fn=None,
    chunk_scan_fn=None,
    residual_stages=None,
):
    """The three launches: ``(y, states, saved)``. With ``residuals`` (under
    differentiation), ``saved`` is ``(dt_chunks, cum, carried, cb, y_ssm)`` for the
    backward, with the carried states in fp32 (the chunk scan casts them to C's dtype, so
    y is the same); else None and the carried states are in C's dtype, and the kernels
    given replace stages 1 (``state_scan_fn``, :func:`state_scan`'s signature) and
    3a + 3b (``chunk_scan_fn(s, metadata, x, C, B, dt_chunks, cum, carried, D, z)``): the
    Mosaic GPU backend's (``mosaic.py``). ``residual_stages``: that backend's pair under
    differentiation, ``(state_scan_fn, chunk_scan_fn)`` with the carried states in C's
    dtype (what its chunk scan consumed); its backward forms C·Bᵀ and ``y_ssm`` itself, so
    ``saved``'s cb and y_ssm are None."""
    s = ScanShapes.of(x, B, metadata)
    H, P = s.heads, s.head_dim
    blocks = config
    f32 = jnp.float32
    dt_bias = None if dt_bias is None else dt_bias.astype(f32)
    D = None if D is None else jnp.broadcast_to(D.astype(f32).reshape(H, -1), (H, P))

    mosaic_residuals = residuals and residual_stages is not None
    if mosaic_residuals:
        scan_states, chunk_scan_fn = residual_stages
    else:
        scan_states = state_scan if state_scan_fn is None or residuals else state_scan_fn
    dt_chunks, cum, carried, states = scan_states(
        s,
        metadata,
        x,
        dt,
        A.astype(f32),
        B,
        dt_bias,
        initial_states,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        intermediate=return_intermediate_states,
        state_dtype=state_dtype,
        carried_dtype=jnp.float32 if residuals and not mosaic_residuals else C.dtype,
        blocks=blocks,
        interpret=interpret,
    )
    cu = metadata.cu_chunk_seqlens
    if chunk_scan_fn is not None and (mosaic_residuals or not residuals):
        y = chunk_scan_fn(s, metadata, x, C, B, dt_chunks, cum, carried, D, z)
        return y, states, (dt_chunks, cum, carried, None, None) if residuals else None
    cb = chunk_cb(s, cu, C, B, blocks=blocks, interpret=interpret)
    y = chunk_scan(
        s,
        cu,
        x,
        C,
        cb,
        dt_chunks,
        cum,
        carried,
        D,
        z,
        blocks=blocks,
        interpret=interpret,
        with_ssm=residuals,
    )
    if not residuals:
        return y, states, None
    y, y_ssm = y
    return y, states, (dt_chunks, cum, carried, cb, y_ssm)


@functools.cache
def _differentiable(
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    return_intermediate_states: bool,
    state_dtype,
    config: BlockSizes,
    interpret: bool,
    state_scan_fn,
    chunk_scan_fn,
    residual_stages,
    chunk_dx_fn,
    row_terms_fn,
    chunk_dbc_fn,
):
    """The scan with its Pallas backward kernels (``ssd/triton_vjp.py``; its stages 2
    and 3 ``chunk_dx_fn`` with ``row_terms_fn``, and ``chunk_dbc_fn``, where given), for
    one set of static options. Outside differentiation it is the plain forward (with the
    stage kernels given, see ``_forward``); under it, the forward also returns the
    backward's residuals (``_forward(residuals=True)``: the Triton stages, or
    ``residual_stages``), with the same y and states."""
    options = dict(
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        return_intermediate_states=return_intermediate_states,
        state_dtype=state_dtype,
        config=config,
        interpret=interpret,
    )

    @jax.custom_vjp
    def scan(x, dt, A, B, C, D, z, dt_bias, initial_states, metadata):
        y, states, _ = _forward(
            x,
            dt,
            A,
            B,
            C,
            D,
            z,
            dt_bias,
            initial_states,
            metadata,
            state_scan_fn=state_scan_fn,
            chunk_scan_fn=chunk_scan_fn,
            **options,
        )
        return y, states

    def forward(x, dt, A, B, C, D, z, dt_bias, initial_states, metadata):
        y, states, saved = _forward(
            x,
            dt,
            A,
            B,
            C,
            D,
            z,
            dt_bias,
            initial_states,
            metadata,
            residuals=True,
            residual_stages=residual_stages,
            **options,
        )
        inputs = (x, dt, A, B, C, D, z, dt_bias, initial_states, metadata)
        return (y, states), (inputs, Residuals(*saved))

    def backward_rule(residuals, cotangents):
        (x, dt, A, B, C, D, z, dt_bias, initial_states, metadata), saved = residuals
        dy, dstates = cotangents
        grads = triton_vjp.ssd_scan_backward(
            x,
            dt,
            A,
            B,
            C,
            D,
            z,
            dt_bias,
            initial_states,
            saved,
            dy,
            dstates,
            metadata=metadata,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            return_intermediate_states=return_intermediate_states,
            config=default_backward_block_sizes(config, x.dtype),
            interpret=interpret,
            chunk_dx_fn=chunk_dx_fn,
            row_terms_fn=row_terms_fn,
            chunk_dbc_fn=chunk_dbc_fn,
        )
        # The chunk layout (integers) is not differentiated.
        return (*grads, None)

    scan.defvjp(forward, backward_rule)
    return scan


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
    config: BlockSizes,
    interpret: bool = False,
    state_scan_fn=None,
    chunk_scan_fn=None,
    residual_stages=None,
    chunk_dx_fn=None,
    row_terms_fn=None,
    chunk_dbc_fn=None,
) -> tuple[jax.Array, jax.Array]:
    """See :func:`pallas_kernels.ssd_scan`; arguments are already validated.
    Differentiable in x, dt, A, B, C, D, z, dt_bias and initial_states through the Pallas
    backward kernels of ``ssd/triton_vjp.py``. ``state_scan_fn`` and
    ``chunk_scan_fn``: the forward's stages outside differentiation, ``residual_stages``
    under it (see ``_forward``); None: the Triton ones. ``chunk_dx_fn`` with
    ``row_terms_fn``, ``chunk_dbc_fn``: the backward's stages 2 and 3
    (``triton_vjp.ssd_scan_backward``); None: the Triton ones."""
    del chunk_size  # the api checked it is metadata.chunk_size
    scan = _differentiable(
        bool(dt_softplus),
        tuple(float(v) for v in dt_limit),
        bool(return_intermediate_states),
        jnp.dtype(state_dtype),
        config,
        bool(interpret),
        state_scan_fn,
        chunk_scan_fn,
        residual_stages,
        chunk_dx_fn,
        row_terms_fn,
        chunk_dbc_fn,
    )
    return scan(x, dt, A, B, C, D, z, dt_bias, initial_states, metadata)
