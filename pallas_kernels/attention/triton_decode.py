"""Split-KV (flash-decoding) attention over a slot-indexed KV cache as Pallas kernels
lowered through Triton: what ``triton.py`` runs for decode-shaped batches (``T <= B``).

Flash-decoding (Dao, Haziza, Massa, Sizov, "Flash-Decoding for long-context inference",
2023), two launches:

1. ``attention_decode`` (grid: KV head × token × KV split): each token's visible keys are
   cut into ``split_k``-key splits processed in parallel, each writing a partial
   ``(m, l, acc)`` of the online softmax (``triton_common``). Splits outside the token's
   visible range exit without loading anything, so the number of working splits follows
   ``kv_lens`` at run time. Every token's sequence and position come from the packed
   layout: any layout is correct.
2. ``attention_decode_combine`` (grid: KV head × token): merges the token's live splits,
   a few per step (their loads overlap):
   ``out = Σ_s 2^(m_s - M) acc_s / Σ_s 2^(m_s - M) l_s`` with ``M = max_s m_s``.

Not differentiated itself: under differentiation ``triton.py`` runs its query-block
kernel, whose ``lse`` the backward needs.
"""

from __future__ import annotations

import functools
from typing import Final

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
from pallas_kernels.attention._layout import band_operand, scale_operand, token_layout
from pallas_kernels.attention.triton_common import (
    MASK_VALUE,
    TINY,
    block_ranges,
    kv_lines,
    kv_loop,
    kv_step,
    kv_table,
    softmax_init,
)
from pallas_kernels.attention.triton_config import (
    AttentionShapes,
    BlockSizes,
    check_paged_block_sizes,
    paged_suffix,
)

# Elements of one combine step's [splits, group, head dim] fp32 tile: 8 splits at
# group 4, D = 128, i.e. 32 per thread at 4 warps.
_COMBINE_TILE_ELEMS: Final = 4096


def _decode_kernel(
    tok_slot_ref,  # [T] int32: the token's cache slot (paged: >= 0), -1 for dead tokens
    tok_lo_ref,  # [T] int32: first visible key
    tok_hi_ref,  # [T] int32: one past the last visible key
    tok_table_ref,  # [T, W] int32: the KV addressing of the token's sequence (kv_lines)
    scale_ref,  # [1] fp32: sm_scale * log2(e)
    q_ref,  # [T, Hq, D]
    k_ref,  # [S, L, Hkv, D] (paged: [num_blocks, page_size, Hkv, D])
    v_ref,  # like k_ref
    m_ref,  # [T, Hkv, num_splits, rows] fp32: partial row max (log2 units)
    l_ref,  # [T, Hkv, num_splits, rows] fp32: partial row sum
    acc_ref,  # [T, Hkv, num_splits, rows, bd] fp32: partial unnormalised output
    *,
    group: int,
    head_dim: int,
    split_k: int,
    block_k: int,
    page_size: int | None,
    compute_dtype,
):
    # NOTE: the KV head is the fastest grid axis: the Hkv programs of one token and split
    # run together and read neighbouring bytes of the same cache rows ([L, Hkv, D]).
    h, t, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # Q tile rows: the group's heads, padded to 16 (the smallest Triton dot dimension).
    rows = max(next_power_of_2(group), MIN_DOT_DIM)
    bd = block_dim(head_dim, MIN_DOT_DIM)
    g_live = jnp.arange(rows) < group
    d_live = jnp.arange(bd) < head_dim
    slot = tok_slot_ref[t]
    k0 = jnp.maximum(tok_lo_ref[t], split * split_k)
    k1 = jnp.minimum(tok_hi_ref[t], (split + 1) * split_k)

    # Splits outside the token's visible keys (and dead tokens) load and write nothing;
    # the combine kernel reads only the live ones.
    @pl.when((slot >= 0) & (k0 < k1))
    def _():
        qk_scale = scale_ref[0]
        q = masked_load(
            q_ref.at[t, pl.ds(h * group, rows), pl.ds(static_index(0), bd)],
            g_live[:, None] & d_live[None, :],
        ).astype(compute_dtype)
        lines = kv_lines(tok_table_ref, t, page_size=page_size, num_lines=k_ref.shape[0])

        def kv_block(j, carry, *, masked):
            start = j * block_k
            visible = None
            if masked:
                keys = start + jnp.arange(block_k)
                visible = jnp.broadcast_to(((keys >= k0) & (keys < k1))[None, :], (rows, block_k))
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
                kv_len=k1,
                masked=masked,
                visible=visible,
                qk_scale=qk_scale,
            )

        carry = softmax_init(rows, bd)
        # One row: keys [k0, k1) are visible to all of it; only the end blocks are masked.
        bounds = block_ranges(k0, k1, k0, k1, block_k)
        m, l, acc = kv_loop(kv_block, carry, *bounds)
        plgpu.store(m_ref.at[t, h, split, pl.ds(static_index(0), rows)], m, mask=g_live)
        plgpu.store(l_ref.at[t, h, split, pl.ds(static_index(0), rows)], l, mask=g_live)
        plgpu.store(
            acc_ref.at[t, h, split, pl.ds(static_index(0), rows), pl.ds(static_index(0), bd)],
            acc,
            mask=jnp.broadcast_to(g_live[:, None], (rows, bd)),
        )


