"""Backward pass of the chunk-aligned SSD scan as Pallas kernels lowered through Triton.

The reverse of ``ssd/triton.py``'s three launches (Mamba2, Dao & Gu, arXiv 2405.21060,
section 6), on the same chunk-aligned varlen layout and from the forward's chunk-granular
residuals: ``dt'`` and the within-chunk cumulative decay ``cum`` ([H, chunks, bcs] fp32),
the fp32 state entering every chunk ``s_in`` ([chunks, H, P, N]), ``C_c B_cᵀ`` and the
output before the D skip and the z gate, ``y_ssm`` (written by the forward's chunk scan
under differentiation only). No per-token state is ever stored. Per chunk, with
``W_ij = (C_i · B_j) exp(cum_i − cum_j)`` (``i ≥ j``), the forward is::

    y_i     = exp(cum_i) C_i · s_in + Σ_{j ≤ i} W_ij dt'_j x_j + D x_i      (then · silu(z_i))
    s_out   = exp(cum_last) s_in + Σ_j exp(cum_last − cum_j) dt'_j x_j ⊗ B_j

Three launches:

1. ``state_pass`` (grid: head × sequence): walks each sequence's chunks backwards with the
   state cotangent ``ds``: ``ds_out(c)`` (what reaches the state after chunk ``c``: the next
   chunk's ``ds_in`` plus the cotangent of the returned states), recorded per chunk, then
   ``ds_in(c) = exp(cum_last) ds_out + Σ_i exp(cum_i) dy_i ⊗ C_i``; ``d initial_states`` is
   ``ds_in`` of the first chunk. It also applies the z gate to the output cotangent
   (``dy = dy_out · silu(z)``, written once for the other two launches) and records the
   chunk-total decay term ``exp(cum_last) <ds_out, s_in>``.
2. ``chunk_dx`` (grid: row block × head × chunk): for the block's rows ``j``,
   ``g_j = exp(cum_last − cum_j) ds_out B_j + Σ_{i ≥ j} W_ij dy_i``, giving
   ``dx_j = dt'_j g_j + D dy_j`` and ``∂dt'_j = x_j · g_j``; from ``y_ssm``, ``dz`` and the
   decay cotangent ``∂cum_j = dy_j · y_ssm_j − dt'_j x_j · g_j`` (the row and column sums
   of the causal block's ``∂W ∘ W`` collapse to these dot products), and a ``D`` partial.
3. ``chunk_dbc`` (grid: row block × chunk × group and head split): for the block's rows
   ``r``, summed over the heads of the group (loops inside the program: per-head partials
   would be [T, H, N] fp32), ``dC_r = Σ_h exp(cum_r) dy_r s_in + Σ_{j ≤ r} ∂W_rj B_j`` and
   ``dB_r = Σ_h exp(cum_last − cum_r) dt'_r ds_outᵀ x_r + Σ_{i ≥ r} ∂W_irᵀ C_i`` with
   ``∂W_ij = Σ_h (dy_i · x_j) exp(cum_i − cum_j) dt'_j``: the heads are summed into each
   ``[block_m, block_k]`` tile of ``∂W`` before its one product with the group's B or C.

The Mosaic GPU backend replaces 2 and 3 with its own kernels (``ssd/mosaic_vjp.py``,
``chunk_dx_fn`` and ``chunk_dbc_fn`` of :func:`ssd_scan_backward`); its ``chunk_dx``
computes only the sums over the chunk. The rows' own terms (dz, ``dy · y_ssm``, D's partial)
then come from its forward chunk scan run again on the residuals (``row_terms_fn``, which
forms ``y_ssm`` in registers, so the forward saves neither it nor C·Bᵀ).

``jnp`` glue then sums small per-chunk arrays: ``∂a_k = Σ_{i ≥ k} ∂cum_i`` plus the chunk
total's terms (a reverse cumsum over ``[H, chunks, bcs]``), ``ddt' += A ∂a``,
``dA = Σ dt' ∂a``, the dt chain rule (bias, softplus, clamp) and the head splits of
``dB``/``dC``. All accumulation is fp32; exponents are clamped to <= 0 as in the forward;
masks select. Rows past the chunks, and padding chunks, get zero gradients.

The gradients assume decays ``exp(dt' A) <= 1`` (``dt' A <= 0``: A < 0 and dt' >= 0, as in
every Mamba2 layer, whose A is ``-exp(A_log)`` and dt' a softplus or clamped at 0). Where
``dt' A > 0`` the forward's clamp to ``exp(0)`` is active and its derivative 0, which the
backward does not apply to dA and ddt (the other gradients stay exact).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import decay_factor, silu, silu_grad
from pallas_kernels._pallas import (
    compiler_params,
    dot,
    for_each_tail_block,
    static_index,
)
from pallas_kernels.metadata import ChunkMetadata
from pallas_kernels.ssd.triton_config import (
    TAIL_PROGRAMS,
    BackwardBlockSizes,
    Residuals,
    ScanShapes,
    heads_per_program,
    sequence_chunks,
)

# ------------------------------------------------------------- 1. reverse state passing


def _state_pass_kernel(
    order_ref,  # [B] int32: the sequences, longest first
    first_chunk_ref,  # [B] int32: each sequence's first chunk
    num_seq_chunks_ref,  # [B] int32: its number of chunks
    cu_ref,  # [max_chunks + 1] int32
    dy_ref,  # [T, H, P]: cotangent of y
    z_ref,  # [T, H, P] or None
    C_ref,  # [T, G, N]
    cum_ref,  # [H, max_chunks, bcs] fp32
    carried_ref,  # [max_chunks, H, bp, bn] fp32: s_in
    dstates_ref,  # [B, H, P, N] (final) or [max_chunks, H, P, N] (intermediate) cotangent
    dyg_ref,  # [T, H, P] in x's dtype: dy · silu(z) (with z only)
    ds_out_ref,  # [max_chunks, H, bp, bn] in x's dtype: the state cotangent after each chunk
    dlast_ref,  # [H, max_chunks] fp32: exp(cum_last) <ds_out, s_in>
    dinit_ref,  # [B, H, P, N] fp32
    *,
    heads_per_group: int,
    head_dim: int,
    state_dim: int,
    block_t: int,
    intermediate: bool,
):
    # Heads vary fastest, as in the forward's state scan; the longest walks start first.
    h, b = pl.program_id(0), order_ref[pl.program_id(1)]
    g = h // heads_per_group
    bp, bn = carried_ref.shape[2:]
    bcs = cum_ref.shape[2]
    rows = jnp.arange(block_t)
    p_live = jnp.arange(bp) < head_dim
    n_live = jnp.arange(bn) < state_dim
    state_mask = p_live[:, None] & n_live[None, :]
    cdt = ds_out_ref.dtype

    def load_state(ref, index):
        return plgpu.load(
            ref.at[index, h, pl.ds(static_index(0), bp), pl.ds(static_index(0), bn)],
            mask=state_mask,
            other=0.0,
        ).astype(jnp.float32)

    first, num_chunks = first_chunk_ref[b], num_seq_chunks_ref[b]

    def chunk_step(i, ds):
        c = first + num_chunks - 1 - i  # backwards along the sequence
        ds_out = ds + load_state(dstates_ref, c) if intermediate else ds
        ds_out_ref[c, h, :, :] = ds_out.astype(cdt)
        decay_last = decay_factor(cum_ref[h, c, bcs - 1])  # cum past the end holds cum_last
        s_in = carried_ref[c, h, :, :]
        dlast_ref[h, c] = decay_last * jnp.sum(ds_out * s_in)
        start, end = cu_ref[c], cu_ref[c + 1]

        def row_step(k, ds):
            row0 = pl.multiple_of(k * block_t, block_t)
            live = rows < end - start - row0
            mask = live[:, None] & p_live[None, :]
            at = pl.ds(start + row0, block_t), h, pl.ds(static_index(0), bp)
            dy_out = plgpu.load(dy_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)
            dy = dy_out
            if z_ref is not None:
                z = plgpu.load(z_ref.at[at], mask=mask, other=0.0).astype(jnp.float32)
                dy = dy * silu(z)
                plgpu.store(dyg_ref.at[at], dy.astype(dyg_ref.dtype), mask=mask)
            C = plgpu.load(
                C_ref.at[pl.ds(start + row0, block_t), g, pl.ds(static_index(0), bn)],
                mask=live[:, None] & n_live[None, :],
                other=0.0,
            )
            weight = decay_factor(cum_ref[h, c, pl.ds(row0, block_t)])
            dy_w = jnp.where(live[:, None], dy * weight[:, None], 0.0)
            return ds + dot(dy_w.astype(cdt), C.astype(cdt), trans_a=True)

        num_steps = pl.cdiv(end - start, block_t)
        return jax.lax.fori_loop(0, num_steps, row_step, decay_last * ds_out)

    # Without intermediate states only the final state carries a cotangent in: it is the
    # one after the last chunk (and, for a sequence without chunks, d initial_states).
    ds = jnp.zeros((bp, bn), jnp.float32) if intermediate else load_state(dstates_ref, b)
    ds = jax.lax.fori_loop(0, num_chunks, chunk_step, ds)
    plgpu.store(
        dinit_ref.at[b, h, pl.ds(static_index(0), bp), pl.ds(static_index(0), bn)],
        ds,
        mask=state_mask,
    )


# ------------------------------------------------------------------- 2. dx, dt', dcum, dz


def _chunk_dx_kernel(
    cu_ref,  # [max_chunks + 1] int32
    x_ref,  # [T, H, P]
    B_ref,  # [T, G, N]
    cb_ref,  # [max_chunks, G, bcs, bcs]: C_c B_cᵀ
    dt_ref,  # [H, max_chunks, bcs] fp32: dt'
    cum_ref,  # [H, max_chunks, bcs] fp32
    y_ssm_ref,  # [T, H, P] fp32: the forward's y before the D skip and the z gate
    ds_out_ref,  # [max_chunks, H, bp, bn]: state cotangent after the chunk
    D_ref,  # [H, P] fp32 or None
    z_ref,  # [T, H, P] or None
    dy_ref,  # [T, H, P]: cotangent of the (gated) output
    dyg_ref,  # [T, H, P]: dy · silu(z) (with z), else dy_ref again
    dx_ref,  # [T, H, P]
    dz_ref,  # [T, H, P] or None
    ddt_ref,  # [H, max_chunks, bcs] fp32: ∂dt' (without the decay's part), 0 off the chunk
    dcum_ref,  # [H, max_chunks, bcs] fp32: ∂cum per row, 0 off the chunk
    q_ref,  # [H, max_chunks, bcs] fp32: the state's part of ∂cum_last per row
    dD_ref,  # [bcs // block_m, max_chunks, H, bp] fp32: partial Σ dy x, or None
    *,
    heads_per_group: int,
    head_dim: int,
    state_dim: int,
    block_m: int,
    block_k: int,
):
    m, h, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g = h // heads_per_group
    max_chunks = cu_ref.shape[0] - 1
    bp, bn = ds_out_ref.shape[2:]
    bcs = cum_ref.shape[2]
    p_live = jnp.arange(bp) < head_dim
    n_live = jnp.arange(bn) < state_dim
    cdt = x_ref.dtype
    row0 = m * block_m
    chunk = jnp.minimum(c, max_chunks - 1)
    start = cu_ref[chunk]
    length = jnp.where(c < max_chunks, cu_ref[chunk + 1] - start, 0)
    active = row0 < length

    def tokens(ref, r0, size, mask):
        at = pl.ds(start + r0, size), h, pl.ds(static_index(0), bp)
        return plgpu.load(ref.at[at], mask=mask[:, None] & p_live[None, :], other=0.0)

    def group_rows(ref, r0, size, mask):
        at = pl.ds(start + r0, size), g, pl.ds(static_index(0), bn)
        return plgpu.load(ref.at[at], mask=mask[:, None] & n_live[None, :], other=0.0)

    @pl.when(active)
    def _():
        rows_j = row0 + jnp.arange(block_m)
        live_j = rows_j < length
        x_j = tokens(x_ref, row0, block_m, live_j)
        xf = x_j.astype(jnp.float32)
        # The block's own rows gate dy in fp32 (dyg is rounded to x's dtype for the dots).
        dy_out = tokens(dy_ref, row0, block_m, live_j).astype(jnp.float32)
        if z_ref is not None:
            z = tokens(z_ref, row0, block_m, live_j).astype(jnp.float32)
            silu_z, dsilu_z = silu(z), silu_grad(z)
            dy_j = dy_out * silu_z
        else:
            dy_j = dy_out
        dt_j = dt_ref[h, c, pl.ds(row0, block_m)]
        cum_j = cum_ref[h, c, pl.ds(row0, block_m)]
        cum_last = cum_ref[h, c, bcs - 1]
        B_j = group_rows(B_ref, row0, block_m, live_j).astype(cdt)
        ds_out = ds_out_ref[c, h, :, :].astype(cdt)
        y = tokens(y_ssm_ref, row0, block_m, live_j).astype(jnp.float32)

        # The state's part: d s_out / d(dt'_j x_j) = exp(cum_last − cum_j) ds_out B_j.
        g_state = dot(B_j, ds_out, trans_b=True) * decay_factor(cum_last - cum_j)[:, None]
        q = dt_j * jnp.sum(xf * g_state, axis=1)

        def g_block(i, g_acc, *, diagonal: bool):
            # Rows i >= the block's rows see x_j: Σ_i W_ij dy_i.
            r0 = i * block_k
            rows_i = r0 + jnp.arange(block_k)
            live_i = rows_i < length
            dy_i = tokens(dyg_ref, r0, block_k, live_i)
            cum_i = cum_ref[h, c, pl.ds(r0, block_k)]
            cb = cb_ref[c, g, pl.ds(r0, block_k), pl.ds(row0, block_m)].astype(jnp.float32)
            keep = live_i[:, None]
            if diagonal:
                keep = keep & (rows_i[:, None] >= rows_j[None, :])
            weights = jnp.where(keep, cb * decay_factor(cum_i[:, None] - cum_j[None, :]), 0.0)
            return g_acc + dot(weights.astype(cdt), dy_i.astype(cdt), trans_a=True)

        # Row blocks overlapping the block's rows need the causal mask; later ones do not.
        first_i = row0 // block_k
        end_diag = jnp.minimum(pl.cdiv(row0 + block_m, block_k), pl.cdiv(length, block_k))
        g_diag = jnp.zeros((block_m, bp), jnp.float32)
        g_diag = jax.lax.fori_loop(
            first_i, end_diag, functools.partial(g_block, diagonal=True), g_diag
        )
        g_diag = jax.lax.fori_loop(
            end_diag, pl.cdiv(length, block_k), functools.partial(g_block, diagonal=False), g_diag
        )
        g_all = g_state + g_diag
        ddt = jnp.sum(xf * g_all, axis=1)
        dx = dt_j[:, None] * g_all
        dcum = jnp.sum(dy_j * y, axis=1) - dt_j * ddt
        y_pre = y
        if D_ref is not None:
            D = plgpu.load(D_ref.at[h, pl.ds(static_index(0), bp)], mask=p_live, other=0.0)
            dx = dx + D[None, :] * dy_j
            y_pre = y + D[None, :] * xf
            dD_ref[m, c, h, :] = jnp.sum(jnp.where(live_j[:, None], dy_j * xf, 0.0), axis=0)
        out_mask = live_j[:, None] & p_live[None, :]
        at = pl.ds(start + row0, block_m), h, pl.ds(static_index(0), bp)
        plgpu.store(dx_ref.at[at], dx.astype(dx_ref.dtype), mask=out_mask)
        if z_ref is not None:
            dz = dy_out * y_pre * dsilu_z
            plgpu.store(dz_ref.at[at], dz.astype(dz_ref.dtype), mask=out_mask)
        ddt_ref[h, c, pl.ds(row0, block_m)] = jnp.where(live_j, ddt, 0.0)
        dcum_ref[h, c, pl.ds(row0, block_m)] = jnp.where(live_j, dcum, 0.0)
        q_ref[h, c, pl.ds(row0, block_m)] = jnp.where(live_j, q, 0.0)

    @pl.when(~active & (c < max_chunks))
    def _idle():
        # Every element of the per-row and partial outputs is written: the sums outside
        # read them all.
        zeros = jnp.zeros((block_m,), jnp.float32)
        ddt_ref[h, c, pl.ds(row0, block_m)] = zeros
        dcum_ref[h, c, pl.ds(row0, block_m)] = zeros
        q_ref[h, c, pl.ds(row0, block_m)] = zeros
        if dD_ref is not None:
            dD_ref[m, c, h, :] = jnp.zeros((bp,), jnp.float32)

    # Programs past the chunks zero the gradient rows no sequence owns: [total, T).
    @pl.when(c >= max_chunks)
    def _tail():
        num_tokens = dx_ref.shape[0]

        def zero(r0):
            rows = r0 + m * block_m + jnp.arange(block_m)
            mask = (rows < num_tokens)[:, None] & p_live[None, :]
            at = pl.ds(r0 + m * block_m, block_m), h, pl.ds(static_index(0), bp)
            for ref in (dx_ref, dz_ref):
                if ref is not None:
                    plgpu.store(ref.at[at], jnp.zeros((block_m, bp), ref.dtype), mask=mask)

        for_each_tail_block(
            zero,
            total=cu_ref[max_chunks],
            num_rows=num_tokens,
            block=bcs,
            program=c - max_chunks,
            num_programs=TAIL_PROGRAMS,
        )


# ---------------------------------------------------------------------------- 3. dB, dC


def _chunk_dbc_kernel(
    cu_ref,  # [max_chunks + 1] int32
    x_ref,  # [T, H, P]
    B_ref,  # [T, G, N]
    C_ref,  # [T, G, N]
    dt_ref,  # [H, max_chunks, bcs] fp32: dt'
    cum_ref,  # [H, max_chunks, bcs] fp32
    carried_ref,  # [max_chunks, H, bp, bn] fp32: s_in
    ds_out_ref,  # [max_chunks, H, bp, bn]: state cotangent after the chunk
    dyg_ref,  # [T, H, P]: cotangent of the pre-gate output
    dB_ref,  # [splits, T, G, bn] fp32: this head split's dB
    dC_ref,  # [splits, T, G, bn] fp32: this head split's dC
    *,
    heads_per_group: int,
    heads_per_program: int,
    head_dim: int,
    state_dim: int,
    block_m: int,
    block_k: int,
):
    m, c, gs = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    splits = heads_per_group // heads_per_program
    g, split = jax.lax.div(gs, splits), jax.lax.rem(gs, splits)
    head0 = g * heads_per_group + split * heads_per_program
    bp, bn = carried_ref.shape[2:]
    bcs = cum_ref.shape[2]
    p_live = jnp.arange(bp) < head_dim
    n_live = jnp.arange(bn) < state_dim
    cdt = x_ref.dtype
    start = cu_ref[c]
    length = cu_ref[c + 1] - start
    row0 = m * block_m

    def tokens(ref, h, r0, size, mask):
        at = pl.ds(start + r0, size), h, pl.ds(static_index(0), bp)
        return plgpu.load(ref.at[at], mask=mask[:, None] & p_live[None, :], other=0.0)

    def group_rows(ref, r0, size, mask):
        at = pl.ds(start + r0, size), g, pl.ds(static_index(0), bn)
        return plgpu.load(ref.at[at], mask=mask[:, None] & n_live[None, :], other=0.0)

    @pl.when(row0 < length)
    def _():
        rows_r = row0 + jnp.arange(block_m)
        live_r = rows_r < length

        def state_step(k, acc):
            # The carried state's parts, per head: exp(cum_r) dy_r s_in into dC_r and
            # exp(cum_last − cum_r) dt'_r x_r ds_out into dB_r.
            dB, dC = acc
            h = head0 + k
            cum_r = cum_ref[h, c, pl.ds(row0, block_m)]
            dt_r = dt_ref[h, c, pl.ds(row0, block_m)]
            decay_r = decay_factor(cum_r)[:, None]
            dy_r = tokens(dyg_ref, h, row0, block_m, live_r).astype(jnp.float32) * decay_r
            dC = dC + dot(dy_r.astype(cdt), carried_ref[c, h, :, :].astype(cdt))
            weight = decay_factor(cum_ref[h, c, bcs - 1] - cum_r) * dt_r
            x_r = tokens(x_ref, h, row0, block_m, live_r).astype(jnp.float32) * weight[:, None]
            dB = dB + dot(x_r.astype(cdt), ds_out_ref[c, h, :, :].astype(cdt))
            return dB, dC

        zeros = jnp.zeros((block_m, bn), jnp.float32)
        dB, dC = jax.lax.fori_loop(0, heads_per_program, state_step, (zeros, zeros))

        # The causal block: ∂W_ij = Σ_h (dy_i · x_j) exp(cum_i − cum_j) dt'_j (i >= j),
        # summed over the heads first (B and C are the group's), then dC_i += ∂W_ij B_j
        # over the column blocks j <= the rows and dB_j += ∂W_ijᵀ C_i over row blocks i >=.
        def dc_block(j, dC, *, diagonal: bool):
            col0 = j * block_k
            rows_j = col0 + jnp.arange(block_k)
            live_j = rows_j < length

            def head(k, dw):
                h = head0 + k
                dy_r = tokens(dyg_ref, h, row0, block_m, live_r).astype(cdt)
                x_j = tokens(x_ref, h, col0, block_k, live_j).astype(cdt)
                cum_r = cum_ref[h, c, pl.ds(row0, block_m)]
                cum_j = cum_ref[h, c, pl.ds(col0, block_k)]
                dt_j = dt_ref[h, c, pl.ds(col0, block_k)]
                weight = decay_factor(cum_r[:, None] - cum_j[None, :]) * dt_j[None, :]
                return dw + dot(dy_r, x_j, trans_b=True) * weight

            dw = jax.lax.fori_loop(
                0, heads_per_program, head, jnp.zeros((block_m, block_k), jnp.float32)
            )
            if diagonal:
                dw = jnp.where(rows_r[:, None] >= rows_j[None, :], dw, 0.0)
            B_j = group_rows(B_ref, col0, block_k, live_j).astype(cdt)
            return dC + dot(dw.astype(cdt), B_j)

        def db_block(i, dB, *, diagonal: bool):
            r0 = i * block_k
            rows_i = r0 + jnp.arange(block_k)
            live_i = rows_i < length

            def head(k, dw):  # [block_m (this block's rows r), block_k (rows i)]
                h = head0 + k
                x_r = tokens(x_ref, h, row0, block_m, live_r).astype(cdt)
                dy_i = tokens(dyg_ref, h, r0, block_k, live_i).astype(cdt)
                cum_r = cum_ref[h, c, pl.ds(row0, block_m)]
                cum_i = cum_ref[h, c, pl.ds(r0, block_k)]
                dt_r = dt_ref[h, c, pl.ds(row0, block_m)]
                weight = decay_factor(cum_i[None, :] - cum_r[:, None]) * dt_r[:, None]
                return dw + dot(x_r, dy_i, trans_b=True) * weight

            dw = jax.lax.fori_loop(
                0, heads_per_program, head, jnp.zeros((block_m, block_k), jnp.float32)
            )
            keep = live_i[None, :]
            if diagonal:
                keep = keep & (rows_i[None, :] >= rows_r[:, None])
            C_i = group_rows(C_ref, r0, block_k, live_i).astype(cdt)
            return dB + dot(jnp.where(keep, dw, 0.0).astype(cdt), C_i)

        num_blocks = pl.cdiv(length, block_k)
        # Column blocks left of the rows need no mask; those overlapping them do.
        num_full = jnp.minimum(row0 // block_k, num_blocks)
        end_diag = jnp.minimum(pl.cdiv(row0 + block_m, block_k), num_blocks)
        dC = jax.lax.fori_loop(0, num_full, functools.partial(dc_block, diagonal=False), dC)
        dC = jax.lax.fori_loop(num_full, end_diag, functools.partial(dc_block, diagonal=True), dC)
        first_i = row0 // block_k
        dB = jax.lax.fori_loop(first_i, end_diag, functools.partial(db_block, diagonal=True), dB)
        dB = jax.lax.fori_loop(
            end_diag, num_blocks, functools.partial(db_block, diagonal=False), dB
        )
        at = split, pl.ds(start + row0, block_m), g, pl.ds(static_index(0), bn)
        mask = live_r[:, None] & n_live[None, :]
        plgpu.store(dB_ref.at[at], dB, mask=mask)
        plgpu.store(dC_ref.at[at], dC, mask=mask)


# ------------------------------------------------------------------------------- wrapper


def state_pass(
    s: ScanShapes,
    metadata,
    dy,
    z,
    C,
    res: Residuals,
    dstates,
    *,
    intermediate,
    blocks,
    interpret,
):
    """Stage 1: ``(dy·silu(z) [T, H, P] or None, ds_out[max_chunks, H, bp, bn],
    dlast[H, max_chunks], d initial_states[B, H, P, N] fp32)``."""
    bcs = s.block_chunk
    block_t = min(blocks.block_t, bcs)
    order, first, count = sequence_chunks(s, metadata)
    T = dy.shape[0]
    cdt = dy.dtype
    out_shape = (
        None if z is None else jax.ShapeDtypeStruct((T, s.heads, s.head_dim), cdt),
        jax.ShapeDtypeStruct((s.max_chunks, s.heads, s.block_p, s.block_n), cdt),
        jax.ShapeDtypeStruct((s.heads, s.max_chunks), jnp.float32),
        jax.ShapeDtypeStruct((s.num_seqs, s.heads, s.head_dim, s.state_dim), jnp.float32),
    )
    return pl.pallas_call(
        functools.partial(
            _state_pass_kernel,
            heads_per_group=s.heads // s.groups,
            head_dim=s.head_dim,
            state_dim=s.state_dim,
            block_t=block_t,
            intermediate=intermediate,
        ),
        grid=(s.heads, s.num_seqs),
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"ssd_bwd_state_pass_cs{s.chunk_size}_bt{block_t}_intermediate{int(intermediate)}",
    )(
        order,
        first,
        count,
        metadata.cu_chunk_seqlens,
        dy,
        z,
        C,
        res.cum,
        res.carried,
        dstates,
    )


def chunk_dx(s: ScanShapes, cu, x, B, res: Residuals, ds_out, D, z, dy, dyg, *, blocks, interpret):
    """Stage 2: ``(dx[T, H, P], dz[T, H, P] or None, ddt, dcum, q [H, max_chunks, bcs] fp32,
    dD partial [bcs / block_m, max_chunks, H, bp] fp32 or None)``."""
    bcs = s.block_chunk
    block_m, block_k = min(blocks.block_m, bcs), min(blocks.block_k, bcs)
    per_row = jax.ShapeDtypeStruct((s.heads, s.max_chunks, bcs), jnp.float32)
    out_shape = (
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        None if z is None else jax.ShapeDtypeStruct(z.shape, z.dtype),
        per_row,
        per_row,
        per_row,
        None
        if D is None
        else jax.ShapeDtypeStruct((bcs // block_m, s.max_chunks, s.heads, s.block_p), jnp.float32),
    )
    return pl.pallas_call(
        functools.partial(
            _chunk_dx_kernel,
            heads_per_group=s.heads // s.groups,
            head_dim=s.head_dim,
            state_dim=s.state_dim,
            block_m=block_m,
            block_k=block_k,
        ),
        grid=(bcs // block_m, s.heads, s.max_chunks + TAIL_PROGRAMS),
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"ssd_bwd_chunk_dx_cs{s.chunk_size}_bm{block_m}_bk{block_k}",
    )(cu, x, B, res.cb, res.dt_chunks, res.cum, res.y_ssm, ds_out, D, z, dy, dyg)


def chunk_dbc(s: ScanShapes, cu, x, B, C, res: Residuals, ds_out, dyg, *, blocks, interpret):
    """Stage 3: ``(dB, dC)`` partials ``[splits, T, G, bn]`` fp32 (rows past the chunks
    unwritten)."""
    bcs = s.block_chunk
    block_m = min(blocks.block_m if blocks.dbc_block_m is None else blocks.dbc_block_m, bcs)
    block_k = min(blocks.block_k if blocks.dbc_block_k is None else blocks.dbc_block_k, bcs)
    per_group = s.heads // s.groups
    per_program = heads_per_program(per_group, blocks)
    splits = per_group // per_program
    part = jax.ShapeDtypeStruct((splits, x.shape[0], s.groups, s.block_n), jnp.float32)
    return pl.pallas_call(
        functools.partial(
            _chunk_dbc_kernel,
            heads_per_group=per_group,
            heads_per_program=per_program,
            head_dim=s.head_dim,
            state_dim=s.state_dim,
            block_m=block_m,
            block_k=block_k,
        ),
        grid=(bcs // block_m, s.max_chunks, s.groups * splits),
        out_shape=(part, part),
        compiler_params=compiler_params(
            num_warps=blocks.dbc_num_warps, num_stages=blocks.dbc_num_stages
        ),
        interpret=interpret,
        name=f"ssd_bwd_chunk_dbc_cs{s.chunk_size}_bm{block_m}_bk{block_k}_hp{per_program}",
    )(cu, x, B, C, res.dt_chunks, res.cum, res.carried, ds_out, dyg)


def _token_chunks(
    metadata: ChunkMetadata, num_tokens: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(chunk[T], row[T], live[T])``: each packed row's chunk and row in it; rows past the
    chunks are not live."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    cu = metadata.cu_chunk_seqlens
    chunk = jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1
    chunk = jnp.clip(chunk, 0, metadata.max_chunks - 1)
    live = t < cu[-1]
    return chunk, jnp.where(live, t - cu[chunk], 0), live


def ssd_scan_backward(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    D: jax.Array | None,
    z: jax.Array | None,
    dt_bias: jax.Array | None,
    initial_states: jax.Array | None,
    residuals: Residuals,
    dy: jax.Array,
    dstates: jax.Array,
    *,
    metadata: ChunkMetadata,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    return_intermediate_states: bool,
    config: BackwardBlockSizes,
    interpret: bool = False,
    chunk_dx_fn=None,
    row_terms_fn=None,
    chunk_dbc_fn=None,
) -> tuple[jax.Array | None, ...]:
    """Cotangents ``(dx, ddt, dA, dB, dC, dD, dz, ddt_bias, d initial_states)`` of
    :func:`pallas_kernels.ssd.triton.ssd_scan` (None for the inputs that are None) from
    those of ``y[T, H, P]`` (``dy``) and of the returned states (``dstates``: final
    ``[B, H, P, N]`` or intermediate ``[max_chunks, H, P, N]``), in the inputs' dtypes.

    ``chunk_dx_fn(s, metadata, x, B, C, residuals, ds_out, D[H, P] or None, dyg) -> (dx,
    ddt, q)`` replaces stage 2's sums over the chunk (the Mosaic GPU backend's,
    ``mosaic_vjp.chunk_dx``; its per-row outputs may hold anything past a chunk's end);
    the rows' own terms then come from ``row_terms_fn(s, metadata, x, B, C, residuals,
    D[H, P] or None, z, dy) -> (dz or None, dy_y[H, max_chunks, cs], dD partial
    [cs / rows, max_chunks, H, P] or None)`` (``mosaic.row_terms``, which recomputes
    y_ssm: the residuals then hold neither it nor C·Bᵀ; anything past a chunk's end and
    in row blocks without rows).
    ``chunk_dbc_fn(s, metadata, x, B, C, residuals, ds_out, dyg) -> (dB, dC)`` partials
    ``[splits, T, G, N]`` replaces stage 3 (``mosaic_vjp.chunk_dbc``)."""
    if (chunk_dx_fn is None) != (row_terms_fn is None):
        raise ValueError("chunk_dx_fn and row_terms_fn are given together or not at all")
    f32 = jnp.float32
    s = ScanShapes.of(x, B, metadata)
    H, P = s.heads, s.head_dim
    cu = metadata.cu_chunk_seqlens
    dy = dy.astype(x.dtype)
    D_hp = None if D is None else jnp.broadcast_to(D.astype(f32).reshape(H, -1), (H, P))

    dyg, ds_out, dlast, dinit = state_pass(
        s,
        metadata,
        dy,
        z,
        C,
        residuals,
        dstates,
        intermediate=return_intermediate_states,
        blocks=config,
        interpret=interpret,
    )
    dyg = dy if dyg is None else dyg  # no gate: the pre-gate cotangent is dy
    bcs = s.block_chunk
    lengths = cu[1:] - cu[:-1]
    valid = jnp.arange(bcs)[None, :] < lengths[:, None]  # [max_chunks, bcs]
    if chunk_dx_fn is None:
        dx, dz, ddt_k, dcum, q, dD_part = chunk_dx(
            s, cu, x, B, residuals, ds_out, D_hp, z, dy, dyg, blocks=config, interpret=interpret
        )
    else:
        dx, ddt_k, q = chunk_dx_fn(s, metadata, x, B, C, residuals, ds_out, D_hp, dyg)
        dz, dy_y, dD_part = row_terms_fn(s, metadata, x, B, C, residuals, D_hp, z, dy)
        if dD_part is not None:  # row blocks; those without rows are unwritten
            block_rows = bcs // dD_part.shape[0]
            has_rows = jnp.arange(0, bcs, block_rows)[:, None] < lengths[None, :]
            dD_part = jnp.where(has_rows[:, :, None, None], dD_part, 0.0)
        # Past a chunk's end (and in padding chunks) the per-row outputs are unwritten.
        ddt_k = jnp.where(valid[None], ddt_k, 0.0)
        q = jnp.where(valid[None], q, 0.0)
        dcum = jnp.where(valid[None], dy_y - residuals.dt_chunks * ddt_k, 0.0)
    if chunk_dbc_fn is None:
        dB_part, dC_part = chunk_dbc(
            s, cu, x, B, C, residuals, ds_out, dyg, blocks=config, interpret=interpret
        )
    else:
        dB_part, dC_part = chunk_dbc_fn(s, metadata, x, B, C, residuals, ds_out, dyg)

    # The decay: a_k = dt'_k A enters cum_i for every i >= k of its chunk, and the chunk
    # total cum_last (whose cotangent is dlast + Σ q) for every k of it.
    total = dlast + jnp.sum(q, axis=2)  # [H, max_chunks]
    da = jnp.flip(jnp.cumsum(jnp.flip(dcum, 2), axis=2), 2) + total[:, :, None]
    da = jnp.where(valid[None], da, 0.0)
    A32 = A.astype(f32)
    ddt_chunks = ddt_k + A32[:, None, None] * da
    # dt' of padding chunks is never written by the forward: the mask selects.
    dA = jnp.sum(jnp.where(valid[None], residuals.dt_chunks * da, 0.0), axis=(1, 2))

    # Back to packed rows, then the chain rule of dt' = clamp(softplus(dt + dt_bias)).
    T = x.shape[0]
    chunk, row, live = _token_chunks(metadata, T)
    ddt_prime = ddt_chunks[:, chunk, row].T  # [T, H]; rows past the chunks selected below
    v = dt.astype(f32)
    if dt_bias is not None:
        v = v + dt_bias.astype(f32)
    pre = jnp.logaddexp(v, 0.0) if dt_softplus else v
    # The clamp passes the gradient where it is inactive, none where it is active, and half
    # at a bound exactly (as jax.grad of the xla path's jnp.clip: min/max split ties).
    lo, hi = dt_limit
    passed = jnp.where(pre == lo, 0.5, (pre > lo).astype(f32)) * jnp.where(
        pre == hi, 0.5, (pre < hi).astype(f32)
    )
    ddt_raw = ddt_prime * passed
    if dt_softplus:
        ddt_raw = ddt_raw * jax.nn.sigmoid(v)
    # Rows past the chunks: 0, selected last (their dt may be NaN, and 0 * NaN is NaN).
    ddt_raw = jnp.where(live[:, None], ddt_raw, 0.0)

    def rows_summed(part):  # [splits, T, G, bn] -> [T, G, N], rows past the chunks 0
        total = jnp.sum(part, axis=0)[..., : s.state_dim]
        return jnp.where(live[:, None, None], total, 0.0)

    dD = None
    if D is not None:
        # Partials [row blocks, max_chunks, H, bp or P] (chunk_dx or row_terms_fn).
        dD_hp = jnp.sum(dD_part, axis=tuple(range(dD_part.ndim - 2)))[:, :P]
        dD = (dD_hp if D.ndim == 2 else jnp.sum(dD_hp, axis=1)).astype(D.dtype)
    return (
        dx,
        ddt_raw.astype(dt.dtype),
        dA.astype(A.dtype),
        rows_summed(dB_part).astype(B.dtype),
        rows_summed(dC_part).astype(C.dtype),
        dD,
        dz,
        None if dt_bias is None else jnp.sum(ddt_raw, axis=0).astype(dt_bias.dtype),
        None if initial_states is None else dinit.astype(initial_states.dtype),
    )
