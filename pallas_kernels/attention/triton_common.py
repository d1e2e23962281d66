"""Pieces of the Triton attention kernels that the prefill (``triton.py``), decode
(``triton_decode.py``) and backward (``triton_vjp.py``) kernels share, so that none of
those files imports another:

* the online softmax of FlashAttention-2 (Dao, arXiv 2307.08691, Algorithm 1) one KV block
  at a time (:func:`softmax_init`, :func:`softmax_step`) and the masked / unmasked /
  masked loop over a program's KV blocks (:func:`block_ranges`, :func:`kv_loop`);
* KV addressing, contiguous or paged (:func:`kv_lines`, :func:`kv_table`), and the masked
  loads of K and V blocks (:func:`load_kv_block`, :func:`kv_step`);
* the query-block schedule and per-sequence operands that the forward and both backward
  kernels walk (:class:`PrefillPlan`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Final

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import checked_slots
from pallas_kernels._pallas import MIN_DOT_DIM, block_dim, dot, masked_load, static_index
from pallas_kernels.attention._layout import band_operand, prefill_schedule, prefill_table
from pallas_kernels.attention.triton_config import AttentionShapes

# Masked logits get the lowest finite fp32, not -inf: a row with no visible key in a block
# then has max = finfo.min and exp2(logit - max) stays finite, where -inf - (-inf) would be
# NaN. The same mask zeroes those exponentials, so a row that never sees a key ends with
# l = 0 and acc = 0, and the final acc / max(l, tiny) is an exact 0.
MASK_VALUE: Final = float(jnp.finfo(jnp.float32).min)
TINY: Final = float(jnp.finfo(jnp.float32).tiny)


def softmax_init(rows: int, bd: int):
    """The online softmax's state before any key: (running max, denominator, output)."""
    return (
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, bd), jnp.float32),
    )


def softmax_step(carry, q, k, v, visible, qk_scale):
    """One KV block of the online softmax (FlashAttention-2, Algorithm 1, lines 8-10).

    ``q[M, bd]``, ``k, v[bk, bd]``, ``visible[M, bk]`` or None (every key visible);
    ``qk_scale = sm_scale * log2(e)``, so ``m`` is in log2 units.
    """
    m, l, acc = carry
    s = dot(q, k, trans_b=True) * qk_scale  # [M, bk]
    if visible is not None:
        s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    if visible is not None:
        p = jnp.where(visible, p, 0.0)  # all-masked rows: 2^(finfo.min - finfo.min) = 1
    l = l * alpha + jnp.sum(p, axis=1)
    # NOTE: p is 0 for keys a row does not see, but 0 · NaN is NaN inside the dot: a
    # non-finite *value* that is causally later or outside the window (yet before kv_len)
    # reaches the rows of this block that do not see it. Guarding the product (zeroed bad
    # values, the rows that see one marked) cost 14-20% on the H200 prefill problems, 16-17%
    # even in masked blocks only, so the kernel leaves it; see docs/design.md.
    acc = acc * alpha[:, None] + dot(p.astype(v.dtype), v)
    return m_new, l, acc


