"""Masked-tail attention over a slot-indexed KV cache as Pallas kernels lowered through Triton.

FlashAttention-2 (Dao, arXiv 2307.08691, Algorithm 1, forward pass): a program holds one
tile of queries, streams its KV blocks and keeps the online-softmax statistics in fp32 —
running row max ``m``, row sum ``l`` and unnormalised output ``acc`` — rescaling ``l`` and
``acc`` by ``exp(m_old - m_new)`` when the max grows, and divides once at the end
(section 3.1.1: no per-block rescaling of the output). Logits are scaled by
``sm_scale * log2(e)`` so every exponential is an ``exp2``.

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
2. ``attention_decode`` (grid: KV head × token × KV split), used when the packed batch is
   decode-shaped (``T <= B``, static). Flash-decoding (Dao, Haziza, Massa, Sizov,
   "Flash-Decoding for long-context inference", 2023): each token's visible keys are cut
   into ``split_k``-key splits processed in parallel, each writing a partial
   ``(m, l, acc)``. Splits outside the token's visible range exit without loading
   anything, so the number of working splits follows ``kv_lens`` at run time. Every
   token's sequence and position come from the packed layout: any layout is correct.
3. ``attention_decode_combine`` (grid: KV head × token): merges the token's live splits,
   a few per step (their loads overlap):
   ``out = Σ_s 2^(m_s - M) acc_s / Σ_s 2^(m_s - M) l_s`` with ``M = max_s m_s``.

Gradients (``jax.custom_vjp``): under differentiation the forward is launch 1 with a
``lse[T, Hq]`` output (any layout), and two backward launches, ``attention_bwd_dq`` and
``attention_bwd_dkv``, recompute the probabilities from it (FlashAttention-2,
Algorithm 2; see the backward section).

``write_kv`` (grid: token) copies each token's keys and values to its slot and position,
in place through ``input_output_aliases``.

Paged caches (``block_table[B, max_blocks]``, caches ``[num_blocks, page_size, Hkv, D]``):
every kernel reads KV block ``kb`` of a sequence from page
``block_table[b, kb * block_k // page_size]`` at row ``kb * block_k % page_size``
(:func:`_kv_lines`; ``block_k`` divides the page, so a block never spans two pages, and
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

import dataclasses
import functools
from collections.abc import Callable
from typing import Final

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import checked_slots
from pallas_kernels._pallas import (
    MIN_DOT_DIM,
    block_dim,
    compiler_params,
    dot,
    masked_load,
    next_power_of_2,
    static_index,
)
from pallas_kernels._validation import check_int_fields
from pallas_kernels.attention._layout import (
    backward_scale_operand,
    band_operand,
    is_decode_shaped,
    jit_attention,
    prefill_schedule,
    prefill_table,
    scale_operand,
    token_layout,
)
from pallas_kernels.attention.kv_cache import kv_destination
from pallas_kernels.backend import device_num_sms, pallas_dtypes

# Masked logits get the lowest finite fp32, not -inf: a row with no visible key in a block
# then has max = finfo.min and exp2(logit - max) stays finite, where -inf - (-inf) would be
# NaN. The same mask zeroes those exponentials, so a row that never sees a key ends with
# l = 0 and acc = 0, and the final acc / max(l, tiny) is an exact 0.
_MASK_VALUE: Final = float(jnp.finfo(jnp.float32).min)
_TINY: Final = float(jnp.finfo(jnp.float32).tiny)
# Bytes of one K (or V) tile in shared memory (64 keys at D=128 bf16) and of the Q tile
# (128 rows at D=128 bf16): with three pipeline stages of K and V, Q takes
# 32 + 3 * 2 * 16 = 128 KiB of the 227 KiB an H100/H200 block may use.
_KV_TILE_BYTES: Final = 16 * 1024
_Q_TILE_BYTES: Final = 32 * 1024
# Largest Q tile rows: the fp32 accumulator of 128 rows x 128 dims is 64 registers per
# thread at 8 warps (FlashAttention-2's Triton kernels use BLOCK_M = 128 on Hopper).
_MAX_Q_ROWS: Final = 128
# Shared memory a block may use on Hopper (227 KiB), less room for Triton's scratch
# (reductions, layout conversions): the heuristics keep their pipelines under it.
_SMEM_BUDGET_BYTES: Final = 200 * 1024
# Paged prefill with a long cached context behind the queries (``cache_len`` at least this
# many times the query tokens, as in chunked prefill) takes KV steps of twice the keys
# (:func:`default_block_sizes`); their three stages need 224 KiB at D = 128 bf16, past the
# budget above but inside the 227 KiB (measured to fit, Triton's scratch included, on an
# H200).
_LONG_CONTEXT_RATIO: Final = 4
_WIDE_KV_SMEM_BYTES: Final = 224 * 1024
# Keys per dK/dV program at most (two of the forward's KV blocks at D = 128 bf16).
_DKV_MAX_KEYS: Final = 128
# Keys per dQ loop step at most: the dQ kernel holds Q, dO and three stages of K and V
# (the forward's 128-key steps of long paged contexts would not fit).
_DQ_MAX_KEYS: Final = 64
# Elements of one combine step's [splits, group, head dim] fp32 tile: 8 splits at
# group 4, D = 128, i.e. 32 per thread at 4 warps.
_COMBINE_TILE_ELEMS: Final = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling and launch parameters of the prefill and decode attention kernels.

    Field defaults are the heuristic's choice for D = 128, bf16, 4 query heads per KV head
    on a long cache; :func:`default_block_sizes` picks per problem.
    """

    block_q: int = 32  # query tokens per prefill program (Q tile rows: block_q × padded group)
    block_k: int = 64  # keys per step of the prefill KV loop
    num_warps: int = 8  # warps per prefill program
    num_stages: int = 3  # software-pipelining depth of the prefill KV loop
    split_k: int = 1024  # keys per decode split (flash-decoding)
    decode_block_k: int = 64  # keys per step of a decode split's loop
    decode_num_warps: int = 4  # warps per decode program
    decode_num_stages: int = 3  # software-pipelining depth of a decode split's loop

    def __post_init__(self):
        check_int_fields(self)
        if self.block_q < 1 or self.block_q & (self.block_q - 1):
            raise ValueError(f"block_q={self.block_q} must be a power of two")
        for name in ("block_k", "decode_block_k"):
            value = getattr(self, name)
            if value < MIN_DOT_DIM or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT_DIM}")
        if self.split_k < self.decode_block_k or self.split_k & (self.split_k - 1):
            raise ValueError(
                f"split_k={self.split_k} must be a power of two >= "
                f"decode_block_k={self.decode_block_k}"
            )
        for name in ("num_warps", "num_stages", "decode_num_warps", "decode_num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


@dataclasses.dataclass(frozen=True)
class _AttentionShapes:
    """Static sizes of one call: ``q[T, Hq, D]``, caches ``[S, L, Hkv, D]``, B sequences;
    paged, caches ``[num_blocks, page_size, Hkv, D]`` and ``block_table[B, max_blocks]``."""

    num_tokens: int  # T
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    num_slots: int  # S, or the pool's num_blocks
    cache_len: int  # L, or the longest paged context max_blocks * page_size
    num_seqs: int  # B
    page_size: int | None = None  # keys per page; None: contiguous slots

    @classmethod
    def of(
        cls,
        q: jax.Array,
        k_cache: jax.Array,
        query_start_loc: jax.Array,
        block_table: jax.Array | None = None,
    ) -> _AttentionShapes:
        num_tokens, num_q_heads, head_dim = q.shape
        num_slots, cache_len, num_kv_heads = k_cache.shape[:3]
        page_size = None
        if block_table is not None:
            page_size, cache_len = cache_len, cache_len * block_table.shape[1]
        return cls(
            num_tokens=num_tokens,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            num_slots=num_slots,
            cache_len=cache_len,
            num_seqs=query_start_loc.shape[0] - 1,
            page_size=page_size,
        )

    @property
    def group(self) -> int:  # query heads per KV head
        return self.num_q_heads // self.num_kv_heads

    @property
    def block_group(self) -> int:  # the group padded to a power of two
        return next_power_of_2(self.group)

    @property
    def block_d(self) -> int:  # the head dim padded to a power of two >= 16
        return block_dim(self.head_dim, MIN_DOT_DIM)


# ------------------------------------------------------------------------- shared pieces


def _softmax_init(rows: int, bd: int):
    """The online softmax's state before any key: (running max, denominator, output)."""
    return (
        jnp.full((rows,), _MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, bd), jnp.float32),
    )


