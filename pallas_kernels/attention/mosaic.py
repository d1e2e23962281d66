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
(:func:`plan`; items of 2 × ``block_q`` rows per sequence, longest first): rows, slot,
``kv_len``, first position and, per consumer, the KV blocks it computes with and without a
mask and those it only releases (blocks the other consumer needs). The kernel follows it.
One thread block per (item, query head), launched a group of adjacent heads at a time
(every item of the group's heads before the next group's): heads sharing a KV head run
side by side, and the K/V of the blocks in flight stays in L2 (:class:`BlockSizes`).

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
Triton kernels (:func:`supports`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Final, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import LOG2E, checked_slots
from pallas_kernels._mosaic import (
    CONSUMER_REGISTERS,
    PRODUCER_REGISTERS,
    TMA_ROWS,
    store_rows,
    swizzled_tiles,
)
from pallas_kernels._validation import check_int_fields
from pallas_kernels.attention._layout import (
    band_operand,
    is_decode_shaped,
    jit_attention,
    scale_operand,
)
from pallas_kernels.backend import device_num_sms

# Consumer warpgroups per thread block, each with ``block_q`` query rows.
_CONSUMERS: Final = 2
# Running max before any key: finite, so a row whose keys are all masked (-inf logits)
# keeps alpha = 2^(min - min) = 1 and p = 2^(-inf) = 0 instead of NaN.
_MASK_MAX: Final = float(jnp.finfo(jnp.float32).min)
_TINY: Final = float(jnp.finfo(jnp.float32).tiny)
_SUPPORTED_HEAD_DIMS: Final = (64, 128)
# Smallest KV tile (BlockSizes.block_k): paged caches need pages of a multiple of it.
_MIN_BLOCK_K: Final = 64

# Thread blocks of one head group, in waves of one block per SM (BlockSizes.head_group).
_WAVES_PER_HEAD_GROUP: Final = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the Mosaic GPU prefill kernel."""

    block_q: int = 64  # query rows per consumer warpgroup (the wgmma M dimension)
    block_k: int = 128  # keys per KV step
    num_stages: int = 2  # K/V slots in the TMA ring
    # Query heads launched side by side: heads [g * head_group, (g + 1) * head_group)
    # run every item, longest first, before group g + 1 starts. Few heads at a time keep
    # the K/V that concurrently running blocks read within L2; more shorten the tail
    # (the last group's longest items start late). None: default_head_group; else it
    # must divide the number of query heads.
    head_group: int | None = None

    def __post_init__(self):
        check_int_fields(self)
        if self.block_q != 64:
            raise ValueError(f"block_q={self.block_q} must be 64 (one wgmma row block)")
        if self.block_k % 64 or self.block_k < 64:
            raise ValueError(f"block_k={self.block_k} must be a multiple of 64")
        if self.num_stages < 2:
            raise ValueError(f"num_stages={self.num_stages} must be >= 2")
        if self.head_group is not None and self.head_group < 1:
            raise ValueError(f"head_group={self.head_group} must be >= 1")


def default_head_group(*, num_q_heads: int, group: int, num_items: int, num_sms: int) -> int:
    """The fewest heads, a multiple of the GQA ``group`` that divides ``num_q_heads``, whose
    blocks fill ``_WAVES_PER_HEAD_GROUP`` waves of the GPU (all heads if none does).
    Measured on an H200 (heads side by side → ms): dense-causal 1/4/32 → 1.212/1.194/1.248,
    ragged-tail (no GQA) 1/4/8/32 → 0.470/0.450/0.451/0.479, chunked-prefill 4/16/32 →
    2.163/2.103/2.091."""
    for heads in range(group, num_q_heads, group):
        if num_q_heads % heads == 0 and heads * num_items >= _WAVES_PER_HEAD_GROUP * num_sms:
            return heads
    return num_q_heads


def supports(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    query_start_loc: jax.Array,
    block_table: jax.Array | None = None,
    **_,
) -> str | None:
    """Why the Mosaic GPU prefill kernel cannot take this call (None: it can). Static facts
    only: shapes and dtypes."""
    del v_cache  # the api checked it has k_cache's shape and dtype
    if block_table is not None and k_cache.shape[1] % _MIN_BLOCK_K:
        return (
            f"block_size={k_cache.shape[1]} is not a multiple of {_MIN_BLOCK_K}: a KV tile "
            "of the Mosaic kernel must lie in one page"
        )
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"q is {q.dtype}; the wgmma kernel takes bf16 or fp16"
    if k_cache.dtype != q.dtype:
        return f"k_cache is {k_cache.dtype}, q is {q.dtype}; they must match"
    if q.shape[2] not in _SUPPORTED_HEAD_DIMS:
        return f"head dim {q.shape[2]} is not one of {_SUPPORTED_HEAD_DIMS}"
    # TMA views the token and cache axes in tiles of 8 rows.
    if q.shape[0] % TMA_ROWS or k_cache.shape[1] % TMA_ROWS:
        return f"T={q.shape[0]} and L={k_cache.shape[1]} must be multiples of {TMA_ROWS}"
    if is_decode_shaped(q.shape[0], query_start_loc.shape[0] - 1):
        return "decode-shaped batch (T <= B): the split-KV Triton kernel serves it"
    return None


def check_block_sizes(
    config: BlockSizes, *, num_q_heads: int, page_size: int | None = None
) -> None:
    """A ``head_group`` must divide the query heads; paged, ``block_k`` the page size."""
    if config.head_group is not None and num_q_heads % config.head_group:
        raise ValueError(
            f"config.head_group={config.head_group} must divide num_q_heads={num_q_heads}"
        )
    if page_size is not None and page_size % config.block_k:
        raise ValueError(
            f"config.block_k={config.block_k} must divide the paged cache's block_size={page_size}"
        )


def default_block_sizes(*, page_size: int | None = None) -> BlockSizes:
    """The default tiling; paged, KV tiles of at most the page (128 or 64 keys)."""
    blocks = BlockSizes()
    if page_size is not None and page_size % blocks.block_k:
        blocks = dataclasses.replace(blocks, block_k=_MIN_BLOCK_K)
    return blocks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
    """The kernel's work, one entry per item in launch order (built by :func:`plan`).

    An item is ``_CONSUMERS * block_q`` query rows starting at ``row0``; consumer ``c``
    reads rows ``row0 + c * block_q + [0, block_q)`` (positions ``pos0 + c * block_q + i``)
    and stores rows ``[first, first + live)`` of them. The producer loads the KV blocks
    ``[kv_lo, kv_hi)``; of those, a consumer computes ``[lo_blk, mid_lo)`` and
    ``[mid_hi, hi_blk)`` with a mask and ``[mid_lo, mid_hi)`` without, and only releases
    the others (blocks the other consumer needs). All fields are int32: ``[I]`` per item,
    ``[I, C]`` per item and consumer (``C = _CONSUMERS``).
    """

    row0: jax.Array  # [I] first packed query row, a multiple of 8 (TMA tile rows)
    slot: jax.Array  # [I] cache slot; -1: nothing to attend to (the rows are stored as 0)
    kv_len: jax.Array  # [I] keys of the item's sequence (0 when slot = -1)
    pos0: jax.Array  # [I] position of row row0 in the item's sequence
    kv_lo: jax.Array  # [I] first KV block the producer loads
    kv_hi: jax.Array  # [I] one past the last (kv_lo = kv_hi: none)
    first: jax.Array  # [I, C] first stored row of the consumer's block_q rows
    live: jax.Array  # [I, C] rows the consumer stores
    lo_blk: jax.Array  # [I, C] first KV block the consumer computes
    mid_lo: jax.Array  # [I, C] first of its unmasked blocks
    mid_hi: jax.Array  # [I, C] one past the last unmasked block
    hi_blk: jax.Array  # [I, C] one past the last computed block
    # [I, max_blocks] paged: the block table row of the item's sequence; None: contiguous
    table: jax.Array | None = None

    @property
    def num_items(self) -> int:
        return self.row0.shape[0]


def plan(
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    band: jax.Array,
    *,
    num_tokens: int,
    num_slots: int,
    cache_len: int,
    block_q: int,
    block_k: int,
    block_table: jax.Array | None = None,
) -> Plan:
    """The kernel's :class:`Plan` (jittable, no host sync).

    Paged (``block_table[B, max_blocks]``): ``num_slots`` is the pool's page count,
    ``cache_len`` the longest context ``max_blocks * page_size``; any slot id >= 0 is live
    and each item carries its sequence's table row.

    Segments are the sequences' rows plus the bucket rows past the last one (zeroed).
    A segment's items are ``_CONSUMERS * block_q``-row blocks starting at its first row
    rounded down to a multiple of 8 (TMA reads query tiles at tile-aligned rows), so an
    item's first rows may belong to the previous segment: they are computed and dropped.
    A consumer's keys ``[lo, hi)`` are visible to some row it stores and
    ``[full_lo, full_hi)`` to every one: its blocks ``[lo_blk, hi_blk)`` cover the former,
    its unmasked blocks ``[mid_lo, mid_hi)`` lie inside the latter. The producer loads the
    union of the consumers' blocks. Items are sorted by their number of KV blocks, longest
    first (the GPU starts the longest thread blocks first and ends on short ones).
    """
    item_rows = _CONSUMERS * block_q
    num_seqs = slot_ids.shape[0]
    # Each segment's items cover its rows plus < 8 leading rows: one extra item at most.
    num_items = pl.cdiv(num_tokens, item_rows) + 2 * (num_seqs + 1)
    qsl = jnp.clip(query_start_loc, 0, num_tokens).astype(jnp.int32)
    seg_start = qsl  # B sequences, then the bucket rows [qsl[-1], T)
    seg_end = jnp.append(qsl[1:], num_tokens)
    seg_aligned = seg_start - seg_start % TMA_ROWS
    seg_items = jnp.where(seg_end > seg_start, pl.cdiv(seg_end - seg_aligned, item_rows), 0)
    seg_items_end = jnp.cumsum(seg_items)
    item = jnp.arange(num_items, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(seg_items_end, item, side="right"), num_seqs)
    used = item < seg_items_end[-1]
    row0 = seg_aligned[seg] + (item - (seg_items_end[seg] - seg_items[seg])) * item_rows
    seq = jnp.minimum(seg, num_seqs - 1)
    is_seq = used & (seg < num_seqs)
    if block_table is None:
        seq_slot = checked_slots(slot_ids, num_slots)
    else:  # slot ids only mark padding
        seq_slot = jnp.where(slot_ids >= 0, 0, -1)
    slot = jnp.where(is_seq, seq_slot[seq], -1)
    attend = slot >= 0
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    pos0 = row0 + (kv_lens - q_len - query_start_loc[:-1])[seq]
    kv_len = jnp.where(attend, jnp.clip(kv_lens, 0, cache_len)[seq], 0)
    left, right = band[0], band[1]
    # Per item and consumer ([I, C]): the consumer's rows, stored rows and KV blocks.
    offset = jnp.arange(_CONSUMERS, dtype=jnp.int32) * block_q  # of its rows in the item
    tile_row = row0[:, None] + offset
    first = jnp.clip(seg_start[seg][:, None] - tile_row, 0, block_q)
    live = jnp.where(
        used[:, None], jnp.clip(seg_end[seg][:, None] - tile_row, 0, block_q) - first, 0
    )
    live = jnp.maximum(live, 0)
    pos_first = pos0[:, None] + offset + first
    pos_last = pos_first + live - 1
    lo = jnp.maximum(pos_first - left + 1, 0)
    hi = jnp.clip(pos_last + right + 1, 0, kv_len[:, None])
    full_lo = jnp.maximum(pos_last - left + 1, 0)
    full_hi = jnp.clip(pos_first + right + 1, 0, kv_len[:, None])
    works = attend[:, None] & (live > 0) & (hi > lo)
    lo_blk = lo // block_k
    hi_blk = jnp.where(works, pl.cdiv(hi, block_k), lo_blk)
    mid_lo = jnp.clip(pl.cdiv(full_lo, block_k), lo_blk, hi_blk)
    mid_hi = jnp.clip(full_hi // block_k, mid_lo, hi_blk)
    # The union of the working consumers' blocks; empty when none works.
    kv_hi = jnp.max(jnp.where(works, hi_blk, 0), axis=1)
    kv_lo = jnp.minimum(jnp.min(jnp.where(works, lo_blk, jnp.iinfo(jnp.int32).max), axis=1), kv_hi)

    def own_or_release(blocks):  # an idle consumer's bounds collapse onto kv_hi
        return jnp.where(works, blocks, kv_hi[:, None])

    item_plan = Plan(
        row0=row0,
        slot=slot,
        kv_len=kv_len,
        pos0=pos0,
        kv_lo=kv_lo,
        kv_hi=kv_hi,
        first=first,
        live=live,
        lo_blk=own_or_release(lo_blk),
        mid_lo=own_or_release(mid_lo),
        mid_hi=own_or_release(mid_hi),
        hi_blk=own_or_release(hi_blk),
        table=None if block_table is None else block_table[seq],
    )
    # Longest first; items that store nothing last.
    order = jnp.argsort(-jnp.where(used, kv_hi - kv_lo, -1), stable=True)
    return jax.tree.map(lambda field: field.astype(jnp.int32)[order], item_plan)


def kv_block_address(plan: Plan, item, j, *, block_k: int, pool_shape) -> tuple:
    """(cache line, first row) of the item's KV block ``j`` in the caches (``pool_shape``
    their shape). Paged: block j's page (clamped into the pool: a bad table entry is a
    caller bug, the copy stays in bounds) and its rows there; ``block_k`` divides the
    page."""
    if plan.table is None:
        return jnp.maximum(plan.slot[item], 0), j * block_k
    page_size = pool_shape[1]
    key0 = j * block_k
    page = plan.table[item, lax.div(key0, page_size)]
    return jnp.clip(page, 0, pool_shape[0] - 1), lax.rem(key0, page_size)


def produce_kv_ring(plan: Plan, item, refs, rings, full, free, *, kv_head, block_k: int):
    """The producer warpgroup's loop: KV blocks ``[kv_lo, kv_hi)`` of the item, K and V
    (``refs``) of ``kv_head``, TMA-copied into slot ``(j - kv_lo) % num_stages`` of their
    shared-memory ``rings[num_stages, block_k, D]``; ``full`` barriers fire when a copy
    lands, a slot is refilled once its ``free`` barriers (both consumers) fired."""
    kv_lo, kv_hi = plan.kv_lo[item], plan.kv_hi[item]
    num_stages = rings[0].shape[0]

    def load(block, slot):
        line, row = block
        for ref, ring, landed in zip(refs, rings, full, strict=True):
            src = ref.at[line, pl.ds(row, block_k), kv_head]
            plgpu.copy_gmem_to_smem(src, ring.at[slot], landed.at[slot])

    def address(j):
        return kv_block_address(plan, item, j, block_k=block_k, pool_shape=refs[0].shape)

    for i in range(num_stages):  # the ring's first fill
        pl.when(kv_lo + i < kv_hi)(lambda i=i: load(address(kv_lo + i), i))

    @pl.loop(kv_lo + num_stages, kv_hi)
    def _steady(j):
        slot = lax.rem(j - kv_lo, num_stages)
        # The page lookup (paged) is issued before the wait: its latency hides under the
        # consumers' work on the slot.
        block = address(j)
        for released in free:
            plgpu.barrier_wait(released.at[slot])
        load(block, slot)


class ConsumerWork(NamedTuple):
    """A consumer's share of a plan item (:class:`Plan`): its rows and KV blocks."""

    row0: jax.Array  # first of its block_q rows
    pos0: jax.Array  # the position of row0 in the item's sequence
    first: jax.Array  # first stored row of the block_q
    live: jax.Array  # rows stored
    lo_blk: jax.Array  # KV blocks [lo_blk, mid_lo) and [mid_hi, hi_blk) masked,
    mid_lo: jax.Array  # [mid_lo, mid_hi) not; the rest of [kv_lo, kv_hi) only released
    mid_hi: jax.Array
    hi_blk: jax.Array

    @classmethod
    def of(cls, plan: Plan, item, c, block_q: int) -> ConsumerWork:
        def own(field):  # consumer c's entry of an [I, C] field
            return jnp.where(c == 0, field[item, 0], field[item, 1])

        return cls(
            row0=plan.row0[item] + c * block_q,
            pos0=plan.pos0[item] + c * block_q,
            first=own(plan.first),
            live=own(plan.live),
            lo_blk=own(plan.lo_blk),
            mid_lo=own(plan.mid_lo),
            mid_hi=own(plan.mid_hi),
            hi_blk=own(plan.hi_blk),
        )