def _decode_combine_kernel(
    tok_slot_ref,  # [T] int32
    tok_lo_ref,  # [T] int32
    tok_hi_ref,  # [T] int32
    m_ref,  # [T, Hkv, num_splits, rows] fp32 (rows: the group padded to >= 16)
    l_ref,  # [T, Hkv, num_splits, rows] fp32
    acc_ref,  # [T, Hkv, num_splits, rows, bd] fp32
    o_ref,  # [T, Hq, D]
    *,
    group: int,
    head_dim: int,
    split_k: int,
    block_splits: int,
):
    h, t = pl.program_id(0), pl.program_id(1)
    bg, bd = next_power_of_2(group), acc_ref.shape[-1]
    g_live = jnp.arange(bg) < group
    d_live = jnp.arange(bd) < head_dim
    tile = g_live[:, None] & d_live[None, :]
    lo, hi = tok_lo_ref[t], tok_hi_ref[t]
    live = (tok_slot_ref[t] >= 0) & (lo < hi)
    # The splits the decode kernel wrote: those meeting [lo, hi).
    first = lo // split_k
    last = jnp.where(live, pl.cdiv(hi, split_k), first)

    # ``block_splits`` splits per step, loaded together (their loads overlap); splits at or
    # past ``last`` (never written) are masked: m = finfo.min, l = acc = 0.
    def merge(i, carry):
        m, l, acc = carry
        s0 = first + i * block_splits
        mask = ((s0 + jnp.arange(block_splits)) < last)[:, None] & g_live[None, :]  # [C, bg]
        m_s = plgpu.load(
            m_ref.at[t, h, pl.ds(s0, block_splits), pl.ds(static_index(0), bg)],
            mask=mask,
            other=MASK_VALUE,
        )
        l_s = masked_load(l_ref.at[t, h, pl.ds(s0, block_splits), pl.ds(static_index(0), bg)], mask)
        acc_s = masked_load(
            acc_ref.at[
                t,
                h,
                pl.ds(s0, block_splits),
                pl.ds(static_index(0), bg),
                pl.ds(static_index(0), bd),
            ],
            jnp.broadcast_to(mask[:, :, None], (block_splits, bg, bd)),
        )
        m_new = jnp.maximum(m, jnp.max(m_s, axis=0))
        alpha = jnp.exp2(m - m_new)  # [bg]
        beta = jnp.exp2(m_s - m_new[None, :])  # [C, bg]
        l = l * alpha + jnp.sum(l_s * beta, axis=0)
        acc = acc * alpha[:, None] + jnp.sum(acc_s * beta[:, :, None], axis=0)
        return m_new, l, acc

    carry = softmax_init(bg, bd)
    _, l, acc = jax.lax.fori_loop(0, pl.cdiv(last - first, block_splits), merge, carry)
    out = acc * (1.0 / jnp.maximum(l, TINY))[:, None]
    plgpu.store(
        o_ref.at[t, pl.ds(h * group, bg), pl.ds(static_index(0), bd)],
        out.astype(o_ref.dtype),
        mask=tile,
    )