def _softmax_step(carry, q, k, v, visible, qk_scale):
    """One KV block of the online softmax (FlashAttention-2, Algorithm 1, lines 8-10).

    ``q[M, bd]``, ``k, v[bk, bd]``, ``visible[M, bk]`` or None (every key visible);
    ``qk_scale = sm_scale * log2(e)``, so ``m`` is in log2 units.
    """
    m, l, acc = carry
    s = dot(q, k, trans_b=True) * qk_scale  # [M, bk]
    if visible is not None:
        s = jnp.where(visible, s, _MASK_VALUE)
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


def _block_ranges(lo, hi, full_lo, full_hi, block_k):
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


def _query_block_ranges(pos_first, pos_last, kv_len, left, right, block_k):
    """:func:`_block_ranges` of a query block whose rows sit at positions
    ``[pos_first, pos_last]`` and see keys ``pos - left < key <= pos + right`` below
    ``kv_len``: keys visible to some row are ``[lo, hi)``, to every row
    ``[full_lo, full_hi)``. The forward and the dq kernels walk the same blocks."""
    hi = jnp.clip(pos_last + right + 1, 0, kv_len)
    full_hi = jnp.clip(pos_first + right + 1, 0, kv_len)
    lo = jnp.maximum(pos_first - left + 1, 0)
    full_lo = jnp.maximum(pos_last - left + 1, 0)
    return _block_ranges(lo, hi, full_lo, full_hi, block_k)


