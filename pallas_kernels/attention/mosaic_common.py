"""The Mosaic GPU attention prefill's schedule and KV producer, which its forward
(``mosaic.py``) and the dQ kernel of its backward (``mosaic_vjp.py``) share: the items of
work (:class:`Plan`, :func:`plan`), a consumer's share of one (:class:`ConsumerWork`) and
the producer warpgroup's TMA ring of K/V tiles (:func:`produce_kv_ring`)."""

from __future__ import annotations

import dataclasses
from typing import Final, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import checked_slots
from pallas_kernels._mosaic import TMA_ROWS

# Consumer warpgroups per thread block (FlashAttention-3's layout: the forward's and both
# backward kernels'); forward and dQ: each with ``block_q`` query rows.
CONSUMERS: Final = 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
    """The kernel's work, one entry per item in launch order (built by :func:`plan`).

    An item is ``CONSUMERS * block_q`` query rows starting at ``row0``; consumer ``c``
    reads rows ``row0 + c * block_q + [0, block_q)`` (positions ``pos0 + c * block_q + i``)
    and stores rows ``[first, first + live)`` of them. The producer loads the KV blocks
    ``[kv_lo, kv_hi)``; of those, a consumer computes ``[lo_blk, mid_lo)`` and
    ``[mid_hi, hi_blk)`` with a mask and ``[mid_lo, mid_hi)`` without, and only releases
    the others (blocks the other consumer needs). All fields are int32: ``[I]`` per item,
    ``[I, C]`` per item and consumer (``C = CONSUMERS``).
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
    A segment's items are ``CONSUMERS * block_q``-row blocks starting at its first row
    rounded down to a multiple of 8 (TMA reads query tiles at tile-aligned rows), so an
    item's first rows may belong to the previous segment: they are computed and dropped.
    A consumer's keys ``[lo, hi)`` are visible to some row it stores and
    ``[full_lo, full_hi)`` to every one: its blocks ``[lo_blk, hi_blk)`` cover the former,
    its unmasked blocks ``[mid_lo, mid_hi)`` lie inside the latter. The producer loads the
    union of the consumers' blocks. Items are sorted by their number of KV blocks, longest
    first (the GPU starts the longest thread blocks first and ends on short ones).
    """
    item_rows = CONSUMERS * block_q
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
    offset = jnp.arange(CONSUMERS, dtype=jnp.int32) * block_q  # of its rows in the item
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
