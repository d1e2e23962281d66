"""Masked-tail attention over a slot-indexed KV cache as Pallas kernels lowered through Triton.

FlashAttention-2 (Dao, arXiv 2307.08691, Algorithm 1, forward pass): a program holds one
tile of queries, streams its KV blocks and keeps the online-softmax statistics in fp32 —
running row max ``m``, row sum ``l`` and unnormalised output ``acc`` — rescaling ``l`` and
``acc`` by ``exp(m_old - m_new)`` when the max grows, and divides once at the end
(section 3.1.1: no per-block rescaling of the output). Logits are scaled by
``sm_scale * log2(e)`` so every exponential is an ``exp2``.

This file holds the prefill kernel, the dispatch and the ``jax.custom_vjp`` wiring; the
other launches live next to it, by the per-backend convention of ``pallas_kernels``
(``triton_config.py`` holds the block sizes and heuristics, ``triton_common.py`` the
pieces the kernels share).

Launches:

1. ``attention_prefill`` (grid: KV head × query block). A table built in the wrapper maps
   each of ``max_q_blocks = cdiv(T, block_q) + B`` programs to (sequence, first packed
   row); blocks start at their sequence's first row, so a block never mixes sequences.
   The ``group = Hq / Hkv`` query heads sharing a KV head form one Q tile of
   ``[block_q * group, D]`` rows (GQA packing: each KV block is loaded once per group).
   For the block's first and last positions ``p0 <= p1`` the loop visits exactly the KV
   blocks ``[lo // block_k, cdiv(hi, block_k))``, ``hi = min(kv_len, p1 + 1)`` (causal) or
   ``kv_len``, ``lo = max(0, p0 - W + 1)`` (sliding window) or 0, in three parts::

       keys 0 ...................................................... kv_len ... L
            | window edge (masked) | interior (no mask) | diagonal / kv_len (masked) |
            lo                     max(p1 - W + 1, 0)   min(kv_len, p0 + 1)          hi

   KV blocks at or past ``kv_len``, wholly above the diagonal or wholly left of the window
   are never loaded; only the boundary blocks are masked. The table's unused entries zero
   the packed rows no sequence owns (past ``query_start_loc[-1]``). Programs are ordered
   by their number of KV blocks, longest first, with the KV head as the fastest grid axis:
   the GPU starts the longest programs (every head of them) first and ends on short ones
   (longest-processing-time-first scheduling; matters for ragged and chunked batches).
2. ``attention_decode`` and ``attention_decode_combine`` (``triton_decode.py``): the split-KV
   (flash-decoding) kernels, used when the packed batch is decode-shaped (``T <= B``,
   static).

Gradients (``jax.custom_vjp``, :func:`differentiable_attention`): under differentiation the
forward is launch 1 with a ``lse[T, Hq]`` output (any layout), and two backward launches,
``attention_bwd_dq`` and ``attention_bwd_dkv`` (``triton_vjp.py``), recompute the probabilities
from it (FlashAttention-2, Algorithm 2).

``write_kv`` (grid: token) copies each token's keys and values to its slot and position,
in place through ``input_output_aliases``.

Paged caches (``block_table[B, max_blocks]``, caches ``[num_blocks, page_size, Hkv, D]``):
every kernel reads KV block ``kb`` of a sequence from page
``block_table[b, kb * block_k // page_size]`` at row ``kb * block_k % page_size``
(``triton_common.kv_lines``; ``block_k`` divides the page, so a block never spans two pages, and
the page id is clamped into the pool before any load); the block schedule, masks and tail
skipping are the contiguous ones, with ``L = max_blocks * page_size``. The dk/dv kernel
writes per-sequence gradient lines that a scatter-add sums into the pages (pages shared
by several sequences get every reader's gradient, with no two programs writing one place).

The mask (causal, window) and the logit scale are operands, not compile-time constants
(see ``_layout.NO_WINDOW``). Cache entries outside ``[0, kv_len)`` are loaded with
``other=0`` masks (never read), so NaN in cache tails or unnamed slots never reaches an
output. Rows with no visible key, rows of slot ``-1`` sequences and packed rows past
``query_start_loc[-1]`` are 0. Head dims are padded to a power of two (at least 16, the
smallest Triton dot dimension) and masked. Offsets into arrays over 4 GiB are 64-bit (the
Pallas Triton lowering switches on the array size).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._pallas import (
    MIN_DOT_DIM,
    block_dim,
    compiler_params,
    masked_load,
    next_power_of_2,
    static_index,
)
from pallas_kernels.attention._layout import is_decode_shaped, jit_attention, scale_operand
from pallas_kernels.attention.kv_cache import kv_destination
from pallas_kernels.attention.triton_common import (
    TINY,
    PrefillPlan,
    kv_lines,
    kv_loop,
    kv_step,
    query_block_ranges,
    softmax_init,
)
from pallas_kernels.attention.triton_config import (
    AttentionShapes,
    BlockSizes,
    check_paged_block_sizes,
    default_backward_block_sizes,
    grad_block_sizes,
    paged_suffix,
)
from pallas_kernels.attention.triton_decode import decode_attention
from pallas_kernels.attention.triton_vjp import attention_backward
from pallas_kernels.backend import pallas_dtypes

# ------------------------------------------------------------------------------ 1. prefill


def _prefill_kernel(
    prog_seq_ref,  # [max_q_blocks] int32: the program's sequence, -1 for a zeroing program
    prog_row_ref,  # [max_q_blocks] int32: its first packed query row
    seq_end_ref,  # [B] int32: query_start_loc[b + 1] clipped to [0, T]
    seq_offset_ref,  # [B] int32: packed row r of sequence b sits at position r + offset
    seq_kv_len_ref,  # [B] int32: kv_lens clipped to [0, L]
    seq_slot_ref,  # [B] int32: cache slot (paged: >= 0 live), -1 for padding sequences
    table_ref,  # [B, W] int32: the KV addressing of each sequence (see kv_lines)
    scale_ref,  # [1] fp32: sm_scale * log2(e)
    band_ref,  # [2] int32: (left, right) of the visible band of positions
    q_ref,  # [T, Hq, D]
    k_ref,  # [S, L, Hkv, D] (paged: [num_blocks, page_size, Hkv, D])
    v_ref,  # like k_ref
    o_ref,  # [T, Hq, D]
    lse_ref=None,  # [T, Hq] fp32 or None: each row's log2-sum-exp2 of its scaled logits
    *,
    group: int,
    head_dim: int,
    block_q: int,
    block_k: int,
    page_size: int | None,
    compute_dtype,
):
    # NOTE: the KV head is grid axis 0, the fastest-varying one in launch order, so every
    # head of the longest query blocks (the table's first entries) starts first.
    h, p = pl.program_id(0), pl.program_id(1)
    bg, bd = next_power_of_2(group), block_dim(head_dim, MIN_DOT_DIM)
    rows = block_q * bg  # Q tile rows: (query, head of the group), query-major
    head0 = h * group
    g_live = jnp.arange(bg) < group
    d_live = jnp.arange(bd) < head_dim

    def tile_mask(row_live):  # [block_q, bg, bd]
        return row_live[:, None, None] & g_live[None, :, None] & d_live[None, None, :]

    def store(row0, row_live, value, lse=None):  # value: [block_q, bg, bd], lse [block_q, bg]
        plgpu.store(
            o_ref.at[pl.ds(row0, block_q), pl.ds(head0, bg), pl.ds(static_index(0), bd)],
            value.astype(o_ref.dtype),
            mask=tile_mask(row_live),
        )
        if lse_ref is not None:
            plgpu.store(
                lse_ref.at[pl.ds(row0, block_q), pl.ds(head0, bg)],
                jnp.zeros((block_q, bg), jnp.float32) if lse is None else lse,
                mask=row_live[:, None] & g_live[None, :],
            )

    zeros = jnp.zeros((block_q, bg, bd), o_ref.dtype)
    seq, row0 = prog_seq_ref[p], prog_row_ref[p]

    # Table entries no query block uses zero the bucket rows no sequence owns: the
    # wrapper gives them rows [total + k * block_q, ...), k = 0, 1, ... (row0 >= total).
    @pl.when((seq < 0) & (row0 < o_ref.shape[0]))
    def _zero_unowned_rows():
        store(row0, row0 + jnp.arange(block_q) < o_ref.shape[0], zeros)

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
            qk_scale, left, right = scale_ref[0], band_ref[0], band_ref[1]
            pos_first = row0 + seq_offset_ref[seq]
            pos_last = pos_first + jnp.minimum(block_q, row_end - row0) - 1
            pos = pos_first + jnp.arange(rows) // bg  # [rows]
            bounds = query_block_ranges(pos_first, pos_last, kv_len, left, right, block_k)
            lines = kv_lines(table_ref, seq, page_size=page_size, num_lines=k_ref.shape[0])

            q = masked_load(
                q_ref.at[pl.ds(row0, block_q), pl.ds(head0, bg), pl.ds(static_index(0), bd)],
                tile_mask(row_live),
            )
            q = q.astype(compute_dtype).reshape(rows, bd)

            def kv_block(j, carry, *, masked):
                start = j * block_k
                visible = None
                if masked:
                    keys = start + jnp.arange(block_k)
                    visible = jnp.broadcast_to(keys[None, :] < kv_len, (rows, block_k))
                    visible &= keys[None, :] <= pos[:, None] + right
                    visible &= keys[None, :] > pos[:, None] - left
                return kv_step(
                    carry,
                    q,
                    k_ref,
                    v_ref,
                    lines=lines,
                    start=start,
                    h=h,
                    block_k=block_k,
                    head_dim=head_dim,
                    kv_len=kv_len,
                    masked=masked,
                    visible=visible,
                    qk_scale=qk_scale,
                )

            carry = softmax_init(rows, bd)
            m, l, acc = kv_loop(kv_block, carry, *bounds)
            out = acc * (1.0 / jnp.maximum(l, TINY))[:, None]
            # Rows that see no key: finfo.min + log2(tiny), finite (the backward masks them).
            lse = m + jnp.log2(jnp.maximum(l, TINY))
            store(row0, row_live, out.reshape(block_q, bg, bd), lse.reshape(block_q, bg))


def prefill_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    block_table: jax.Array | None = None,
    causal: bool | jax.Array,
    sm_scale: float | jax.Array,
    sliding_window: int | jax.Array | None,
    block_sizes: BlockSizes,
    interpret: bool = False,
    with_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The query-block (FlashAttention-2) kernel, for any batch; ``out[T, Hq, D]``, and
    with ``with_lse`` also ``lse[T, Hq]`` fp32, each row's log2-sum-exp2 of its logits in
    log2 units (what the backward kernels recompute the probabilities from; 0 for rows of
    padding sequences and past the sequences). ``causal``, ``sm_scale`` and
    ``sliding_window`` may be traced scalars."""
    s = AttentionShapes.of(q, k_cache, query_start_loc, block_table)
    b = block_sizes
    if b.block_q * s.block_group < MIN_DOT_DIM:
        raise ValueError(
            f"block_q={b.block_q} times the padded GQA group {s.block_group} must be >= "
            f"{MIN_DOT_DIM} (the smallest Triton dot dimension)"
        )
    check_paged_block_sizes(b, s.page_size)
    plan = PrefillPlan.of(
        s,
        query_start_loc,
        kv_lens,
        slot_ids,
        block_table,
        block_q=b.block_q,
        block_k=b.block_k,
        causal=causal,
        sliding_window=sliding_window,
    )
    return pl.pallas_call(
        functools.partial(
            _prefill_kernel,
            group=s.group,
            head_dim=s.head_dim,
            block_q=b.block_q,
            block_k=b.block_k,
            page_size=s.page_size,
            compute_dtype=jnp.promote_types(q.dtype, k_cache.dtype),
        ),
        grid=(s.num_kv_heads, plan.max_q_blocks),
        out_shape=(
            (
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct(q.shape[:2], jnp.float32),
            )
            if with_lse
            else jax.ShapeDtypeStruct(q.shape, q.dtype)
        ),
        compiler_params=compiler_params(num_warps=b.num_warps, num_stages=b.num_stages),
        interpret=interpret,
        name=(
            f"attention_prefill_bq{b.block_q}_bk{b.block_k}_w{b.num_warps}_s{b.num_stages}"
            f"_g{s.group}_d{s.head_dim}{paged_suffix(s)}"
        ),
    )(
        plan.prog_seq,
        plan.prog_row,
        plan.seq_end,
        plan.seq_offset,
        plan.seq_kv_len,
        plan.seq_slot,
        plan.table,
        scale_operand(sm_scale),
        plan.band,
        q,
        k_cache,
        v_cache,
    )


