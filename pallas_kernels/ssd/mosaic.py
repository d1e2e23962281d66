"""The SSD scan's two stages as Pallas Mosaic GPU kernels (Hopper: wgmma, TMA).

The stages of ``triton.py`` (its module docstring) on the tensor cores, over the same
chunk-aligned varlen layout; both follow FlashAttention-3's thread block (Shah et al.,
arXiv 2407.08608): a producer warpgroup TMA-copies tiles into a ring of shared-memory
slots, two consumer warpgroups run wgmma on them with fp32 accumulators in registers.

**State scan** (:func:`state_scan`). dt', the within-chunk cumulative decay ``cum`` (what
the Triton state scan writes) and the decay weights come from one small Triton launch
(``triton.chunk_decay``, a program per chunk and 16 heads). One thread block per (two heads
of a group, sequence), longest sequences first, walks the sequence's chunks in 128-row steps
(none past a chunk's end); short sequences share a block, walked back to back through one
ring (:func:`state_scan_groups`; on an H200 a block's setup and its ring's first fill
cost about 4 µs, two steps' time). A ring slot holds the step's B rows (read once for both heads)
and each head's x rows; consumer k keeps head ``h0 + k``'s state ``s[P, N]`` in registers,
stores it (in C's dtype) as the state entering each chunk (but a sequence's first without
initial states: that one is zero, and the chunk scan reads none), and per chunk computes ``s ←
exp(cum_end) s + (x ∘ w)ᵀ B`` with ``w_j = exp(cum_end − cum_j) dt'_j`` (x weighted in
shared memory, then one wgmma per 64 state columns). Final states only; intermediate states
and N = 256 use the Triton state scan (:func:`state_scan_supports`).

**Chunk scan** (:func:`chunk_scan`). For each chunk ``c`` and head ``h``,

    y_i = exp(cum_i) C_i · s_c  +  Σ_{j ≤ i} (C_i · B_j) exp(cum_i − cum_j) dt'_j x_j

then the D skip and the z gate. One thread block per (chunk, 128 of its rows, block of
heads of one B/C group): the producer copies the block's C rows and the chunk's B once,
then per head x, the carried state, dt', cum (and D); consumer k owns the row block
``2 × half + k``. Each consumer first computes its rows of ``C Bᵀ`` (causal and in-chunk
entries only, the rest selected to 0) into shared memory, once for all heads of the
block (the group's ``C Bᵀ`` is shared by its heads: neither recomputed per head nor read
from memory); then per head ``C·sᵀ`` and ``W x`` (``W = C Bᵀ ∘ exp(cum_i − cum_j) dt'_j``
built in registers, the wgmma A operand) accumulate in fp32; below the diagonal block the
decay factors through the row block's first row, an exponential per column instead of
per entry. Keeping ``C Bᵀ`` in shared memory, not registers, is what keeps the consumers
from spilling.

Chunks start at any packed row. TMA into tiled shared memory needs tile-aligned rows, so
the producers copy C, B and x through swizzle-only views (``plgpu.RefUnion``) of the
tiles that wgmma reads (a tile of 64 16-bit columns is laid out identically either way),
and full 64-row outputs leave the same way. A short chunk's tiles hold the next rows of
the packed batch (another sequence, or bucket rows, NaN in tests): weights and ``C Bᵀ``
are selected to 0 past the chunk and the consumers zero those B or x rows in shared
memory (``0 × NaN`` would be NaN), so nothing past a chunk reaches its outputs; a
chunk's last rows go out through the TMA store ladder, exactly its rows. Padding chunks
exit at once; a few extra blocks zero the bucket rows no chunk owns.

Covers bf16/fp16 x, B, C (one dtype), head dim 64, state dims 64/128/256 and chunk sizes
128/256 within the shared-memory budget, batches of at least one chunk (``mosaic_config.supports``);
the rest run on Triton.

**Under differentiation** (:func:`chunk_scan_with_ssm`) the same two stages write the
residuals of the backward (``ssd/triton_vjp.py``'s reverse state pass and glue, with
``ssd/mosaic_vjp.py``'s chunk kernels where they fit): the state scan stores
every chunk's carried state (in C's dtype, what the chunk scan consumed), and a second
chunk-scan pass without D and z writes ``y_ssm`` in fp32 through one unswizzled fp32 tile
per consumer (``ssm_out``: the bytes of the two 16-bit output tiles). Only C·Bᵀ (2 GFLOP)
comes from the Triton ``chunk_cb``, and only where the Triton ``chunk_dx`` reads it (the
Mosaic one forms its own).
"""