def _kv_loop(kv_block, carry, lo_blk, mid_lo, mid_hi, hi_blk):
    """Masked window-edge blocks, unmasked interior, masked diagonal / kv_len boundary
    blocks (the first loop is empty without a sliding window)."""
    carry = jax.lax.fori_loop(lo_blk, mid_lo, functools.partial(kv_block, masked=True), carry)
    carry = jax.lax.fori_loop(mid_lo, mid_hi, functools.partial(kv_block, masked=False), carry)
    return jax.lax.fori_loop(mid_hi, hi_blk, functools.partial(kv_block, masked=True), carry)


# Paged block tables up to this many entries per row are held in registers by the KV loops
# (:func:`_kv_lines`); wider ones are read entry by entry.
_TABLE_IN_REGISTERS: Final = 256


def _kv_lines(table_ref, r, *, page_size: int | None, num_lines: int):
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


def _load_kv(ref, line, row, start, h, *, block_k, head_dim, kv_len, masked):
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


def _load_kv_block(k_ref, v_ref, lines, start, h, *, dtype, **kwargs):
    """The K and V blocks of keys ``start..start+block_k`` (``lines``: :func:`_kv_lines`)
    in ``dtype``; ``kwargs`` as :func:`_load_kv`'s."""
    line, row = lines(start)
    load = functools.partial(_load_kv, line=line, row=row, start=start, h=h, **kwargs)
    return load(k_ref).astype(dtype), load(v_ref).astype(dtype)


