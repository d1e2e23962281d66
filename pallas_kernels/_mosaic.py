"""Pieces shared by the Mosaic GPU (Hopper: wgmma, TMA) kernels of every op."""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Register split of a block of two consumer warpgroups and one producer (65,536 registers
# / 384 threads): the consumers hold the fp32 accumulators, the producer only issues copies.
CONSUMER_REGISTERS: Final = 232
PRODUCER_REGISTERS: Final = 40
# 128-byte swizzle of 64-element (16-bit) rows: the wgmma operand layout of shared tiles.
SWIZZLE_BYTES: Final = 128
# Rows of a swizzled tile: TMA copies into tiled shared memory start at multiples of it.
TMA_ROWS: Final = 8


def swizzled_tiles(dtype) -> tuple[plgpu.Transform, ...]:
    """Transforms of a shared-memory tile that wgmma reads: 8-row tiles of 128-byte rows,
    128-byte swizzle."""
    width = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((TMA_ROWS, width)), plgpu.SwizzleTransform(SWIZZLE_BYTES))


def produce_ring(load: Callable, num_items, free, *, num_stages: int, done=None) -> None:
    """A producer warpgroup's loop over a ring of ``num_stages`` shared-memory slots:
    ``load(i, slot)`` issues the copies of item ``i`` (of ``num_items``, static or traced)
    into slot ``(done + i) % num_stages``, once the slot's ``free`` barrier says that the
    consumers are done with the item ``num_stages`` before it.

    ``done``: the items this ring already carried in earlier loops (traced; a producer that
    walks several sequences one after another keeps one ring over all of them). Without it
    the ring starts empty, and its first fill is unrolled without waits."""
    if done is None:
        for i in range(num_stages):  # the ring's first fill
            pl.when(i < num_items)(lambda i=i: load(i, i))

        @pl.loop(num_stages, num_items)
        def _steady(i):
            slot = lax.rem(i, num_stages)
            plgpu.barrier_wait(free.at[slot])
            load(i, slot)

        return

    @pl.loop(0, num_items)
    def _item(i):
        slot = lax.rem(done + i, num_stages)
        # The ring's first fill needs no free slot.
        pl.when(done + i >= num_stages)(lambda: plgpu.barrier_wait(free.at[slot]))
        load(i, slot)


def store_rows(tile, out_ref, *, row0, first, live, head, wait: bool = True, columns=None) -> None:
    """TMA-stores rows ``[first, first + live)`` of a staged ``tile[rows, D]`` (committed,
    not tiled) to ``out_ref[row0 + first:, head]`` (its ``columns``, a slice of D' >= D
    columns, if given). TMA boxes are static: the live rows go out as a sum of powers of
    two. ``wait``: wait for the reads of ``tile``; else the copies form one bulk group,
    for the caller to wait on before it rewrites the tile."""
    start = first
    size = tile.shape[0]
    while size >= 1:
        take = (live & size) != 0
        rows = pl.ds(row0 + start, size)
        plgpu.copy_smem_to_gmem(
            tile.at[pl.ds(start, size)],
            out_ref.at[rows, head] if columns is None else out_ref.at[rows, head, columns],
            predicate=take,
            commit_group=wait,
        )
        start = start + jnp.where(take, size, 0)
        size //= 2
    if wait:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    else:
        plgpu.commit_smem_to_gmem_group()


def zero_rows_past_chunks(
    zeros, out_ref, *, total, worker, workers: int, head0, num_heads: int
) -> None:
    """Zeroes the bucket rows ``[total, T)`` of ``out_ref[T, H, D]`` that no chunk owns,
    heads ``[head0, head0 + num_heads)``: 64-row stores from ``zeros`` (a staged, untiled
    ``[64, D]`` tile, filled here) spread over ``workers`` consumers, this one ``worker``
    (a store past T is clipped by the TMA unit)."""
    rows = zeros.shape[0]
    zeros[...] = plgpu.layout_cast(jnp.zeros(zeros.shape, out_ref.dtype), plgpu.Layout.WGMMA)
    plgpu.commit_smem()
    num_pieces = lax.div(out_ref.shape[0] - total + rows - 1, rows)

    @pl.loop(worker, num_pieces, step=workers)
    def _zero(piece):
        for i in range(num_heads):
            plgpu.copy_smem_to_gmem(zeros, out_ref.at[pl.ds(total + piece * rows, rows), head0 + i])

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