# ------------------------------------------------------------ gradients (jax.custom_vjp)


@functools.cache
def _differentiable(
    block_sizes: BlockSizes,
    interpret: bool,
    primal=None,
    primal_config=None,
    dq_kernel=None,
    dkv_kernel=None,
):
    """The attention kernels with their Pallas backward kernels, for one config.

    Outside differentiation the forward is ``primal(q, k_cache, v_cache, **operands,
    block_sizes=primal_config)`` (default: the kernel :func:`_prefill_or_decode` picks).
    Under differentiation it is the same call with ``with_lse=True`` (default: the
    query-block kernel with ``lse``, any layout): the backward kernels need ``lse``."""

    @jax.custom_vjp
    def attention(q, k_cache, v_cache, batch, mask):
        if primal is not None:
            return primal(q, k_cache, v_cache, **batch, **mask, block_sizes=primal_config)
        return _prefill_or_decode(
            q, k_cache, v_cache, **batch, **mask, block_sizes=block_sizes, interpret=interpret
        )

    def forward(q, k_cache, v_cache, batch, mask):
        if primal is not None:
            out, lse = primal(
                q, k_cache, v_cache, **batch, **mask, block_sizes=primal_config, with_lse=True
            )
            return out, (q, k_cache, v_cache, out, lse, batch, mask)
        group = q.shape[1] // k_cache.shape[2]
        with pallas_dtypes():
            out, lse = prefill_attention(
                q,
                k_cache,
                v_cache,
                **batch,
                **mask,
                block_sizes=grad_block_sizes(block_sizes, group),
                interpret=interpret,
                with_lse=True,
            )
        return out, (q, k_cache, v_cache, out, lse, batch, mask)

    def backward_rule(residuals, dout):
        q, k_cache, v_cache, out, lse, batch, mask = residuals
        page_size = None if batch["block_table"] is None else k_cache.shape[1]
        backward_blocks = default_backward_block_sizes(
            block_sizes,
            group=q.shape[1] // k_cache.shape[2],
            head_dim=q.shape[2],
            dtype=jnp.promote_types(q.dtype, k_cache.dtype),
            page_size=page_size,
        )
        grads = attention_backward(
            q,
            k_cache,
            v_cache,
            out,
            lse,
            dout,
            **batch,
            **mask,
            block_sizes=backward_blocks,
            interpret=interpret,
            dq_kernel=dq_kernel,
            dkv_kernel=dkv_kernel,
        )
        # The batch layout and the mask operands are not differentiated.
        return (*grads, None, None)

    attention.defvjp(forward, backward_rule)
    return attention