def decode_attention(
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
) -> jax.Array:
    """The split-KV (flash-decoding) kernels, one program per token × KV head × split;
    correct for any layout, fast when every sequence has one token. ``out[T, Hq, D]``.
    ``causal``, ``sm_scale`` and ``sliding_window`` may be traced scalars."""
    s = AttentionShapes.of(q, k_cache, query_start_loc, block_table)
    b = block_sizes
    check_paged_block_sizes(b, s.page_size)
    split_k = min(b.split_k, max(block_dim(s.cache_len), b.decode_block_k))
    num_splits = pl.cdiv(s.cache_len, split_k)
    layout = token_layout(s.num_tokens, query_start_loc, kv_lens, slot_ids)
    kv_len = jnp.clip(layout.kv_len, 0, s.cache_len)
    left, right = band_operand(causal, sliding_window)
    hi = jnp.clip(layout.position + right + 1, 0, kv_len)
    lo = jnp.maximum(layout.position - left + 1, 0)
    tok_slot, tok_table = kv_table(
        s, layout.slot, None if block_table is None else block_table[layout.seq]
    )
    tok_slot = jnp.where(layout.live, tok_slot, -1)
    tokens = (tok_slot, lo.astype(jnp.int32), hi.astype(jnp.int32))
    f32 = jnp.float32
    # Partials keep the decode Q tile's padded rows (only the group's rows are written).
    rows = max(s.block_group, MIN_DOT_DIM)
    partial_rows = (s.num_tokens, s.num_kv_heads, num_splits, rows)
    m, l, acc = pl.pallas_call(
        functools.partial(
            _decode_kernel,
            group=s.group,
            head_dim=s.head_dim,
            split_k=split_k,
            block_k=b.decode_block_k,
            page_size=s.page_size,
            compute_dtype=jnp.promote_types(q.dtype, k_cache.dtype),
        ),
        grid=(s.num_kv_heads, s.num_tokens, num_splits),
        out_shape=(
            jax.ShapeDtypeStruct(partial_rows, f32),
            jax.ShapeDtypeStruct(partial_rows, f32),
            jax.ShapeDtypeStruct((*partial_rows, s.block_d), f32),
        ),
        compiler_params=compiler_params(
            num_warps=b.decode_num_warps, num_stages=b.decode_num_stages
        ),
        interpret=interpret,
        name=(
            f"attention_decode_split{split_k}_bk{b.decode_block_k}_w{b.decode_num_warps}"
            f"_s{b.decode_num_stages}_g{s.group}_d{s.head_dim}{paged_suffix(s)}"
        ),
    )(*tokens, tok_table, scale_operand(sm_scale), q, k_cache, v_cache)
    block_splits = min(
        block_dim(num_splits), max(1, _COMBINE_TILE_ELEMS // (s.block_group * s.block_d))
    )
    # At least 8 fp32 elements of the [block_splits, group, D] tile per thread.
    combine_warps = max(1, min(4, block_splits * s.block_group * s.block_d // 256))
    return pl.pallas_call(
        functools.partial(
            _decode_combine_kernel,
            group=s.group,
            head_dim=s.head_dim,
            split_k=split_k,
            block_splits=block_splits,
        ),
        grid=(s.num_kv_heads, s.num_tokens),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=compiler_params(num_warps=combine_warps, num_stages=2),
        interpret=interpret,
        name=f"attention_decode_combine_split{split_k}_c{block_splits}_g{s.group}_d{s.head_dim}",
    )(*tokens, m, l, acc)