def block_ranges(lo, hi, full_lo, full_hi, block_k):
    """KV block bounds ``lo_blk <= mid_lo <= mid_hi <= hi_blk`` of one program.

    Keys ``[lo, hi)`` are visible to some row and ``[full_lo, full_hi)`` to every row
    (all bounds >= 0). Blocks ``[mid_lo, mid_hi)`` lie inside the latter (no mask); the
    others are masked. ``hi <= lo`` gives no block at all.
    """
    lo_blk = lo // block_k
    hi_blk = jnp.where(hi > lo, pl.cdiv(hi, block_k), lo_blk)
    mid_lo = jnp.clip(pl.cdiv(full_lo, block_k), lo_blk, hi_blk)
    mid_hi = jnp.clip(full_hi // block_k, mid_lo, hi_blk)
    return lo_blk, mid_lo, mid_hi, hi_blk


def query_block_ranges(pos_first, pos_last, kv_len, left, right, block_k):
    """:func:`block_ranges` of a query block whose rows sit at positions
    ``[pos_first, pos_last]`` and see keys ``pos - left < key <= pos + right`` below
    ``kv_len``: keys visible to some row are ``[lo, hi)``, to every row
    ``[full_lo, full_hi)``. The forward and the dq kernels walk the same blocks."""
    hi = jnp.clip(pos_last + right + 1, 0, kv_len)
    full_hi = jnp.clip(pos_first + right + 1, 0, kv_len)
    lo = jnp.maximum(pos_first - left + 1, 0)
    full_lo = jnp.maximum(pos_last - left + 1, 0)
    return block_ranges(lo, hi, full_lo, full_hi, block_k)


def kv_loop(kv_block, carry, lo_blk, mid_lo, mid_hi, hi_blk):
    """Masked window-edge blocks, unmasked interior, masked diagonal / kv_len boundary
    blocks (the first loop is empty without a sliding window)."""
    carry = jax.lax.fori_loop(lo_blk, mid_lo, functools.partial(kv_block, masked=True), carry)
    carry = jax.lax.fori_loop(mid_lo, mid_hi, functools.partial(kv_block, masked=False), carry)
    return jax.lax.fori_loop(mid_hi, hi_blk, functools.partial(kv_block, masked=True), carry)


# Paged block tables up to this many entries per row are held in registers by the KV loops
# (:func:`kv_lines`); wider ones are read entry by entry.
_TABLE_IN_REGISTERS: Final = 256


def kv_lines(table_ref, r, *, page_size: int | None, num_lines: int):
    """``start -> (line, row)``: where keys ``start..start+block_k`` of table row ``r`` lie.

    ``table_ref[R, W]`` int32 addresses the keys. Contiguous (``page_size`` None): ``W = 1``,
    the entry is the row's slot (read once, outside the KV loop) and key ``j`` is at
    ``[slot, j]``. Paged: key ``j`` is at ``[table[r, j // page_size], j % page_size]``, the
    page clamped into the pool (an entry a sequence needs outside it is a caller bug, which
    ``validate=True`` reports; the kernels stay in bounds). A KV block never spans two pages:
    ``block_k`` divides ``page_size`` (:func:`check_paged_block_sizes`).
    """
    if page_size is None:
        slot = table_ref[r, 0]
        return lambda start: (slot, start)
    width = table_ref.shape[1]
    if width <= _TABLE_IN_REGISTERS:
        # The row's page ids are read once, before the KV loop, and each block picks its
        # page from registers: a page id loaded inside the loop made every K/V tile load
        # wait on it, which kept Triton from prefetching the tiles (the paged prefill ran
        # 21-27% behind the contiguous one).
        entries = block_dim(width)
        index = jnp.arange(entries)
        pages = plgpu.load(
            table_ref.at[r, pl.ds(static_index(0), entries)], mask=index < width, other=0
        )
        pages = jnp.clip(pages, 0, num_lines - 1)

        def from_registers(start):
            page = jnp.sum(jnp.where(index == start // page_size, pages, 0))
            return page, start % page_size

        return from_registers

    def paged(start):
        page = table_ref[r, start // page_size]
        return jnp.clip(page, 0, num_lines - 1), start % page_size

    return paged


def load_kv(ref, line, row, start, h, *, block_k, head_dim, kv_len, masked):
    """``[block_k, bd]`` keys or values ``start..start+block_k`` (rows ``row..`` of cache line
    ``line``), KV head ``h``; entries at or past ``kv_len`` (masked blocks) and the head-dim
    padding read 0."""
    bd = block_dim(head_dim, MIN_DOT_DIM)
    d_live = jnp.arange(bd) < head_dim
    if masked:
        mask = ((start + jnp.arange(block_k)) < kv_len)[:, None] & d_live[None, :]
    elif bd != head_dim:
        mask = jnp.broadcast_to(d_live[None, :], (block_k, bd))
    else:
        mask = None
    return masked_load(ref.at[line, pl.ds(row, block_k), h, pl.ds(static_index(0), bd)], mask)


def load_kv_block(k_ref, v_ref, lines, start, h, *, dtype, **kwargs):
    """The K and V blocks of keys ``start..start+block_k`` (``lines``: :func:`kv_lines`)
    in ``dtype``; ``kwargs`` as :func:`load_kv`'s."""
    line, row = lines(start)
    load = functools.partial(load_kv, line=line, row=row, start=start, h=h, **kwargs)
    return load(k_ref).astype(dtype), load(v_ref).astype(dtype)


def kv_step(
    carry, q, k_ref, v_ref, *, lines, start, h, block_k, head_dim, kv_len, masked, visible, qk_scale
):
    """Loads one KV block (zeros past ``kv_len`` when ``masked``) in ``q``'s dtype and runs
    the online-softmax step on it; ``visible`` is the block's element mask or None."""
    k, v = load_kv_block(
        k_ref,
        v_ref,
        lines,
        start,
        h,
        dtype=q.dtype,
        block_k=block_k,
        head_dim=head_dim,
        kv_len=kv_len,
        masked=masked,
    )
    return softmax_step(carry, q, k, v, visible, qk_scale)


def kv_table(s: AttentionShapes, slot_ids, block_table) -> tuple[jax.Array, jax.Array]:
    """``(slot[R], table[R, W])`` int32 of table rows (sequences or tokens) with slot ids
    ``slot_ids[R]`` and, paged, block table rows ``block_table[R, max_blocks]``: ``slot`` is
    -1 for padding (contiguous: the checked slot; paged: any id >= 0 is live) and
    ``table`` what :func:`kv_lines` reads (contiguous: the slot column)."""
    if block_table is None:
        slot = checked_slots(slot_ids, s.num_slots)
        return slot, slot[:, None]
    slot = jnp.where(slot_ids >= 0, slot_ids, -1).astype(jnp.int32)
    return slot, block_table.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """The query-block kernels' schedule and per-sequence operands (the forward and both
    backward kernels walk the same table): ``prog_seq, prog_row[max_q_blocks]`` from
    ``prefill_table`` ordered by ``prefill_schedule``, and per sequence ``[B]`` int32 its
    last row, position offset, clipped ``kv_len`` and checked slot; ``table[B, W]`` the KV
    addressing (:func:`kv_lines`); ``band`` the visible band operand."""

    max_q_blocks: int
    prog_seq: jax.Array
    prog_row: jax.Array
    seq_end: jax.Array
    seq_offset: jax.Array
    seq_kv_len: jax.Array
    seq_slot: jax.Array
    table: jax.Array
    band: jax.Array

    @classmethod
    def of(
        cls,
        s,
        query_start_loc,
        kv_lens,
        slot_ids,
        block_table=None,
        *,
        block_q: int,
        block_k: int,
        causal,
        sliding_window,
    ) -> PrefillPlan:
        max_q_blocks = pl.cdiv(s.num_tokens, block_q) + s.num_seqs
        prog_seq, prog_row = prefill_table(
            query_start_loc, num_tokens=s.num_tokens, block_q=block_q, max_q_blocks=max_q_blocks
        )
        starts = query_start_loc[:-1]
        q_len = query_start_loc[1:] - starts
        seq_end = jnp.clip(query_start_loc[1:], 0, s.num_tokens).astype(jnp.int32)
        seq_offset = (kv_lens - q_len - starts).astype(jnp.int32)
        seq_kv_len = jnp.clip(kv_lens, 0, s.cache_len).astype(jnp.int32)
        seq_slot, table = kv_table(s, slot_ids, block_table)
        band = band_operand(causal, sliding_window)
        prog_seq, prog_row = prefill_schedule(
            prog_seq,
            prog_row,
            seq_end=seq_end,
            seq_offset=seq_offset,
            seq_kv_len=seq_kv_len,
            seq_slot=seq_slot,
            band=band,
            block_q=block_q,
            block_k=block_k,
        )
        return cls(
            max_q_blocks, prog_seq, prog_row, seq_end, seq_offset, seq_kv_len, seq_slot, table, band
        )