def differentiable_attention(
    q,
    k_cache,
    v_cache,
    *,
    query_start_loc,
    kv_lens,
    slot_ids,
    block_table=None,
    causal,
    sm_scale,
    sliding_window,
    block_sizes: BlockSizes,
    interpret: bool = False,
    primal=None,
    primal_config=None,
    dq_kernel=None,
    dkv_kernel=None,
) -> jax.Array:
    """Attention differentiable through this module's Pallas backward kernels
    (:func:`attention_backward`); ``primal``/``primal_config``: another backend's forward
    kernel and its config, run in place of this module's (the Mosaic backend's use); under
    differentiation it is called with ``with_lse=True`` and must return ``(out, lse)``
    as :func:`prefill_attention` does; ``dq_kernel``, ``dkv_kernel``: its backward
    kernels (:func:`attention_backward`), None for this module's."""
    batch = dict(
        query_start_loc=query_start_loc,
        kv_lens=kv_lens,
        slot_ids=slot_ids,
        block_table=block_table,
    )
    mask = dict(causal=causal, sm_scale=sm_scale, sliding_window=sliding_window)
    attention = _differentiable(
        block_sizes, interpret, primal, primal_config, dq_kernel, dkv_kernel
    )
    return attention(q, k_cache, v_cache, batch, mask)