def _kv_step(
    carry, q, k_ref, v_ref, *, lines, start, h, block_k, head_dim, kv_len, masked, visible, qk_scale
):
    """Loads one KV block (zeros past ``kv_len`` when ``masked``) in ``q``'s dtype and runs
    the online-softmax step on it; ``visible`` is the block's element mask or None."""
    k, v = _load_kv_block(
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
    return _softmax_step(carry, q, k, v, visible, qk_scale)


# ------------------------------------------------------------------------------ 1. prefill


def _prefill_kernel(
    prog_seq_ref,  # [max_q_blocks] int32: the program's sequence, -1 for a zeroing program
    prog_row_ref,  # [max_q_blocks] int32: its first packed query row
    seq_end_ref,  # [B] int32: query_start_loc[b + 1] clipped to [0, T]
    seq_offset_ref,  # [B] int32: packed row r of sequence b sits at position r + offset
    seq_kv_len_ref,  # [B] int32: kv_lens clipped to [0, L]
    seq_slot_ref,  # [B] int32: cache slot (paged: >= 0 live), -1 for padding sequences
    table_ref,  # [B, W] int32: the KV addressing of each sequence (see _kv_lines)
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
            bounds = _query_block_ranges(pos_first, pos_last, kv_len, left, right, block_k)
            lines = _kv_lines(table_ref, seq, page_size=page_size, num_lines=k_ref.shape[0])

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
                return _kv_step(
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

            carry = _softmax_init(rows, bd)
            m, l, acc = _kv_loop(kv_block, carry, *bounds)
            out = acc * (1.0 / jnp.maximum(l, _TINY))[:, None]
            # Rows that see no key: finfo.min + log2(tiny), finite (the backward masks them).
            lse = m + jnp.log2(jnp.maximum(l, _TINY))
            store(row0, row_live, out.reshape(block_q, bg, bd), lse.reshape(block_q, bg))


def _kv_table(s: _AttentionShapes, slot_ids, block_table) -> tuple[jax.Array, jax.Array]:
    """``(slot[R], table[R, W])`` int32 of table rows (sequences or tokens) with slot ids
    ``slot_ids[R]`` and, paged, block table rows ``block_table[R, max_blocks]``: ``slot`` is
    -1 for padding (contiguous: the checked slot; paged: any id >= 0 is live) and
    ``table`` what :func:`_kv_lines` reads (contiguous: the slot column)."""
    if block_table is None:
        slot = checked_slots(slot_ids, s.num_slots)
        return slot, slot[:, None]
    slot = jnp.where(slot_ids >= 0, slot_ids, -1).astype(jnp.int32)
    return slot, block_table.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class _PrefillPlan:
    """The query-block kernels' schedule and per-sequence operands (the forward and both
    backward kernels walk the same table): ``prog_seq, prog_row[max_q_blocks]`` from
    ``prefill_table`` ordered by ``prefill_schedule``, and per sequence ``[B]`` int32 its
    last row, position offset, clipped ``kv_len`` and checked slot; ``table[B, W]`` the KV
    addressing (:func:`_kv_lines`); ``band`` the visible band operand."""

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
    ) -> _PrefillPlan:
        max_q_blocks = pl.cdiv(s.num_tokens, block_q) + s.num_seqs
        prog_seq, prog_row = prefill_table(
            query_start_loc, num_tokens=s.num_tokens, block_q=block_q, max_q_blocks=max_q_blocks
        )
        starts = query_start_loc[:-1]
        q_len = query_start_loc[1:] - starts
        seq_end = jnp.clip(query_start_loc[1:], 0, s.num_tokens).astype(jnp.int32)
        seq_offset = (kv_lens - q_len - starts).astype(jnp.int32)
        seq_kv_len = jnp.clip(kv_lens, 0, s.cache_len).astype(jnp.int32)
        seq_slot, table = _kv_table(s, slot_ids, block_table)
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
    s = _AttentionShapes.of(q, k_cache, query_start_loc, block_table)
    b = block_sizes
    if b.block_q * s.block_group < MIN_DOT_DIM:
        raise ValueError(
            f"block_q={b.block_q} times the padded GQA group {s.block_group} must be >= "
            f"{MIN_DOT_DIM} (the smallest Triton dot dimension)"
        )
    check_paged_block_sizes(b, s.page_size)
    plan = _PrefillPlan.of(
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
            f"_g{s.group}_d{s.head_dim}{_paged_suffix(s)}"
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


# ----------------------------------------------------------------------------- backward
#
# FlashAttention-2's backward pass (Dao, arXiv 2307.08691, Algorithm 2), split into two
# launches so that no two programs add into one gradient (no atomics):
#
# * ``attention_bwd_dq`` (grid: KV head × query block, the forward's table): a program
#   holds its Q tile (the group's heads packed as in the forward), ``dO``, the saved
#   log2-sum-exp2 ``lse`` and ``delta = rowsum(dO ∘ O)``, walks exactly the forward's KV
#   blocks and accumulates ``dQ += dS K`` with ``P = 2^(S·log2e − lse)`` recomputed and
#   ``dS = P ∘ (dO Vᵀ − delta)``.
# * ``attention_bwd_dkv`` (grid: KV head × sequence × KV block): a program holds one block
#   of its sequence's keys and values (skipped at or past ``kv_len``: those cache lines get
#   0, as does every line no sequence reads) and walks the query rows that can see it,
#   ``dV += Pᵀ dO``, ``dK += dSᵀ Q``; the GQA group's query heads sit in the same Q tile, so
#   ``dK``, ``dV`` are summed over them inside the product. It computes the transposed
#   scores ``Sᵀ = K Qᵀ`` and ``dPᵀ = V dOᵀ`` directly (FlashAttention-2's Triton kernels do
#   the same): ``Pᵀ`` and ``dSᵀ`` are then the left operands of the two products as they
#   come out of the tensor cores, with no transpose through shared memory. Like the
#   forward's KV loop, the row loop masks only the tiles on the band's edges and the
#   ``kv_len`` block; interior tiles see every key of the block.


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackwardBlockSizes:
    """Tiling and launch parameters of the two backward launches
    (:func:`default_backward_block_sizes` picks them from the forward's)."""

    dq_block_q: int = 32  # query tokens per dQ program (Q tile rows: × padded group)
    dq_block_k: int = 64  # keys per step of its KV loop
    dq_num_warps: int = 8
    dq_num_stages: int = 3
    dkv_block_k: int = 128  # keys per dK/dV program
    dkv_block_q: int = 16  # query tokens per step of its loop over the rows
    dkv_num_warps: int = 8
    dkv_num_stages: int = 3

    def __post_init__(self):
        check_int_fields(self)
        for name in ("dq_block_q", "dkv_block_q"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two")
        for name in ("dq_block_k", "dkv_block_k"):
            value = getattr(self, name)
            if value < MIN_DOT_DIM or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= {MIN_DOT_DIM}")
        for name in ("dq_num_warps", "dq_num_stages", "dkv_num_warps", "dkv_num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


def _grad_block_sizes(block_sizes: BlockSizes, group: int) -> BlockSizes:
    """The prefill tiles, with Q tiles of at least 16 rows (Triton's smallest dot): the
    forward that saves ``lse`` for the backward."""
    block_q = max(block_sizes.block_q, MIN_DOT_DIM // next_power_of_2(group))
    return dataclasses.replace(block_sizes, block_q=block_q)


def default_backward_block_sizes(
    block_sizes: BlockSizes, *, group: int, head_dim: int, dtype, page_size: int | None = None
) -> BackwardBlockSizes:
    """The backward's tiles for a forward tiled ``block_sizes``.

    dQ walks the forward's query blocks with the forward's tiles (at least 16 Q tile rows).
    dK/dV holds ``2 * block_k`` keys (at most 128, and a divisor of the page when paged)
    and steps over the rows with the same Q tiles, two stages deep (one if K, V and two
    stages of Q and dO pass the shared-memory budget). Measured on an H200 (4 × 4096,
    Hq 32, Hkv 8, D 128, bf16; whole backward): 128 keys × 128 rows 5.80 ms, 64 keys ×
    128 rows (the forward's tiles) 11.6 ms, 128 keys with 4 warps 9.3 ms, 3 stages do not
    fit. Q tiles of 32 or 64 rows at 8 warps (FlashAttention-2's Triton tiles) gave wrong
    dK on the GPU (right in interpret mode and at 4 warps), so they are not used.
    """
    fwd = _grad_block_sizes(block_sizes, group)
    dkv_block_k = min(2 * fwd.block_k, _DKV_MAX_KEYS)
    if page_size is not None:
        dkv_block_k = min(dkv_block_k, page_size & -page_size)
    blocks = BackwardBlockSizes(
        dq_block_q=fwd.block_q,
        dq_block_k=min(fwd.block_k, _DQ_MAX_KEYS),
        dq_num_warps=fwd.num_warps,
        dq_num_stages=fwd.num_stages,
        dkv_block_k=dkv_block_k,
        dkv_block_q=fwd.block_q,
        dkv_num_warps=fwd.num_warps,
        dkv_num_stages=2,
    )
    rows = fwd.block_q * next_power_of_2(group)
    smem = (2 * dkv_block_k + 2 * 2 * rows) * block_dim(head_dim, MIN_DOT_DIM)
    if smem * jnp.dtype(dtype).itemsize > _SMEM_BUDGET_BYTES:
        blocks = dataclasses.replace(blocks, dkv_num_stages=1)
    return blocks


def check_backward_block_sizes(b: BackwardBlockSizes, *, group: int, page_size: int | None) -> None:
    """Q tiles of at least ``MIN_DOT_DIM`` rows; paged, KV blocks that divide the page."""
    bg = next_power_of_2(group)
    for name in ("dq_block_q", "dkv_block_q"):
        if getattr(b, name) * bg < MIN_DOT_DIM:
            raise ValueError(
                f"{name}={getattr(b, name)} times the padded GQA group {bg} must be >= "
                f"{MIN_DOT_DIM} (the smallest Triton dot dimension)"
            )
    if page_size is not None:
        for name in ("dq_block_k", "dkv_block_k"):
            if page_size % getattr(b, name):
                raise ValueError(
                    f"{name}={getattr(b, name)} must divide the paged cache's "
                    f"block_size={page_size}"
                )


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
            bounds = _query_block_ranges(pos_first, pos_last, kv_len, left, right, block_k)
            lines = _kv_lines(table_ref, seq, page_size=page_size, num_lines=k_ref.shape[0])
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
                k, v = _load_kv_block(
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

            dq = _kv_loop(kv_block, jnp.zeros((rows, bd), jnp.float32), *bounds)
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
        lines = _kv_lines(table_ref, b, page_size=page_size, num_lines=k_ref.shape[0])
        k, v = _load_kv_block(
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
        bounds = _block_ranges(0, row_hi - row_lo, full_lo - row_lo, full_hi - row_lo, block_q)
        dk, dv = _kv_loop(q_block, (zeros, zeros), *bounds)
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
    s = _AttentionShapes.of(q, k_cache, query_start_loc, block_table)
    b = block_sizes
    check_backward_block_sizes(b, group=s.group, page_size=s.page_size)
    with pallas_dtypes():
        plan = _PrefillPlan.of(
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
        shape = f"g{s.group}_d{s.head_dim}{_paged_suffix(s)}"
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


def _lines_to_pages(grad: jax.Array, s: _AttentionShapes, plan: _PrefillPlan) -> jax.Array:
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
                block_sizes=_grad_block_sizes(block_sizes, group),
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


# ------------------------------------------------------------------------------- 2. decode


def _decode_kernel(
    tok_slot_ref,  # [T] int32: the token's cache slot (paged: >= 0), -1 for dead tokens
    tok_lo_ref,  # [T] int32: first visible key
    tok_hi_ref,  # [T] int32: one past the last visible key
    tok_table_ref,  # [T, W] int32: the KV addressing of the token's sequence (_kv_lines)
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
        lines = _kv_lines(tok_table_ref, t, page_size=page_size, num_lines=k_ref.shape[0])

        def kv_block(j, carry, *, masked):
            start = j * block_k
            visible = None
            if masked:
                keys = start + jnp.arange(block_k)
                visible = jnp.broadcast_to(((keys >= k0) & (keys < k1))[None, :], (rows, block_k))
            return _kv_step(
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

        carry = _softmax_init(rows, bd)
        # One row: keys [k0, k1) are visible to all of it; only the end blocks are masked.
        bounds = _block_ranges(k0, k1, k0, k1, block_k)
        m, l, acc = _kv_loop(kv_block, carry, *bounds)
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
            other=_MASK_VALUE,
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

    carry = _softmax_init(bg, bd)
    _, l, acc = jax.lax.fori_loop(0, pl.cdiv(last - first, block_splits), merge, carry)
    out = acc * (1.0 / jnp.maximum(l, _TINY))[:, None]
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
    s = _AttentionShapes.of(q, k_cache, query_start_loc, block_table)
    b = block_sizes
    check_paged_block_sizes(b, s.page_size)
    split_k = min(b.split_k, max(block_dim(s.cache_len), b.decode_block_k))
    num_splits = pl.cdiv(s.cache_len, split_k)
    layout = token_layout(s.num_tokens, query_start_loc, kv_lens, slot_ids)
    kv_len = jnp.clip(layout.kv_len, 0, s.cache_len)
    left, right = band_operand(causal, sliding_window)
    hi = jnp.clip(layout.position + right + 1, 0, kv_len)
    lo = jnp.maximum(layout.position - left + 1, 0)
    tok_slot, tok_table = _kv_table(
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
            f"_s{b.decode_num_stages}_g{s.group}_d{s.head_dim}{_paged_suffix(s)}"
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


# ---------------------------------------------------------------------------- dispatch


def supports(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, *, block_table=None, **_
) -> str | None:
    """Why these kernels cannot take the call (None: they can): a paged cache's page must
    hold a whole number of the smallest KV blocks (16 keys)."""
    del q, v_cache
    if block_table is not None and k_cache.shape[1] % MIN_DOT_DIM:
        return (
            f"block_size={k_cache.shape[1]} is not a multiple of {MIN_DOT_DIM}: a KV block "
            "of the Triton kernels must lie in one page"
        )
    return None


def check_paged_block_sizes(block_sizes: BlockSizes, page_size: int | None) -> None:
    """Paged caches: every KV block (``block_k``, ``decode_block_k``) lies in one page, so
    both must divide ``page_size``."""
    if page_size is None:
        return
    for name in ("block_k", "decode_block_k"):
        value = getattr(block_sizes, name)
        if page_size % value:
            raise ValueError(
                f"config.{name}={value} must divide the paged cache's block_size={page_size}"
            )


def _paged_suffix(s: _AttentionShapes) -> str:
    """Kernel name suffix of paged calls (profiles tell the layouts apart)."""
    return "" if s.page_size is None else f"_paged{s.page_size}"


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
    s = _AttentionShapes.of(q, k_cache, query_start_loc)
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


# ---------------------------------------------------------------------------- heuristics


def prefill_smem_bytes(block_sizes: BlockSizes, *, group: int, head_dim: int, dtype) -> int:
    """Shared memory of the prefill kernel's tiles: the Q tile plus ``num_stages`` K and V
    tiles (an estimate: Triton adds scratch for reductions and layout conversions)."""
    b, bd = block_sizes, block_dim(head_dim, MIN_DOT_DIM)
    rows = b.block_q * next_power_of_2(group)
    return (rows + 2 * b.num_stages * b.block_k) * bd * jnp.dtype(dtype).itemsize


def decode_smem_bytes(block_sizes: BlockSizes, *, head_dim: int, dtype) -> int:
    """Shared memory of a decode program's ``decode_num_stages`` K and V tiles (estimate)."""
    b, bd = block_sizes, block_dim(head_dim, MIN_DOT_DIM)
    return 2 * b.decode_num_stages * b.decode_block_k * bd * jnp.dtype(dtype).itemsize


def default_block_sizes(
    *,
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cache_len: int,
    dtype,
    num_sms: int | None = None,
    page_size: int | None = None,
) -> BlockSizes:
    """Heuristic tiling from the shapes, dtype and device (``cache_len``: paged, the
    longest context ``max_blocks * page_size``).

    Prefill (FlashAttention-2 style tiles; the Triton FlashAttention kernels on Hopper use
    BLOCK_M = 128, BLOCK_N = 64, 8 warps, 3 stages at D = 128):
      * K/V tiles of at most 16 KiB, at most 64 keys (64 at D<=128 bf16, 32 at D=256 or
        fp32 D=128).
      * Q tiles of at most 32 KiB, at most 128 rows (128 at D<=128 bf16, 64 at D=256 or
        fp32): the fp32 accumulator then takes <= 64 registers per thread at 8 warps.
      * ``block_q`` = Q rows / padded GQA group, never below 16 / group (Triton's smallest
        dot) and never above T. Not lowered for short sequences: a block holding one
        decode row costs the same KV loads as a full one, and the tensor cores have time
        to spare while those loads stream.
      * 8 warps once the accumulator passes 8K fp32 elements, else 4.
      * Three pipeline stages (two KV blocks in flight while one is computed on): Q plus
        three K and V tiles is 128 KiB at D=128 bf16; fewer if that passed the budget.
    Decode (flash-decoding; memory-bound, so the aim is bytes in flight per SM):
      * K/V tiles of at most 16 KiB per loop step (64 keys at D=128 bf16) with three
        stages: 96 KiB per program, so two programs share an SM and one's prologue and
        epilogue overlap the other's loads.
      * ``split_k``: the largest power of two <= 1024 keys that still gives one program
        per SM when every cache line is full, and never below the loop step. More splits
        load in parallel but cost the combine, which merges a token's splits in sequence
        per KV head: one row of Bamba-9B (8 KV heads, pages of 256, 4k keys) on an H200
        took 18.7 / 11.8 / 10.0 / 12.1 / 18.8 µs with 64 / 128 / 256 / 512 / 1024 keys
        per split (136 programs at 256; four per SM asked for 64).
    Paged (``page_size``): the KV blocks are at most the largest power of two dividing the
    page, so none spans two pages. Where the cached context is long behind the queries
    (``cache_len >= 4 * num_tokens``: chunked prefill, most KV blocks of every query block
    unmasked), prefill steps take twice the keys (128 at D=128 bf16, three stages in
    224 KiB) when the page holds them: each step finds its page id before its loads, and
    larger steps halve that cost per key. On an H200 (``benchmarks/attention.py``,
    chunked-prefill: 8 × 512 queries on 8k-32k keys, pages of 256) the paged kernel took
    1.07× the contiguous one's time with 64-key steps and 0.99× with 128; on dense causal
    and ragged-tail (``cache_len < num_tokens``) 128-key steps cost 6-8% and 64 stay.
    """
    itemsize = jnp.dtype(dtype).itemsize
    bd = block_dim(head_dim, MIN_DOT_DIM)
    group = num_q_heads // num_kv_heads
    bg = next_power_of_2(group)
    bl = block_dim(cache_len, MIN_DOT_DIM)

    block_k = min(max(_KV_TILE_BYTES // (bd * itemsize), MIN_DOT_DIM), 64, bl)
    q_rows = min(max(_Q_TILE_BYTES // (bd * itemsize), MIN_DOT_DIM), _MAX_Q_ROWS)
    min_block_q = max(1, MIN_DOT_DIM // bg)
    block_q = max(min(q_rows // bg, block_dim(num_tokens)), min_block_q)
    num_warps = 8 if block_q * bg * bd > 8192 else 4

    decode_block_k = min(max(_KV_TILE_BYTES // (bd * itemsize), MIN_DOT_DIM), 64, bl)
    if page_size is not None:
        page_block = page_size & -page_size  # largest power-of-two divisor
        block_k, decode_block_k = min(block_k, page_block), min(decode_block_k, page_block)
    target_programs = num_sms or device_num_sms()
    split_k = max(min(1024, bl), decode_block_k)
    while (
        split_k > decode_block_k
        and num_tokens * num_kv_heads * pl.cdiv(cache_len, split_k) < target_programs
    ):
        split_k //= 2
    blocks = BlockSizes(
        block_q=block_q,
        block_k=block_k,
        num_warps=num_warps,
        num_stages=3,
        split_k=split_k,
        decode_block_k=decode_block_k,
        decode_num_warps=4,
        decode_num_stages=3,
    )
    budget = _SMEM_BUDGET_BYTES
    # (16-bit inputs at D <= 128 only: the measured tiles; wider or fp32 tiles keep theirs.)
    long_context = cache_len >= _LONG_CONTEXT_RATIO * num_tokens
    if page_size is not None and long_context and itemsize == 2 and bd <= 128:
        wide = dataclasses.replace(blocks, block_k=min(2 * block_k, page_block, bl))
        smem = prefill_smem_bytes(wide, group=group, head_dim=head_dim, dtype=dtype)
        if smem <= _WIDE_KV_SMEM_BYTES:
            blocks, budget = wide, _WIDE_KV_SMEM_BYTES
    # Fewer stages where the tiles (large head dims, fp32) would pass the budget.
    while (
        blocks.num_stages > 1
        and prefill_smem_bytes(blocks, group=group, head_dim=head_dim, dtype=dtype) > budget
    ):
        blocks = dataclasses.replace(blocks, num_stages=blocks.num_stages - 1)
    while (
        blocks.decode_num_stages > 1
        and decode_smem_bytes(blocks, head_dim=head_dim, dtype=dtype) > _SMEM_BUDGET_BYTES
    ):
        blocks = dataclasses.replace(blocks, decode_num_stages=blocks.decode_num_stages - 1)
    return blocks
