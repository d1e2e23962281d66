"""Configuration of the Mosaic GPU attention prefill kernel (``mosaic.py``): its block
sizes, the heuristics that pick them, and what a call or a config must satisfy
(:func:`supports`, :func:`check_block_sizes`)."""

from __future__ import annotations

import dataclasses
from typing import Final

import jax
import jax.numpy as jnp

from pallas_kernels._mosaic import TMA_ROWS
from pallas_kernels._validation import check_int_fields
from pallas_kernels.attention._layout import is_decode_shaped

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
