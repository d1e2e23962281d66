"""Configuration of the Triton attention kernels: what the prefill (``triton.py``), decode
(``triton_decode.py``) and backward (``triton_vjp.py``) kernels and the api all need, so
that no kernel file imports another's.

* :class:`BlockSizes` (prefill and decode tiles) and :func:`default_block_sizes`, its
  heuristic, with the shared-memory estimates it keeps the pipelines within;
  :class:`BackwardBlockSizes` and :func:`default_backward_block_sizes`, the backward's,
  derived from the forward's (:func:`dkv_smem_bytes` its dK/dV program's estimate).
* :class:`AttentionShapes`: the static sizes of one call.
* :func:`supports`, :func:`check_paged_block_sizes`, :func:`check_backward_block_sizes`:
  what a call or a config must satisfy.
"""

from __future__ import annotations

import dataclasses
from typing import Final

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._pallas import MIN_DOT_DIM, block_dim, next_power_of_2
from pallas_kernels._validation import check_int_fields
from pallas_kernels.backend import device_num_sms

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
class AttentionShapes:
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
    ) -> AttentionShapes:
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


def grad_block_sizes(block_sizes: BlockSizes, group: int) -> BlockSizes:
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
    fwd = grad_block_sizes(block_sizes, group)
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
    # Fewer stages, then fewer keys, while the dK/dV program passes the budget (fp32).
    while dkv_smem_bytes(blocks, group=group, head_dim=head_dim, dtype=dtype) > _SMEM_BUDGET_BYTES:
        if blocks.dkv_num_stages > 1:
            blocks = dataclasses.replace(blocks, dkv_num_stages=blocks.dkv_num_stages - 1)
        elif blocks.dkv_block_k > MIN_DOT_DIM:
            blocks = dataclasses.replace(blocks, dkv_block_k=blocks.dkv_block_k // 2)
        else:
            break
    return blocks


def dkv_smem_bytes(blocks: BackwardBlockSizes, *, group: int, head_dim: int, dtype) -> int:
    """Shared memory of a dK/dV program (an estimate): its K and V tiles, ``dkv_num_stages``
    Q and dO tiles, and for 4-byte inputs the P and dS tiles ``[dkv_block_k, rows]`` that
    Triton stages there as the fp32 products' operands. On an H200 an fp32 train step asked
    for 321 KiB at D 64, 128 keys, 128 rows, two stages (192 KiB of tiles plus 2 x 64 KiB;
    2026-12-02); 16-bit operands stay in registers (128 keys, 128 rows, two stages at
    D 128 bf16 run)."""
    itemsize = jnp.dtype(dtype).itemsize
    rows = blocks.dkv_block_q * next_power_of_2(group)
    tiles = (2 * blocks.dkv_block_k + 2 * blocks.dkv_num_stages * rows) * block_dim(
        head_dim, MIN_DOT_DIM
    )
    operands = 2 * blocks.dkv_block_k * rows if itemsize == 4 else 0
    return (tiles + operands) * itemsize


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


def paged_suffix(s: AttentionShapes) -> str:
    """Kernel name suffix of paged calls (profiles tell the layouts apart)."""
    return "" if s.page_size is None else f"_paged{s.page_size}"


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
