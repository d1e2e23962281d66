"""Masked-tail attention prefill as a Pallas Mosaic GPU kernel (Hopper: wgmma, TMA).

FlashAttention-3 (Shah, Bikshandi, Zhang, Thakkar, Ramani, Dao, arXiv 2407.08608) layout
of one thread block: a producer warpgroup streams K/V tiles into a ring of shared-memory
slots with TMA, and two consumer warpgroups each own ``block_q`` query rows, run both
matmuls on the tensor cores (``wgmma``: ``S = Q K^T`` from shared memory, ``O += P V``
with ``P`` in registers) and keep the online softmax (FlashAttention-2, Algorithm 1) in
fp32 registers. Slots are recycled through barriers: "full" (TMA landed) and "free"
(both consumers are done with it). The consumers ping-pong (FlashAttention-3, 3.1): a
two-arrival barrier hands the tensor cores from one to the other, so one's softmax runs
under the other's matmuls.

The work is the Triton prefill kernel's (``triton.py``): the same visible band of keys,
and each consumer's KV loop covers exactly the blocks some stored row sees, masked only on
the window edge, diagonal and ``kv_len`` blocks. The wrapper builds a per-item plan
(``mosaic_common.plan``; items of 2 × ``block_q`` rows per sequence, longest first): rows, slot,
``kv_len``, first position and, per consumer, the KV blocks it computes with and without a
mask and those it only releases (blocks the other consumer needs). The kernel follows it.
One thread block per (item, query head), launched a group of adjacent heads at a time
(every item of the group's heads before the next group's): heads sharing a KV head run
side by side, and the K/V of the blocks in flight stays in L2 (``mosaic_config.BlockSizes``).

Masking never lets cache contents past ``kv_len`` (NaN in tests) reach an output: their
logits are replaced by ``-inf`` and, in the one block holding ``kv_len``, the consumers
zero those value rows in shared memory before ``P V`` (``0 × NaN`` would be NaN). Query
tiles start at rows that are multiples of 8 (TMA reads tiled tiles only there), so a tile
may begin with a few rows of the previous sequence and end with rows of the next: they
are computed and dropped. Outputs go out through TMA stores of exactly the rows a
consumer owns (a ladder of power-of-two row counts; TMA boxes are static), so no item
writes another sequence's rows. Rows no live sequence owns are written as zeros.

Paged caches (``block_table``): the plan carries each item's row of the block table and
the producer reads the page of KV block ``j`` from it, ``table[item, j * block_k //
page_size]`` (clamped into the pool), and TMA-copies the tile from row
``j * block_k % page_size`` of that page; ``block_k`` divides the page, so a tile never
spans two pages. Nothing else changes: the consumers see the same ring of tiles.

Covers bf16/fp16 queries and caches of the same dtype, head dims 64 and 128, any GQA
group, and token counts and cache lengths (paged: page sizes, multiples of 64) that are
multiples of 8. Other cases, and
decode-shaped batches (bandwidth-bound: the Triton flash-decoding kernels), go to the
Triton kernels (``mosaic_config.supports``).
"""

from __future__ import annotations

import functools
from typing import Final

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import LOG2E
from pallas_kernels._mosaic import (
    CONSUMER_REGISTERS,
    PRODUCER_REGISTERS,
    store_rows,
    swizzled_tiles,
)
from pallas_kernels.attention._layout import (
    band_operand,
    jit_attention,
    scale_operand,
)
from pallas_kernels.attention.mosaic_common import (
    CONSUMERS,
    ConsumerWork,
    Plan,
    plan,
    produce_kv_ring,
)
from pallas_kernels.attention.mosaic_config import (
    BlockSizes,
    check_block_sizes,
    default_head_group,
)
from pallas_kernels.backend import device_num_sms

# Running max before any key: finite, so a row whose keys are all masked (-inf logits)
# keeps alpha = 2^(min - min) = 1 and p = 2^(-inf) = 0 instead of NaN.
_MASK_MAX: Final = float(jnp.finfo(jnp.float32).min)
_TINY: Final = float(jnp.finfo(jnp.float32).tiny)


