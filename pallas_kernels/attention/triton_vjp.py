"""Backward pass of masked-tail attention as Pallas kernels lowered through Triton.

FlashAttention-2's backward pass (Dao, arXiv 2307.08691, Algorithm 2), split into two
launches so that no two programs add into one gradient (no atomics):

* ``attention_bwd_dq`` (grid: KV head × query block, the forward's table): a program
  holds its Q tile (the group's heads packed as in the forward), ``dO``, the saved
  log2-sum-exp2 ``lse`` and ``delta = rowsum(dO ∘ O)``, walks exactly the forward's KV
  blocks and accumulates ``dQ += dS K`` with ``P = 2^(S·log2e − lse)`` recomputed and
  ``dS = P ∘ (dO Vᵀ − delta)``.
* ``attention_bwd_dkv`` (grid: KV head × sequence × KV block): a program holds one block
  of its sequence's keys and values (skipped at or past ``kv_len``: those cache lines get
  0, as does every line no sequence reads) and walks the query rows that can see it,
  ``dV += Pᵀ dO``, ``dK += dSᵀ Q``; the GQA group's query heads sit in the same Q tile, so
  ``dK``, ``dV`` are summed over them inside the product. It computes the transposed
  scores ``Sᵀ = K Qᵀ`` and ``dPᵀ = V dOᵀ`` directly (FlashAttention-2's Triton kernels do
  the same): ``Pᵀ`` and ``dSᵀ`` are then the left operands of the two products as they
  come out of the tensor cores, with no transpose through shared memory. Like the
  forward's KV loop, the row loop masks only the tiles on the band's edges and the
  ``kv_len`` block; interior tiles see every key of the block.

Both launches walk the forward's schedule (``triton_common.PrefillPlan``) from the
``lse`` that the forward (``triton.py``, ``with_lse=True``) saves; ``triton.py`` wires
them into its ``jax.custom_vjp``. Paged caches: the dK/dV kernel writes per-sequence
gradient lines that a scatter-add sums into the pages (:func:`attention_backward`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._pallas import (
    MIN_DOT_DIM,
    block_dim,
    compiler_params,
    dot,
    masked_load,
    next_power_of_2,
    static_index,
)
from pallas_kernels.attention._layout import backward_scale_operand
from pallas_kernels.attention.triton_common import (
    PrefillPlan,
    block_ranges,
    kv_lines,
    kv_loop,
    load_kv_block,
    query_block_ranges,
)
from pallas_kernels.attention.triton_config import (
    AttentionShapes,
    BackwardBlockSizes,
    check_backward_block_sizes,
    paged_suffix,
)
from pallas_kernels.backend import pallas_dtypes


def _bwd_tile_loads(
    q_ref,
    do_ref,
    lse_ref,
    delta_ref,
    row0,
    row_live,
    *,
    head0,
    bg,
    bd,
    group,
    head_dim,
    block_q,
    compute_dtype,
):
    """The Q, dO tiles ``[block_q * bg, bd]`` and the lse, delta rows ``[block_q * bg]`` of
    query rows ``row0..row0+block_q`` (dead rows and padded heads read 0; ``row_live``
    None: every row is live)."""
    g_live = jnp.arange(bg) < group
    d_live = jnp.arange(bd) < head_dim
    if row_live is None and bg == group and bd == head_dim:
        mask3 = mask2 = None
    else:
        if row_live is None:
            row_live = jnp.ones((block_q,), jnp.bool_)
        mask3 = row_live[:, None, None] & g_live[None, :, None] & d_live[None, None, :]
        mask2 = row_live[:, None] & g_live[None, :]
    rows, heads = pl.ds(row0, block_q), pl.ds(head0, bg)
    cols = pl.ds(static_index(0), bd)
    q = masked_load(q_ref.at[rows, heads, cols], mask3).astype(compute_dtype)
    do = masked_load(do_ref.at[rows, heads, cols], mask3).astype(compute_dtype)
    lse = masked_load(lse_ref.at[rows, heads], mask2)
    delta = masked_load(delta_ref.at[rows, heads], mask2)
    n = block_q * bg
    return q.reshape(n, bd), do.reshape(n, bd), lse.reshape(n), delta.reshape(n)


def _bwd_scores(q, do, k, v, lse, delta, visible, qk_scale):
    """``dS[rows, bk]`` of one (Q tile, KV block) pair, the gradient of the logits
    ``sm_scale · Q Kᵀ`` (so ``dQ = sm_scale · dS K``), with ``P = 2^(S·log2e − lse)``
    recomputed from the saved ``lse``; ``visible`` None: every pair is visible."""
    s = dot(q, k, trans_b=True) * qk_scale
    p = jnp.exp2(s - lse[:, None])
    dp = dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    # Selected, not multiplied: p = 0 times a NaN dp (a non-finite value a row does not
    # see) would be NaN.
    return ds if visible is None else jnp.where(visible, ds, 0.0)


def _bwd_scores_transposed(q, do, k, v, lse, delta, visible, qk_scale):
    """``(Pᵀ, dSᵀ)`` ``[bk, rows]``: :func:`_bwd_scores`'s pair computed as ``K Qᵀ`` and
    ``V dOᵀ`` (``visible[bk, rows]`` or None), the left operands of ``dV += Pᵀ dO`` and
    ``dK += dSᵀ Q`` as they are."""
    s = dot(k, q, trans_b=True) * qk_scale
    p = jnp.exp2(s - lse[None, :])
    dp = dot(v, do, trans_b=True)
    ds = p * (dp - delta[None, :])
    if visible is None:
        return p, ds
    return jnp.where(visible, p, 0.0), jnp.where(visible, ds, 0.0)


def _dq_kernel(
    prog_seq_ref,  # [max_q_blocks] int32
    prog_row_ref,  # [max_q_blocks] int32
    seq_end_ref,  # [B] int32
    seq_offset_ref,  # [B] int32
    seq_kv_len_ref,  # [B] int32
    seq_slot_ref,  # [B] int32
    table_ref,  # [B, W] int32
    scale_ref,  # [2] fp32: (sm_scale * log2(e), sm_scale)
    band_ref,  # [2] int32
    q_ref,  # [T, Hq, D]
    k_ref,  # [S, L, Hkv, D] (paged: [num_blocks, page_size, Hkv, D])
    v_ref,  # like k_ref
    do_ref,  # [T, Hq, D]
    lse_ref,  # [T, Hq] fp32
    delta_ref,  # [T, Hq] fp32
    dq_ref,  # [T, Hq, D]
    *,
    group: int,
    head_dim: int,
    block_q: int,
    block_k: int,
    page_size: int | None,
    compute_dtype,
):
    h, p = pl.program_id(0), pl.program_id(1)
    bg, bd = next_power_of_2(group), block_dim(head_dim, MIN_DOT_DIM)
    rows = block_q * bg
    head0 = h * group
    g_live = jnp.arange(bg) < group
    d_live = jnp.arange(bd) < head_dim
    num_tokens = dq_ref.shape[0]

    def store(row0, row_live, value):  # value: [block_q, bg, bd]
        plgpu.store(
            dq_ref.at[pl.ds(row0, block_q), pl.ds(head0, bg), pl.ds(static_index(0), bd)],
            value.astype(dq_ref.dtype),
            mask=row_live[:, None, None] & g_live[None, :, None] & d_live[None, None, :],
        )

    zeros = jnp.zeros((block_q, bg, bd), jnp.float32)
    seq, row0 = prog_seq_ref[p], prog_row_ref[p]

    @pl.when((seq < 0) & (row0 < num_tokens))
    def _zero_unowned_rows():
        store(row0, row0 + jnp.arange(block_q) < num_tokens, zeros)

    @pl.when(seq >= 0)
    def _live_program():
        row_end = seq_end_ref[seq]
        row_live = row0 + jnp.arange(block_q) < row_end
        slot = seq_slot_ref[seq]

        @pl.when(slot < 0)
        def _padding_sequence():
            store(row0, row_live, zeros)

        @pl.when(slot >= 0)
        def _attend():
            kv_len = seq_kv_len_ref[seq]
            qk_scale, sm_scale = scale_ref[0], scale_ref[1]
            left, right = band_ref[0], band_ref[1]
            pos_first = row0 + seq_offset_ref[seq]
            pos_last = pos_first + jnp.minimum(block_q, row_end - row0) - 1
            pos = pos_first + jnp.arange(rows) // bg
            bounds = query_block_ranges(pos_first, pos_last, kv_len, left, right, block_k)
            lines = kv_lines(table_ref, seq, page_size=page_size, num_lines=k_ref.shape[0])
            q, do, lse, delta = _bwd_tile_loads(
                q_ref,
                do_ref,
                lse_ref,
                delta_ref,
                row0,
                row_live,
                head0=head0,
                bg=bg,
                bd=bd,
                group=group,
                head_dim=head_dim,
                block_q=block_q,
                compute_dtype=compute_dtype,
            )

            def kv_block(j, dq, *, masked):
                start = j * block_k
                visible = None  # the interior: every key below kv_len, in every band
                if masked:
                    keys = start + jnp.arange(block_k)
                    visible = jnp.broadcast_to(keys[None, :] < kv_len, (rows, block_k))
                    visible &= keys[None, :] <= pos[:, None] + right
                    visible &= keys[None, :] > pos[:, None] - left
                k, v = load_kv_block(
                    k_ref,
                    v_ref,
                    lines,
                    start,
                    h,
                    dtype=compute_dtype,
                    block_k=block_k,
                    head_dim=head_dim,
                    kv_len=kv_len,
                    masked=masked,
                )
                ds = _bwd_scores(q, do, k, v, lse, delta, visible, qk_scale)
                return dq + dot(ds.astype(compute_dtype), k)

            dq = kv_loop(kv_block, jnp.zeros((rows, bd), jnp.float32), *bounds)
            store(row0, row_live, (dq * sm_scale).reshape(block_q, bg, bd))


def _dkv_kernel(
    seq_start_ref,  # [B] int32: first packed row of the sequence, clipped to [0, T]
    seq_end_ref,  # [B] int32
    seq_offset_ref,  # [B] int32
    seq_kv_len_ref,  # [B] int32
    seq_slot_ref,  # [B] int32
    table_ref,  # [B, W] int32
    scale_ref,  # [2] fp32: (sm_scale * log2(e), sm_scale)
    band_ref,  # [2] int32
    q_ref,  # [T, Hq, D]
    k_ref,  # [S, L, Hkv, D] (paged: [num_blocks, page_size, Hkv, D])
    v_ref,  # like k_ref
    do_ref,  # [T, Hq, D]
    lse_ref,  # [T, Hq] fp32
    delta_ref,  # [T, Hq] fp32
    dk_in_ref,  # [S, L, Hkv, D] zeros (paged: [B, L, Hkv, D]), aliased to dk_ref
    dv_in_ref,  # like dk_in_ref, aliased to dv_ref
    dk_ref,  # [S, L, Hkv, D] (paged: [B, L, Hkv, D], per sequence)
    dv_ref,  # like dk_ref
    *,
    group: int,
    head_dim: int,
    block_q: int,
    block_k: int,
    page_size: int | None,
    compute_dtype,
):
    del dk_in_ref, dv_in_ref  # the same buffers as dk_ref, dv_ref: lines not written stay 0
    h, b, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bg, bd = next_power_of_2(group), block_dim(head_dim, MIN_DOT_DIM)
    rows = block_q * bg
    head0 = h * group
    d_live = jnp.arange(bd) < head_dim
    slot, kv_len = seq_slot_ref[b], seq_kv_len_ref[b]
    start = j * block_k
    # Paged, each sequence's gradient goes to its own line (the wrapper adds the lines into
    # the pages: a shared page sums every sequence that read it, and no two programs ever
    # write one place).
    out_line = slot if page_size is None else b

    @pl.when((slot >= 0) & (start < kv_len))
    def _():
        qk_scale, sm_scale = scale_ref[0], scale_ref[1]
        left, right = band_ref[0], band_ref[1]
        seq_start, seq_end, offset = seq_start_ref[b], seq_end_ref[b], seq_offset_ref[b]
        keys = start + jnp.arange(block_k)
        lines = kv_lines(table_ref, b, page_size=page_size, num_lines=k_ref.shape[0])
        k, v = load_kv_block(
            k_ref,
            v_ref,
            lines,
            start,
            h,
            dtype=compute_dtype,
            block_k=block_k,
            head_dim=head_dim,
            kv_len=kv_len,
            masked=True,
        )
        # Query rows whose band meets keys [start, start + block_k): positions
        # start - right <= pos <= start + block_k - 2 + left; of those, the rows that see
        # every key of a block wholly below kv_len: start + block_k - 1 - right <= pos <
        # start + left.
        row_lo = jnp.clip(start - right - offset, seq_start, seq_end)
        row_hi = jnp.clip(start + block_k - 1 + left - offset, row_lo, seq_end)
        full_lo = jnp.clip(start + block_k - 1 - right - offset, row_lo, row_hi)
        full_hi = jnp.clip(start + left - offset, full_lo, row_hi)
        full_hi = jnp.where(start + block_k <= kv_len, full_hi, full_lo)

        def q_block(i, carry, *, masked):
            dk, dv = carry
            row0 = row_lo + i * block_q
            row_live = row0 + jnp.arange(block_q) < row_hi if masked else None
            q, do, lse, delta = _bwd_tile_loads(
                q_ref,
                do_ref,
                lse_ref,
                delta_ref,
                row0,
                row_live,
                head0=head0,
                bg=bg,
                bd=bd,
                group=group,
                head_dim=head_dim,
                block_q=block_q,
                compute_dtype=compute_dtype,
            )
            visible = None
            if masked:
                pos = row0 + offset + jnp.arange(rows) // bg
                live = jnp.repeat(row_live, bg)  # [rows], query-major like the tile
                visible = live[None, :] & (keys[:, None] < kv_len)
                visible &= keys[:, None] <= pos[None, :] + right
                visible &= keys[:, None] > pos[None, :] - left
            p, ds = _bwd_scores_transposed(q, do, k, v, lse, delta, visible, qk_scale)
            dv = dv + dot(p.astype(compute_dtype), do)
            dk = dk + dot(ds.astype(compute_dtype), q)
            return dk, dv

        zeros = jnp.zeros((block_k, bd), jnp.float32)
        bounds = block_ranges(0, row_hi - row_lo, full_lo - row_lo, full_hi - row_lo, block_q)
        dk, dv = kv_loop(q_block, (zeros, zeros), *bounds)
        mask = (keys < kv_len)[:, None] & d_live[None, :]
        where = (out_line, pl.ds(start, block_k), h, pl.ds(static_index(0), bd))
        plgpu.store(dk_ref.at[where], (dk * sm_scale).astype(dk_ref.dtype), mask=mask)
        plgpu.store(dv_ref.at[where], dv.astype(dv_ref.dtype), mask=mask)


def attention_backward(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    *,
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    block_table: jax.Array | None = None,
    causal: bool | jax.Array,
    sm_scale: float | jax.Array,
    sliding_window: int | jax.Array | None,
    block_sizes: BackwardBlockSizes,
    interpret: bool = False,
    dq_kernel: Callable[..., jax.Array] | None = None,
    dkv_kernel: Callable[..., tuple[jax.Array, jax.Array]] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pallas backward kernels of :func:`prefill_attention` (``out`` and ``lse`` from its
    ``with_lse`` call, or any forward's with the same ``lse``): ``dout[T, Hq, D]`` ->
    ``(dq[T, Hq, D], dk_cache[S, L, Hkv, D], dv_cache[S, L, Hkv, D])``. Cache lines the
    forward did not read (other slots, positions at or past ``kv_len``) get 0.

    Paged: the dk/dv kernel writes each sequence's gradient to its own line of a
    ``[B, max_blocks * page_size, Hkv, D]`` buffer, and a scatter-add puts the lines'
    pages into ``[num_blocks, page_size, Hkv, D]`` gradients (a page shared by several
    sequences sums them; pages no sequence reads get 0).

    ``dq_kernel``, ``dkv_kernel``: other dQ and dK/dV kernels (the Mosaic backend's),
    called as ``kernel(q, k_cache, v_cache, dout, lse, delta, **batch, **mask)``; dK/dV
    returns gradients in this module's dK/dV kernel's layout (paged: per-sequence
    lines)."""
    s = AttentionShapes.of(q, k_cache, query_start_loc, block_table)
    b = block_sizes
    check_backward_block_sizes(b, group=s.group, page_size=s.page_size)
    with pallas_dtypes():
        plan = PrefillPlan.of(
            s,
            query_start_loc,
            kv_lens,
            slot_ids,
            block_table,
            block_q=b.dq_block_q,
            block_k=b.dq_block_k,
            causal=causal,
            sliding_window=sliding_window,
        )
        scales = backward_scale_operand(sm_scale)
        dout = dout.astype(q.dtype)
        # delta = rowsum(dO ∘ O) (FlashAttention-2, Algorithm 2, line 4), fp32.
        delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
        static = dict(
            group=s.group,
            head_dim=s.head_dim,
            page_size=s.page_size,
            compute_dtype=jnp.promote_types(q.dtype, k_cache.dtype),
        )
        shape = f"g{s.group}_d{s.head_dim}{paged_suffix(s)}"
        kernel_args = (q, k_cache, v_cache, dout, lse, delta)
        kernel_kwargs = dict(
            query_start_loc=query_start_loc,
            kv_lens=kv_lens,
            slot_ids=slot_ids,
            block_table=block_table,
            causal=causal,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
        )
        # The operands both Triton kernels take after their own first ones.
        operands = (
            plan.seq_end,
            plan.seq_offset,
            plan.seq_kv_len,
            plan.seq_slot,
            plan.table,
            scales,
            plan.band,
            q,
            k_cache,
            v_cache,
            dout,
            lse,
            delta,
        )
        if dq_kernel is not None:
            dq = dq_kernel(*kernel_args, **kernel_kwargs)
        else:
            dq = pl.pallas_call(
                functools.partial(_dq_kernel, block_q=b.dq_block_q, block_k=b.dq_block_k, **static),
                grid=(s.num_kv_heads, plan.max_q_blocks),
                out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                compiler_params=compiler_params(
                    num_warps=b.dq_num_warps, num_stages=b.dq_num_stages
                ),
                interpret=interpret,
                name=f"attention_bwd_dq_bq{b.dq_block_q}_bk{b.dq_block_k}_{shape}",
            )(plan.prog_seq, plan.prog_row, *operands)
        if dkv_kernel is not None:
            dk, dv = dkv_kernel(*kernel_args, **kernel_kwargs)
        else:
            seq_start = jnp.clip(query_start_loc[:-1], 0, s.num_tokens).astype(jnp.int32)
            dkv_args = (seq_start, *operands)
            grad_shape = k_cache.shape
            if s.page_size is not None:  # per-sequence lines
                grad_shape = (s.num_seqs, s.cache_len, *k_cache.shape[2:])
            dk, dv = pl.pallas_call(
                functools.partial(
                    _dkv_kernel, block_q=b.dkv_block_q, block_k=b.dkv_block_k, **static
                ),
                grid=(s.num_kv_heads, s.num_seqs, pl.cdiv(s.cache_len, b.dkv_block_k)),
                out_shape=(
                    jax.ShapeDtypeStruct(grad_shape, k_cache.dtype),
                    jax.ShapeDtypeStruct(grad_shape, v_cache.dtype),
                ),
                input_output_aliases={len(dkv_args): 0, len(dkv_args) + 1: 1},
                compiler_params=compiler_params(
                    num_warps=b.dkv_num_warps, num_stages=b.dkv_num_stages
                ),
                interpret=interpret,
                name=f"attention_bwd_dkv_bq{b.dkv_block_q}_bk{b.dkv_block_k}_{shape}",
            )(
                *dkv_args,
                jnp.zeros(grad_shape, k_cache.dtype),
                jnp.zeros(grad_shape, v_cache.dtype),
            )
        if s.page_size is not None:
            dk, dv = (_lines_to_pages(g, s, plan) for g in (dk, dv))
    return dq, dk, dv


def _lines_to_pages(grad: jax.Array, s: AttentionShapes, plan: PrefillPlan) -> jax.Array:
    """Per-sequence gradient lines ``[B, max_blocks * page_size, Hkv, D]`` added into the
    pages their sequence read, ``[num_blocks, page_size, Hkv, D]`` (the forward's clamped
    page ids; entries a sequence does not need are dropped)."""
    max_blocks = plan.table.shape[1]
    pages = grad.reshape(s.num_seqs, max_blocks, s.page_size, *grad.shape[2:])
    num_pages = (plan.seq_kv_len + s.page_size - 1) // s.page_size
    needed = jnp.arange(max_blocks)[None, :] < num_pages[:, None]
    needed &= (plan.seq_slot >= 0)[:, None]
    index = jnp.where(needed, jnp.clip(plan.table, 0, s.num_slots - 1), s.num_slots)
    out = jnp.zeros((s.num_slots, *pages.shape[2:]), jnp.float32)
    out = out.at[index].add(pages.astype(jnp.float32), mode="drop")
    return out.astype(grad.dtype)