# ---------------------------------------------------------------------------- dispatch


def masked_tail_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    block_table: jax.Array | None = None,
    causal: bool,
    sm_scale: float,
    sliding_window: int | None,
    config: BlockSizes,
    interpret: bool = False,
) -> jax.Array:
    """See :func:`pallas_kernels.masked_tail_attention`; arguments are already validated.

    Decode-shaped batches (``T <= B``) take the split-KV kernels, others the query-block
    kernel. Paged caches (``block_table``) are read through the table, one page lookup per
    KV block. ``causal``, ``sm_scale`` and ``sliding_window`` reach the compiled program as
    data (:func:`~pallas_kernels.attention._layout.jit_attention`): changing them does not
    recompile.
    """
    return jit_attention(
        differentiable_attention,
        q,
        k_cache,
        v_cache,
        query_start_loc=query_start_loc,
        kv_lens=kv_lens,
        slot_ids=slot_ids,
        block_table=block_table,
        causal=causal,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        static=dict(block_sizes=config, interpret=interpret),
    )


def _prefill_or_decode(q, k_cache, v_cache, *, query_start_loc, **kwargs) -> jax.Array:
    """The split-KV kernels for a decode-shaped batch (a static rule), else the query-block
    kernel."""
    s = AttentionShapes.of(q, k_cache, query_start_loc)
    kernel = decode_attention if is_decode_shaped(s.num_tokens, s.num_seqs) else prefill_attention
    return kernel(q, k_cache, v_cache, query_start_loc=query_start_loc, **kwargs)


# ------------------------------------------------------------------------------ write_kv