from __future__ import annotations

import functools
from typing import Final

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import decay_factor, silu, silu_grad
from pallas_kernels._mosaic import (
    CONSUMER_REGISTERS,
    PRODUCER_REGISTERS,
    SWIZZLE_BYTES,
    produce_ring,
    store_rows,
    swizzled_tiles,
    zero_rows_past_chunks,
)
from pallas_kernels.ssd import mosaic_vjp, triton, triton_config
from pallas_kernels.ssd.mosaic_config import (
    BLOCK_ROWS,
    CONSUMERS,
    HEAD_DIM,
    ROWS,
    BlockSizes,
    backward_supports,
    cb_blocks,
    check_block_sizes,
    chunk_dbc_supports,
    default_heads_per_block,
)
from pallas_kernels.ssd.mosaic_state_scan import state_scan, state_scan_supports

_COLUMNS: Final = 64  # 16-bit columns of a swizzled tile (128 bytes)
# Blocks past the chunks that zero the bucket rows no chunk owns.
_TAIL_BLOCKS: Final = 2


def _kernel(
    *refs,
    has_D: bool,
    has_z: bool,
    first_states_zero: bool,
    row_terms: bool,
    heads_per_group: int,
    heads_per_block: int,
    num_stages: int,
):
    cu_ref, seq_ref, x_ref, C_ref, B_ref, dt_ref, cum_ref, carried_ref, *rest = refs
    D_ref = rest.pop(0) if has_D else None
    z_ref = rest.pop(0) if has_z else None
    if row_terms:  # the backward's rows (:func:`row_terms`): dy in; dz, dy · y_ssm, dD out
        dy_ref = rest.pop(0)
        dz_ref = rest.pop(0) if has_z else None
        dy_y_ref = rest.pop(0)
        dD_ref = rest.pop(0) if has_D else None
        y_ref = dz_ref  # the [T, H, P] output, whose bucket rows the tail blocks zero
    else:
        (y_ref,) = rest
    chunk_size = dt_ref.shape[2]
    state_tiles = C_ref.shape[2] // _COLUMNS
    max_chunks = cu_ref.shape[0] - 1
    num_halves = chunk_size // BLOCK_ROWS
    dtype, f32 = x_ref.dtype, jnp.float32
    wgmma_layout = plgpu.Layout.WGMMA
    row_vector, column_vector = wgmma_layout.reduce(1), wgmma_layout.reduce(0)
    block_shape = (ROWS, _COLUMNS)

    def iota(dim):
        return plgpu.broadcasted_iota(jnp.int32, block_shape, dim, layout=wgmma_layout)

    def body(
        c_views,
        ring_views,
        cb_smem,
        dt_smem,
        cum_smem,
        d_smem,
        out_views,
        c_full,
        b_full,
        cb_done,
        x_full,
        s_full,
        dt_full,
        cum_full,
        d_full,
        zeroed,
        free,
        z_full,
        vec_smem,
        dy_full,
    ):
        c_tiles, c_flat = c_views
        out_tiles, out_flat, out_rows = out_views
        b_tiles, b_flat, (x_tiles, s_tiles), x_flat = ring_views
        chunk = lax.axis_index("chunk")
        half = lax.axis_index("half")
        h0 = lax.axis_index("heads") * heads_per_block
        group = lax.div(h0, heads_per_group)
        wg = lax.axis_index("wg")
        is_chunk = chunk < max_chunks
        c = jnp.minimum(chunk, max_chunks - 1)
        start = cu_ref[c]
        length = jnp.where(is_chunk, cu_ref[c + 1] - start, 0)
        # The block's rows [row_lo, row_lo + 128) of the chunk: consumer k's row block is
        # 2 * half + k, which sees the chunk's column blocks [0, 2 * half + k].
        row_lo = half * BLOCK_ROWS
        works = length > row_lo
        chunk_rows = pl.ds(start, chunk_size)
        # A sequence's first chunk starts from a zero state when no initial states are
        # given; the state scan then writes no carried state for it, and nothing reads one.
        state_is_zero = None
        if first_states_zero:
            state_is_zero = (c == 0) | (seq_ref[c] != seq_ref[jnp.maximum(c - 1, 0)])

        def unless_state_is_zero(fn):
            if state_is_zero is None:
                fn()
            else:
                pl.when(~state_is_zero)(fn)

        @pl.when((wg == CONSUMERS) & works)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            for t in range(state_tiles):
                columns = pl.ds(t * _COLUMNS, _COLUMNS)
                block_rows = pl.ds(start + row_lo, BLOCK_ROWS)
                plgpu.copy_gmem_to_smem(
                    C_ref.at[block_rows, group, columns], c_flat.at[t], c_full.at[t]
                )
                plgpu.copy_gmem_to_smem(
                    B_ref.at[chunk_rows, group, columns], b_flat.at[t], b_full.at[t]
                )
            # The ring reuses B's shared memory: it fills once C·Bᵀ is computed.
            plgpu.barrier_wait(cb_done)

            def load(i, slot):
                h = h0 + i
                plgpu.copy_gmem_to_smem(x_ref.at[chunk_rows, h], x_flat.at[slot], x_full.at[slot])
                unless_state_is_zero(
                    lambda: plgpu.copy_gmem_to_smem(
                        carried_ref.at[c, h], s_tiles.at[slot], s_full.at[slot]
                    )
                )
                plgpu.copy_gmem_to_smem(dt_ref.at[h, c], dt_smem.at[slot], dt_full.at[slot])
                plgpu.copy_gmem_to_smem(cum_ref.at[h, c], cum_smem.at[slot], cum_full.at[slot])
                if has_D:
                    plgpu.copy_gmem_to_smem(D_ref.at[h], d_smem.at[slot], d_full.at[slot])

            produce_ring(load, heads_per_block, free, num_stages=num_stages)

        @pl.when((wg < CONSUMERS) & works)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            k = wg
            b = 2 * half + k  # the consumer's row block of the chunk
            rows_b = pl.ds(k * ROWS, ROWS)  # of the block's C tile
            cb_first = k * (2 * half + 1)  # consumer 1's C·Bᵀ blocks follow consumer 0's
            live = jnp.clip(length - b * ROWS, 0, ROWS)
            for t in range(state_tiles):
                plgpu.barrier_wait(c_full.at[t])
                plgpu.barrier_wait(b_full.at[t])

            # The row block's C·Bᵀ, causal and in-chunk entries only (the rest selected
            # to 0: past the chunk B holds other rows), kept for every head.
            @pl.loop(0, b + 1)
            def _cb(jb):
                def product(acc_ref):
                    for t in range(state_tiles):
                        plgpu.wgmma(
                            acc_ref,
                            c_tiles.at[t, rows_b],
                            b_tiles.at[t, pl.ds(jb * ROWS, ROWS)].T,
                        )
                    return acc_ref[...]

                value = pl.run_scoped(product, plgpu.ACC(block_shape, f32))
                column = jb * ROWS + iota(1)
                keep = (column < length) & (b * ROWS + iota(0) >= column)
                cb_smem.at[cb_first + jb][...] = jnp.where(keep, value, 0.0).astype(dtype)

            plgpu.commit_smem()
            plgpu.barrier_arrive(cb_done)

            def store_output(y, row0, out_slot, h, before=lambda: None):
                """y's live rows to ``y_ref``, through output tile ``out_slot``, in one
                bulk group with the copies ``before`` issues (after the commit)."""

                @pl.when(live == ROWS)
                def _whole_block():  # one swizzled 64-row store, at any row
                    out_tiles.at[k, out_slot][...] = y
                    plgpu.commit_smem()
                    before()
                    plgpu.copy_smem_to_gmem(
                        out_flat.at[k, out_slot], y_ref.at[pl.ds(row0, ROWS), h]
                    )

                @pl.when(live < ROWS)
                def _chunk_end():  # the chunk's last rows, through the store ladder
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    tile = out_rows.at[k, out_slot]
                    tile[...] = y
                    plgpu.commit_smem()
                    before()
                    store_rows(tile, y_ref, row0=row0, first=0, live=live, head=h, wait=False)

            def store_row_terms(acc, x_i, row0, slot, h):
                """The backward's rows from ``acc`` (y_ssm, fp32), with ``dyg = dy ·
                silu(z)``: ``dy_y = dyg · y_ssm`` per row, D's partial ``Σ_rows dyg ∘ x``
                and ``dz = dy · (y_ssm + D x) · silu'(z)``. dy sits in output tile 1, z
                in tile 0, which dz leaves by."""
                dy_tile = out_tiles.at[k, 1]
                plgpu.barrier_wait(dy_full.at[k])
                dy = plgpu.load(dy_tile, layout=wgmma_layout).astype(f32)
                dyg = dy
                if has_z:
                    plgpu.barrier_wait(z_full.at[k])
                    gate = plgpu.load(out_tiles.at[k, 0], layout=wgmma_layout).astype(f32)
                    dyg = dy * silu(gate)
                # Rows past the chunk hold other rows' dy (NaN in tests): selected away.
                keep = iota(0) < live
                dyg = jnp.where(keep, dyg, 0.0)
                vectors = vec_smem.at[k]
                vectors.at[0][...] = jnp.sum(dyg * acc, axis=1)
                rows = pl.ds(b * ROWS, ROWS)
                if has_D:
                    # Σ_rows dyg ∘ x is the diagonal of xᵀ dyg (a sum over rows, which
                    # would cross the warps in registers): wgmma from shared memory, dyg
                    # in dy's place. With the gate dyg is no 16-bit value: its rounding
                    # remainder follows in z's place (fp32 partials; dyg alone in 16 bits
                    # cost dD a 1e-3 relative error at T 4096).
                    hi = dyg.astype(dtype)
                    dy_tile[...] = hi
                    if has_z:
                        out_tiles.at[k, 0][...] = (dyg - hi.astype(f32)).astype(dtype)
                    plgpu.commit_smem()
                    xt = x_tiles.at[slot, rows].T

                    def d_partial(acc_ref):
                        plgpu.wgmma(acc_ref, xt, dy_tile)
                        if has_z:
                            plgpu.wgmma(acc_ref, xt, out_tiles.at[k, 0])
                        return acc_ref[...]

                    xt_dyg = pl.run_scoped(d_partial, plgpu.ACC(block_shape, f32))
                    diagonal = iota(0) == iota(1)
                    vectors.at[1][...] = jnp.sum(jnp.where(diagonal, xt_dyg, 0.0), axis=1)

                def vectors_out():  # in one bulk group with dz's store
                    plgpu.copy_smem_to_gmem(
                        vectors.at[0], dy_y_ref.at[h, c, rows], commit_group=False
                    )
                    if has_D:
                        plgpu.copy_smem_to_gmem(
                            vectors.at[1], dD_ref.at[b, c, h], commit_group=False
                        )

                if not has_z:
                    plgpu.commit_smem()
                    vectors_out()
                    plgpu.commit_smem_to_gmem_group()
                    return
                if has_D:
                    d = plgpu.load(d_smem.at[slot], layout=column_vector)
                    acc = acc + x_i * lax.broadcast_in_dim(d, block_shape, [1])
                dz = dy * acc * silu_grad(gate)
                store_output(dz.astype(dtype), row0, 0, h, before=vectors_out)

            def head(i, carry):
                slot = lax.rem(i, num_stages)
                h = h0 + i
                x_tile = x_tiles.at[slot]
                plgpu.barrier_wait(x_full.at[slot])

                @pl.when(length < chunk_size)
                def _zero_past_chunk():
                    # x rows past the chunk that this block reads (column blocks up to
                    # 2 * half + 1, split between the consumers): W is 0 there, but
                    # 0 × NaN is not.
                    for jb in range(chunk_size // ROWS):

                        @pl.when((jb % 2 == k) & (jb <= 2 * half + 1))
                        def _zero(jb=jb):
                            tile = x_tile.at[pl.ds(jb * ROWS, ROWS)]
                            v = plgpu.load(tile, layout=wgmma_layout)
                            keep = jb * ROWS + iota(0) < length
                            tile[...] = jnp.where(keep, v, jnp.zeros_like(v))

                    plgpu.commit_smem()
                    plgpu.barrier_arrive(zeroed.at[slot])
                    plgpu.barrier_wait(zeroed.at[slot])

                unless_state_is_zero(lambda: plgpu.barrier_wait(s_full.at[slot]))
                plgpu.barrier_wait(dt_full.at[slot])
                plgpu.barrier_wait(cum_full.at[slot])
                if has_D:
                    plgpu.barrier_wait(d_full.at[slot])
                # Output tiles alternate, one bulk store group per head: a tile is
                # rewritten once the store from it two heads ago has read it.
                out_slot = lax.rem(i, 2)

                @pl.when(live <= 0)
                def _no_rows():
                    plgpu.commit_smem_to_gmem_group()  # an empty group keeps the count

                @pl.when(live > 0)
                def _row_block():
                    row0 = start + b * ROWS
                    rows_in = pl.ds(row0, ROWS)
                    if row_terms:
                        # z into tile 0, dy into tile 1 (both land while the products
                        # run), once the last head's dz and dy_y stores have read them.
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        if has_z:
                            plgpu.copy_gmem_to_smem(
                                z_ref.at[rows_in, h], out_flat.at[k, 0], z_full.at[k]
                            )
                        plgpu.copy_gmem_to_smem(
                            dy_ref.at[rows_in, h], out_flat.at[k, 1], dy_full.at[k]
                        )
                    else:
                        out_tile = out_tiles.at[k, out_slot]
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                        if has_z:  # into the output tile; lands while the products run
                            plgpu.copy_gmem_to_smem(
                                z_ref.at[rows_in, h], out_flat.at[k, out_slot], z_full.at[k]
                            )
                    cum_i = plgpu.load(cum_smem.at[slot, pl.ds(b * ROWS, ROWS)], layout=row_vector)

                    def from_state(acc_ref):
                        for t in range(state_tiles):
                            state_t = s_tiles.at[slot, :, pl.ds(t * _COLUMNS, _COLUMNS)]
                            plgpu.wgmma(acc_ref, c_tiles.at[t, rows_b], state_t.T)
                        return acc_ref[...]

                    # Below the diagonal block the decay factors through the row block's
                    # first row r (cum falls along the chunk: cum_i <= cum_r <= cum_j):
                    # exp(cum_i - cum_j) = exp(cum_i - cum_r) exp(cum_r - cum_j), both <= 1,
                    # so those blocks take an exponential per column, not per entry, and
                    # the row factor scales the sum once (with the carried state's term,
                    # exp(cum_i) = exp(cum_i - cum_r) exp(cum_r)).
                    cum_r = cum_smem[slot, b * ROWS]

                    def state_term():
                        acc = pl.run_scoped(from_state, plgpu.ACC(block_shape, f32))
                        return acc * decay_factor(cum_r)

                    def no_state():
                        return plgpu.layout_cast(jnp.zeros(block_shape, f32), wgmma_layout)

                    if state_is_zero is not None:
                        acc = lax.cond(state_is_zero, no_state, state_term)
                    else:
                        acc = state_term()

                    def column_block(jb, acc, *, diagonal):
                        columns = pl.ds(jb * ROWS, ROWS)
                        cum_j = plgpu.load(cum_smem.at[slot, columns], layout=column_vector)
                        dt_j = plgpu.load(dt_smem.at[slot, columns], layout=column_vector)
                        cb = plgpu.load(cb_smem.at[cb_first + jb], layout=wgmma_layout).astype(f32)
                        if diagonal:
                            decay = decay_factor(
                                lax.broadcast_in_dim(cum_i, block_shape, [0])
                                - lax.broadcast_in_dim(cum_j, block_shape, [1])
                            )
                            w = cb * decay * lax.broadcast_in_dim(dt_j, block_shape, [1])
                        else:
                            weight_j = decay_factor(cum_r - cum_j) * dt_j
                            w = cb * lax.broadcast_in_dim(weight_j, block_shape, [1])

                        def product(acc_ref):
                            plgpu.wgmma(acc_ref, w.astype(dtype), x_tile.at[columns])

                        return pl.run_state(product)(plgpu.ACC.init(acc))

                    acc = lax.fori_loop(0, b, functools.partial(column_block, diagonal=False), acc)
                    row_decay = decay_factor(cum_i - cum_r)
                    acc = acc * lax.broadcast_in_dim(row_decay, block_shape, [0])
                    acc = column_block(b, acc, diagonal=True)
                    x_i = None
                    if has_D and (has_z or not row_terms):  # (the rows' dz only)
                        x_i = plgpu.load(x_tile.at[pl.ds(b * ROWS, ROWS)], layout=wgmma_layout)
                        x_i = x_i.astype(f32)
                    if row_terms:
                        store_row_terms(acc, x_i, row0, slot, h)
                    else:
                        if has_D:
                            d = plgpu.load(d_smem.at[slot], layout=column_vector)
                            acc = acc + x_i * lax.broadcast_in_dim(d, block_shape, [1])
                        if has_z:
                            plgpu.barrier_wait(z_full.at[k])
                            gate = plgpu.load(out_tile, layout=wgmma_layout).astype(f32)
                            acc = acc * silu(gate)
                        store_output(acc.astype(dtype), row0, out_slot, h)

                plgpu.barrier_arrive(free.at[slot])
                return carry

            lax.fori_loop(0, heads_per_block, head, None)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        if y_ref is not None:  # (row_terms without z: nothing per token to zero)

            @pl.when(~is_chunk & (wg < CONSUMERS))
            def _tail():  # bucket rows no chunk owns, spread over the tail blocks' consumers
                zero_rows_past_chunks(
                    out_rows.at[wg, 0],
                    y_ref,
                    total=cu_ref[max_chunks],
                    worker=((chunk - max_chunks) * num_halves + half) * CONSUMERS + wg,
                    workers=_TAIL_BLOCKS * num_halves * CONSUMERS,
                    head0=h0,
                    num_heads=heads_per_block,
                )

    tiles = swizzled_tiles(dtype)
    flat = (plgpu.SwizzleTransform(SWIZZLE_BYTES),)
    state_dim = C_ref.shape[2]
    pl.run_scoped(
        body,
        # The block's 128 rows of C: tiles for wgmma, aliased by a swizzle-only view that
        # TMA copies into at any row.
        plgpu.RefUnion(
            plgpu.SMEM((state_tiles, BLOCK_ROWS, _COLUMNS), dtype, transforms=tiles),
            plgpu.SMEM((state_tiles, BLOCK_ROWS, _COLUMNS), dtype, transforms=flat),
        ),
        # The chunk's B (for C·Bᵀ only), then the per-head ring of x tiles and carried
        # states in its place.
        plgpu.RefUnion(
            plgpu.SMEM((state_tiles, chunk_size, _COLUMNS), dtype, transforms=tiles),
            plgpu.SMEM((state_tiles, chunk_size, _COLUMNS), dtype, transforms=flat),
            (
                plgpu.SMEM((num_stages, chunk_size, HEAD_DIM), dtype, transforms=tiles),
                plgpu.SMEM((num_stages, HEAD_DIM, state_dim), dtype, transforms=tiles),
            ),
            plgpu.SMEM((num_stages, chunk_size, HEAD_DIM), dtype, transforms=flat),
        ),
        plgpu.SMEM((cb_blocks(chunk_size), ROWS, ROWS), dtype, transforms=tiles),
        plgpu.SMEM((num_stages, chunk_size), f32),
        plgpu.SMEM((num_stages, chunk_size), f32),
        plgpu.SMEM((num_stages, HEAD_DIM), f32) if has_D else None,
        # Per consumer, two output tiles: swizzled (wgmma layout stores), their
        # swizzle-only view (a TMA store at any row) and an unswizzled view (the store
        # ladder of a chunk's last rows). With row_terms: z then dz in tile 0, dy in 1.
        plgpu.RefUnion(
            plgpu.SMEM((CONSUMERS, 2, ROWS, HEAD_DIM), dtype, transforms=tiles),
            plgpu.SMEM((CONSUMERS, 2, ROWS, HEAD_DIM), dtype, transforms=flat),
            plgpu.SMEM((CONSUMERS, 2, ROWS, HEAD_DIM), dtype),
        ),
        plgpu.Barrier(num_barriers=state_tiles),
        plgpu.Barrier(num_barriers=state_tiles),
        plgpu.Barrier(num_arrivals=CONSUMERS),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages) if has_D else None,
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=num_stages),
        plgpu.Barrier(num_barriers=CONSUMERS) if has_z else None,
        # dy_y and D's partial on their way out
        plgpu.SMEM((CONSUMERS, 2, ROWS), f32) if row_terms else None,
        plgpu.Barrier(num_barriers=CONSUMERS) if row_terms else None,
        collective_axes="wg",
    )