def _kernel(
    plan: Plan,  # a Plan of int32 refs, [num_items] or [num_items, _CONSUMERS] each
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

        @pl.when(wg == _CONSUMERS)
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

        @pl.when(wg < _CONSUMERS)
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
                column = (item * _CONSUMERS + c) * block_q
                plgpu.copy_smem_to_gmem(lse_smem.at[c], lse_ref.at[head, pl.ds(column, block_q)])
            store_rows(o_tile, o_ref, row0=row0, first=first, live=live, head=head)

    pl.run_scoped(
        body,
        plgpu.SMEM((_CONSUMERS, block_q, head_dim), dtype, transforms=tiles),
        plgpu.SMEM((_CONSUMERS, block_q, head_dim), dtype),
        None if lse_ref is None else plgpu.SMEM((_CONSUMERS, block_q), jnp.float32),
        plgpu.SMEM((num_stages, block_k, head_dim), dtype, transforms=tiles),
        plgpu.SMEM((num_stages, block_k, head_dim), dtype, transforms=tiles),
        plgpu.Barrier(num_barriers=_CONSUMERS),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=_CONSUMERS),
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
    :func:`supports`-ed. ``causal``, ``sm_scale`` and ``sliding_window`` may be traced.
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
                    (num_q_heads, item_plan.num_items * _CONSUMERS * b.block_q), jnp.float32
                ),
            )
            if with_lse
            else jax.ShapeDtypeStruct(q.shape, q.dtype)
        ),
        # The last axis varies fastest: the heads of a group (query heads sharing a KV
        # head are adjacent) side by side, then items longest first, then groups.
        grid=(num_q_heads // head_group, item_plan.num_items, head_group),
        grid_names=("head_group", "item", "head"),
        num_threads=_CONSUMERS + 1,
        thread_name="wg",
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
    tile_row0 = item_plan.row0[:, None] + jnp.arange(_CONSUMERS, dtype=jnp.int32) * block_q
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
    """See :func:`pallas_kernels.masked_tail_attention`; arguments are already validated and
    :func:`supports` takes the call (prefill batches: bf16/fp16, head dim 64 or 128, T and L
    multiples of 8). ``causal``, ``sm_scale`` and ``sliding_window`` reach the compiled
    program as data (:func:`~pallas_kernels.attention._layout.jit_attention`)."""
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