def _write_kv_kernel(
    tok_slot_ref,  # [T] int32: destination slot (or page), -1 for tokens that write nothing
    tok_pos_ref,  # [T] int32: destination row in [0, L) (or in the page)
    k_ref,  # [T, Hkv, D]
    v_ref,  # [T, Hkv, D]
    k_in_ref,  # [S, L, Hkv, D], aliased to k_cache_ref
    v_in_ref,  # [S, L, Hkv, D], aliased to v_cache_ref
    k_cache_ref,  # [S, L, Hkv, D]
    v_cache_ref,  # [S, L, Hkv, D]
):
    del k_in_ref, v_in_ref  # the same buffers as the outputs
    t = pl.program_id(0)
    num_kv_heads, head_dim = k_ref.shape[1:]
    bh, bd = next_power_of_2(num_kv_heads), next_power_of_2(head_dim)
    tile = (jnp.arange(bh) < num_kv_heads)[:, None] & (jnp.arange(bd) < head_dim)[None, :]
    slot, pos = tok_slot_ref[t], tok_pos_ref[t]

    @pl.when(slot >= 0)
    def _():
        for src, dst in ((k_ref, k_cache_ref), (v_ref, v_cache_ref)):
            row = masked_load(
                src.at[t, pl.ds(static_index(0), bh), pl.ds(static_index(0), bd)], tile
            )
            plgpu.store(
                dst.at[slot, pos, pl.ds(static_index(0), bh), pl.ds(static_index(0), bd)],
                row.astype(dst.dtype),
                mask=tile,
            )


@functools.partial(jax.jit, static_argnames=("interpret",))
def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    block_table: jax.Array | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """See :func:`pallas_kernels.write_kv`; arguments are already validated. One program
    per token copies its ``[Hkv, D]`` keys and values to its slot's (or page's) row; the
    caches are updated in place. Differentiable in the caches, k and v (a training forward
    writes its keys before attending over them): see :func:`_differentiable_write_kv`."""
    write = _differentiable_write_kv(k.shape, jnp.dtype(k.dtype), interpret)
    return write(k_cache, v_cache, k, v, query_start_loc, kv_lens, slot_ids, block_table)


def _write_kv_call(
    k_cache, v_cache, k, v, query_start_loc, kv_lens, slot_ids, block_table, interpret
):
    num_kv_heads, head_dim = k_cache.shape[2:]
    num_tokens = k.shape[0]
    tok_slot, tok_pos = kv_destination(
        num_tokens, k_cache.shape, query_start_loc, kv_lens, slot_ids, block_table
    )
    row = next_power_of_2(num_kv_heads) * next_power_of_2(head_dim)
    # One 16-byte access per thread per row at 4 warps (512 threads × 8 bf16 = 4096).
    num_warps = max(1, min(4, row // 256))
    return pl.pallas_call(
        _write_kv_kernel,
        grid=(num_tokens,),
        out_shape=(
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ),
        input_output_aliases={4: 0, 5: 1},
        compiler_params=compiler_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"write_kv_h{num_kv_heads}_d{head_dim}",
    )(tok_slot, tok_pos, k, v, k_cache, v_cache)


@functools.cache
def _differentiable_write_kv(token_shape: tuple[int, ...], dtype: jnp.dtype, interpret: bool):
    """The write kernel with its backward, for tokens ``[T, Hkv, D]`` of one dtype: the
    transpose of the scatter. Each written row's cotangent goes to its token (a token that
    writes nothing gets 0), and the caches' cotangents pass through with the overwritten
    rows zeroed, by the write kernel itself writing zeros there."""

    @jax.custom_vjp
    def write(k_cache, v_cache, k, v, query_start_loc, kv_lens, slot_ids, block_table):
        index = (query_start_loc, kv_lens, slot_ids, block_table)
        return _write_kv_call(k_cache, v_cache, k, v, *index, interpret)

    def forward(k_cache, v_cache, k, v, *index):
        return write(k_cache, v_cache, k, v, *index), index

    def backward(index, cotangents):
        dk_cache, dv_cache = cotangents
        line, row = kv_destination(token_shape[0], dk_cache.shape, *index)
        written = (line >= 0)[:, None, None]
        safe_line = jnp.maximum(line, 0)
        dk = jnp.where(written, dk_cache[safe_line, row], 0).astype(dtype)
        dv = jnp.where(written, dv_cache[safe_line, row], 0).astype(dtype)
        zeros = jnp.zeros(token_shape, dtype)
        dk_cache, dv_cache = _write_kv_call(dk_cache, dv_cache, zeros, zeros, *index, interpret)
        return dk_cache, dv_cache, dk, dv, None, None, None, None

    write.defvjp(forward, backward)
    return write