def _chunk_scan_kernel(
    s: triton_config.ScanShapes,
    x: jax.Array,
    D: jax.Array | None,
    z: jax.Array | None,
    *,
    config: BlockSizes,
    first_states_zero: bool,
    row_terms: bool,
):
    """The chunk-scan kernel (:func:`_kernel`) for these operands and static facts, as a
    callable."""
    has_D, has_z = D is not None, z is not None
    heads_per_group = s.heads // s.groups
    heads_per_block = config.heads_per_block or default_heads_per_block(heads_per_group)
    check_block_sizes(
        config,
        heads_per_group=heads_per_group,
        chunk_size=s.chunk_size,
        state_dim=s.state_dim,
        itemsize=x.dtype.itemsize,
    )
    tokens = jax.ShapeDtypeStruct(x.shape, x.dtype)
    if row_terms:
        f32 = jnp.float32
        per_row = jax.ShapeDtypeStruct((s.heads, s.max_chunks, s.chunk_size), f32)
        per_block = (s.chunk_size // ROWS, s.max_chunks, s.heads, s.head_dim)
        out_type = (
            *([tokens] if has_z else []),
            per_row,
            *([jax.ShapeDtypeStruct(per_block, f32)] if has_D else []),
        )
    else:
        out_type = tokens
    return plgpu.kernel(
        functools.partial(
            _kernel,
            has_D=has_D,
            has_z=has_z,
            first_states_zero=first_states_zero,
            row_terms=row_terms,
            heads_per_group=heads_per_group,
            heads_per_block=heads_per_block,
            num_stages=config.num_stages,
        ),
        out_type=out_type,
        # The last axis varies fastest: the head blocks of a chunk run side by side and
        # share its C and B in L2.
        grid=(s.max_chunks + _TAIL_BLOCKS, s.chunk_size // BLOCK_ROWS, s.heads // heads_per_block),
        grid_names=("chunk", "half", "heads"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        kernel_name=(
            f"ssd_mosaic_{'bwd_rows' if row_terms else 'chunk_scan'}_cs{s.chunk_size}"
            f"_n{s.state_dim}_hb{heads_per_block}_s{config.num_stages}"
            f"_zero{int(first_states_zero)}"
        ),
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane
        ),
    )


def chunk_scan(
    s: triton_config.ScanShapes,
    metadata,
    x: jax.Array,
    C: jax.Array,
    B: jax.Array,
    dt_chunks: jax.Array,
    cum: jax.Array,
    carried: jax.Array,
    D: jax.Array | None,
    z: jax.Array | None,
    *,
    config: BlockSizes,
    first_states_zero: bool = False,
) -> jax.Array:
    """Stage 3 on the tensor cores: ``y[T, H, P]`` in x's dtype from the state scan's
    ``dt_chunks``, ``cum[H, max_chunks, chunk_size]`` and ``carried[max_chunks, H, P, N]``
    (in C's dtype); ``D[H, P]`` fp32 or None; bucket rows past the chunks zeroed.
    ``first_states_zero``: no initial states, and the state scan wrote no carried state for
    a sequence's first chunk (:func:`state_scan`); its chunk scan starts from zero."""
    kernel = _chunk_scan_kernel(
        s, x, D, z, config=config, first_states_zero=first_states_zero, row_terms=False
    )
    operands = [a for a in (D, z) if a is not None]
    return kernel(
        metadata.cu_chunk_seqlens, metadata.seq_idx, x, C, B, dt_chunks, cum, carried, *operands
    )


def row_terms(
    s: triton_config.ScanShapes,
    metadata,
    x: jax.Array,
    B: jax.Array,
    C: jax.Array,
    res: triton_config.Residuals,
    D: jax.Array | None,
    z: jax.Array | None,
    dy: jax.Array,
    *,
    config: BlockSizes,
) -> tuple[jax.Array | None, jax.Array, jax.Array | None]:
    """The backward's rows, which need the output before the D skip and the z gate,
    ``y_ssm``, in fp32 (the decay cotangent ``dy · y_ssm − dt' x · g`` cancels): the chunk
    scan recomputes it from the forward's residuals in registers and, with ``dy[T, H, P]``
    and z, writes ``(dz[T, H, P] or None, dy_y[H, max_chunks, cs] fp32, dD partial
    [cs / 64, max_chunks, H, P] fp32 or None)``: ``dy_y_j = dy_j silu(z_j) · y_ssm_j``,
    per 64-row block ``Σ_j dy_j silu(z_j) ∘ x_j``. Past a chunk's end, in row blocks
    without rows and in padding chunks they are unwritten (the caller selects them away);
    dz's bucket rows are zeroed. Saving y_ssm instead would cost the forward a second pass
    and the backward a [T, H, P] fp32 read."""
    kernel = _chunk_scan_kernel(s, x, D, z, config=config, first_states_zero=False, row_terms=True)
    operands = [a for a in (D, z) if a is not None]
    out = list(
        kernel(
            metadata.cu_chunk_seqlens,
            metadata.seq_idx,
            x,
            C,
            B,
            res.dt_chunks,
            res.cum,
            res.carried,
            *operands,
            dy,
        )
    )
    dz = out.pop(0) if z is not None else None
    dy_y = out.pop(0)
    return dz, dy_y, out.pop(0) if D is not None else None


@functools.cache
def row_terms_with(config: BlockSizes):
    """:func:`row_terms` with this tiling, one object per value (the backward's
    ``row_terms_fn``; the Triton scan's compiled-scan cache is keyed by it)."""
    return functools.partial(row_terms, config=config)


@functools.cache
def _state_scan_with(skip_first_carried: bool):
    """:func:`state_scan` with ``skip_first_carried``, one object per value (as
    :func:`_chunk_scan_with`)."""
    return functools.partial(state_scan, skip_first_carried=skip_first_carried)


@functools.cache
def _chunk_scan_with(config: BlockSizes, first_states_zero: bool):
    """:func:`chunk_scan` with these arguments, one object per value: the Triton forward's
    compiled-scan cache (``triton._differentiable``) is keyed by it."""
    return functools.partial(chunk_scan, config=config, first_states_zero=first_states_zero)


@functools.cache
def residual_stages(config: BlockSizes, mosaic_states: bool):
    """The forward's stages under differentiation (``triton._forward``'s
    ``residual_stages``): every chunk's carried state written, in C's dtype, and read by
    every chunk's scan (the backward reads them all)."""
    return (
        _state_scan_with(False) if mosaic_states else triton.state_scan,
        _chunk_scan_with(config, False),
    )


def ssd_scan(x, dt, A, B, C, *, chunk_size: int, config: BlockSizes, **options):
    """See :func:`pallas_kernels.ssd_scan`; arguments are already validated and
    ``mosaic_config.supports`` takes the call. The Mosaic (or, where it cannot serve, the
    Triton) state scan, then this chunk scan. Under differentiation the same stages save
    the residuals of the Mosaic backward (``mosaic_vjp.chunk_dx``, :func:`row_terms`,
    ``mosaic_vjp.chunk_dbc`` where N <= 128, around ``ssd/triton_vjp.py``'s state pass);
    where its kernels do not fit in shared memory the Triton forward and backward run."""
    mosaic_states = state_scan_supports(
        heads_per_group=x.shape[1] // B.shape[1],
        state_dim=B.shape[2],
        intermediate=options["return_intermediate_states"],
    )
    # The pair skips the zero carried states of sequences' first chunks.
    first_states_zero = mosaic_states and options["initial_states"] is None
    sizes = dict(
        chunk_size=chunk_size,
        state_dim=B.shape[2],
        num_stages=config.num_stages,
        itemsize=x.dtype.itemsize,
    )
    mosaic_backward = backward_supports(**sizes)
    return triton.ssd_scan(
        x,
        dt,
        A,
        B,
        C,
        chunk_size=chunk_size,
        config=triton_config.default_block_sizes(chunk_size, x.shape[2], B.shape[2]),
        state_scan_fn=_state_scan_with(first_states_zero) if mosaic_states else None,
        chunk_scan_fn=_chunk_scan_with(config, first_states_zero),
        residual_stages=residual_stages(config, mosaic_states) if mosaic_backward else None,
        chunk_dx_fn=mosaic_vjp.chunk_dx_with(config) if mosaic_backward else None,
        row_terms_fn=row_terms_with(config) if mosaic_backward else None,
        chunk_dbc_fn=mosaic_vjp.chunk_dbc_with(config) if chunk_dbc_supports(**sizes) else None,
        **options,
    )