def _kernel(
    plan: Plan,  # a Plan of int32 refs, [num_items] or [num_items, CONSUMERS] each
    scale_ref,  # [1] fp32: sm_scale * log2(e)
    band_ref,  # [2] int32: (left, right)
    q_ref,  # [T, Hq, D]
    k_ref,  # [S, L, Hkv, D] (paged: [num_blocks, page_size, Hkv, D])
    v_ref,  # like k_ref
    o_ref,  # [T, Hq, D]
    lse_ref=None,  # [Hq, I * C * block_q] fp32 or None: each consumer's rows' lse
    *,
    group: int,
    head_group: int,
    block_q: int,
    block_k: int,
    num_stages: int,
):
    head_dim = q_ref.shape[2]
    dtype = q_ref.dtype
    tiles = swizzled_tiles(dtype)

    def body(
        q_smem, o_smem, lse_smem, k_smem, v_smem, q_full, k_full, v_full, k_free, v_free, turn
    ):
        # The ring: block j of the item's union [kv_lo, kv_hi) goes to slot (j - kv_lo) %
        # num_stages; k_full/v_full fire when its TMA lands, k_free/v_free when both
        # consumers are done with it (each consumer waits and arrives once per block).
        item = lax.axis_index("item")
        head = lax.axis_index("head_group") * head_group + lax.axis_index("head")
        wg = lax.axis_index("wg")
        kv_head = head // group

        kv_lo, kv_hi = plan.kv_lo[item], plan.kv_hi[item]

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            produce_kv_ring(
                plan,
                item,
                (k_ref, v_ref),
                (k_smem, v_smem),
                (k_full, v_full),
                (k_free, v_free),
                kv_head=kv_head,
                block_k=block_k,
            )

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            c = wg
            work = ConsumerWork.of(plan, item, c, block_q)
            row0, pos0, first, live = work.row0, work.pos0, work.first, work.live
            lo_blk, mid_lo, mid_hi, hi_blk = work.lo_blk, work.mid_lo, work.mid_hi, work.hi_blk
            attend = plan.slot[item] >= 0
            kv_len = plan.kv_len[item]
            q_tile, o_tile = q_smem.at[c], o_smem.at[c]
            left, right = band_ref[0], band_ref[1]
            qk_scale = scale_ref[0]

            @pl.when(attend & (lo_blk < hi_blk))
            def _load_q():
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, block_q), head], q_tile, q_full.at[c])
                plgpu.barrier_wait(q_full.at[c])

            def take_turn():
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)

            def release(j, carry):
                ring = lax.rem(j - kv_lo, num_stages)
                plgpu.barrier_wait(k_full.at[ring])
                plgpu.barrier_arrive(k_free.at[ring])
                plgpu.barrier_wait(v_full.at[ring])
                plgpu.barrier_arrive(v_free.at[ring])
                take_turn()  # a step's two turns, so the consumers stay in step
                take_turn()
                return carry

            def step(j, carry, *, masked):
                m, l, acc = carry
                ring = lax.rem(j - kv_lo, num_stages)
                plgpu.barrier_wait(k_full.at[ring])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_tile, k_smem.at[ring].transpose((1, 0)))
                    take_turn()  # the other consumer's softmax overlaps this matmul
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((block_q, block_k), jnp.float32))
                plgpu.barrier_arrive(k_free.at[ring])
                s = s * qk_scale
                if masked:
                    shape = (block_q, block_k)
                    pos = pos0 + plgpu.broadcasted_iota(
                        jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA
                    )
                    key = j * block_k + plgpu.broadcasted_iota(
                        jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA
                    )
                    visible = (key < kv_len) & (key <= pos + right) & (key > pos - left)
                    s = jnp.where(visible, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                l = l * alpha + p.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p = p.astype(dtype)
                # Keeps the softmax ahead of the turn hand-over (FlashAttention-3's order).
                m_new, l, acc, p = lax.optimization_barrier((m_new, l, acc, p))
                plgpu.barrier_arrive(turn)  # softmax done: the tensor cores are free
                plgpu.barrier_wait(v_full.at[ring])
                v_tile = v_smem.at[ring]
                if masked:
                    # Value rows at or past kv_len hold whatever the cache holds there
                    # (NaN in tests): p is 0 for them, but 0 * NaN is not. Both
                    # consumers write the same zeros, so the overlap is harmless.
                    @pl.when((j + 1) * block_k > kv_len)
                    def _zero_tail():
                        v = plgpu.load(v_tile, layout=plgpu.Layout.WGMMA)
                        key_row = j * block_k + plgpu.broadcasted_iota(
                            jnp.int32, v.shape, 0, layout=plgpu.Layout.WGMMA
                        )
                        v_tile[...] = jnp.where(key_row < kv_len, v, jnp.zeros_like(v))
                        plgpu.commit_smem()

                plgpu.barrier_wait(turn)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p, v_tile)

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[ring])
                return m_new, l, acc

            m = plgpu.layout_cast(
                jnp.full((block_q,), _MASK_MAX, jnp.float32), plgpu.Layout.WGMMA.reduce(1)
            )
            l = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.zeros((block_q, head_dim), jnp.float32), plgpu.Layout.WGMMA)
            carry = (m, l, acc)
            # Ping-pong (FlashAttention-3, section 3.1): the consumers pass turns through a
            # two-arrival barrier, so one's softmax runs under the other's matmuls. Every
            # step (computed or released) takes two turns per consumer; consumer 1 takes
            # one first and consumer 0 one last, which offsets them by half a step.
            pl.when(c == 1)(take_turn)
            lax.fori_loop(kv_lo, lo_blk, release, None)
            carry = lax.fori_loop(lo_blk, mid_lo, functools.partial(step, masked=True), carry)
            carry = lax.fori_loop(mid_lo, mid_hi, functools.partial(step, masked=False), carry)
            carry = lax.fori_loop(mid_hi, hi_blk, functools.partial(step, masked=True), carry)
            lax.fori_loop(hi_blk, kv_hi, release, None)
            pl.when(c == 0)(take_turn)
            m, l, acc = carry
            # Rows with no visible key and zeroing items (no step: l = 0, acc = 0) give 0.
            out = acc * lax.broadcast_in_dim(1.0 / jnp.maximum(l, _TINY), acc.shape, [0])
            o_tile[...] = out.astype(dtype)
            if lse_ref is not None:
                # log2-sum-exp2 of the scaled logits (rows with no visible key: finfo.min
                # + log2(tiny), finite), every row of the consumer's tile: the wrapper
                # gathers the stored rows' entries.
                lse_smem.at[c][...] = m + jnp.log(jnp.maximum(l, _TINY)) * LOG2E
            plgpu.commit_smem()
            if lse_ref is not None:
                column = (item * CONSUMERS + c) * block_q
                plgpu.copy_smem_to_gmem(lse_smem.at[c], lse_ref.at[head, pl.ds(column, block_q)])
            store_rows(o_tile, o_ref, row0=row0, first=first, live=live, head=head)

    pl.run_scoped(
        body,
        plgpu.SMEM((CONSUMERS, block_q, head_dim), dtype, transforms=tiles),
        plgpu.SMEM((CONSUMERS, block_q, head_dim), dtype),
        None if lse_ref is None else plgpu.SMEM((CONSUMERS, block_q), jnp.float32),
        plgpu.SMEM((num_stages, block_k, head_dim), dtype, transforms=tiles),
        plgpu.SMEM((num_stages, block_k, head_dim), dtype, transforms=tiles),
        plgpu.Barrier(num_barriers=CONSUMERS),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=CONSUMERS),
        collective_axes="wg",
    )


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
    with_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The Mosaic GPU prefill kernel, ``out[T, Hq, D]``; the call must be
    ``mosaic_config.supports``-ed. ``causal``, ``sm_scale`` and ``sliding_window`` may be traced.
    With ``block_table`` the caches are page pools (``block_k`` must divide the page).
    ``with_lse``: also ``lse[T, Hq]`` fp32, each row's log2-sum-exp2 of its scaled logits
    (the Triton prefill kernel's ``lse``, what the backward kernels recompute the
    probabilities from; 0 for rows of padding sequences and past the sequences)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_slots, cache_len, num_kv_heads = k_cache.shape[:3]
    b = block_sizes
    if block_table is not None:
        check_block_sizes(b, num_q_heads=num_q_heads, page_size=cache_len)
        cache_len *= block_table.shape[1]
        block_table = block_table.astype(jnp.int32)
    band = band_operand(causal, sliding_window)
    item_plan = plan(
        query_start_loc,
        kv_lens,
        slot_ids,
        band,
        num_tokens=num_tokens,
        num_slots=num_slots,
        cache_len=cache_len,
        block_q=b.block_q,
        block_k=b.block_k,
        block_table=block_table,
    )
    group = num_q_heads // num_kv_heads
    if b.head_group is None:
        head_group = default_head_group(
            num_q_heads=num_q_heads,
            group=group,
            num_items=item_plan.num_items,
            num_sms=device_num_sms(),
        )
    elif num_q_heads % b.head_group:
        raise ValueError(f"head_group={b.head_group} must divide num_q_heads={num_q_heads}")
    else:
        head_group = b.head_group
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            group=group,
            head_group=head_group,
            block_q=b.block_q,
            block_k=b.block_k,
            num_stages=b.num_stages,
        ),
        out_type=(
            (
                jax.ShapeDtypeStruct(q.shape, q.dtype),
                jax.ShapeDtypeStruct(
                    (num_q_heads, item_plan.num_items * CONSUMERS * b.block_q), jnp.float32
                ),
            )
            if with_lse
            else jax.ShapeDtypeStruct(q.shape, q.dtype)
        ),
        # The last axis varies fastest: the heads of a group (query heads sharing a KV
        # head are adjacent) side by side, then items longest first, then groups.
        grid=(num_q_heads // head_group, item_plan.num_items, head_group),
        grid_names=("head_group", "item", "head"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        kernel_name=(
            f"attention_prefill_mosaic_bq{b.block_q}_bk{b.block_k}_s{b.num_stages}"
            f"_hg{head_group}_g{group}_d{head_dim}_lse{int(with_lse)}"
            f"{'' if block_table is None else f'_paged{k_cache.shape[1]}'}"
        ),
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane
        ),
    )
    result = kernel(item_plan, scale_operand(sm_scale), band, q, k_cache, v_cache)
    if not with_lse:
        return result
    out, tile_lse = result
    return out, _stored_rows_lse(tile_lse, item_plan, num_tokens=num_tokens, block_q=b.block_q)


def _stored_rows_lse(tile_lse: jax.Array, item_plan: Plan, *, num_tokens: int, block_q: int):
    """``lse[T, Hq]`` from the consumers' tiles ``tile_lse[Hq, I * C * block_q]``: each
    packed row's entry from the one consumer that stores it (every row has one); rows of
    items with nothing to attend to (padding sequences, bucket rows) get 0."""
    rows = jnp.arange(block_q, dtype=jnp.int32)
    tile_row0 = item_plan.row0[:, None] + jnp.arange(CONSUMERS, dtype=jnp.int32) * block_q
    token = tile_row0[:, :, None] + rows  # [I, C, block_q]
    first, live = item_plan.first[:, :, None], item_plan.live[:, :, None]
    stored = (rows >= first) & (rows < first + live)
    token = jnp.where(stored, token, num_tokens)  # out of bounds: dropped
    column = jnp.arange(token.size, dtype=jnp.int32).reshape(token.shape)
    index = jnp.zeros((num_tokens,), jnp.int32).at[token.ravel()].set(column.ravel(), mode="drop")
    attends = (
        jnp.zeros((num_tokens,), jnp.bool_)
        .at[token.ravel()]
        .set(
            jnp.broadcast_to((item_plan.slot >= 0)[:, None, None], token.shape).ravel(), mode="drop"
        )
    )
    return jnp.where(attends[:, None], tile_lse[:, index].T, 0.0)


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
) -> jax.Array:
    """See :func:`pallas_kernels.masked_tail_attention`; arguments are already validated
    and ``mosaic_config.supports`` takes the call (prefill batches: bf16/fp16, head dim 64
    or 128, T and L multiples of 8). ``causal``, ``sm_scale`` and ``sliding_window`` reach
    the compiled program as data (:func:`~pallas_kernels.attention._layout.jit_attention`)."""
    return jit_attention(
        prefill_attention,
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
        static=dict(block_sizes=config),
    )
