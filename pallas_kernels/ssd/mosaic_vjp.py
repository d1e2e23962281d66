"""The SSD scan's backward on the tensor cores: ``chunk_dx`` and ``chunk_dbc`` (stages 2
and 3 of ``ssd/triton_vjp.py``) as Pallas Mosaic GPU kernels (Hopper: wgmma, TMA), beside
that module's reverse state pass, which stays Triton (its cost is the walk's latency).

``chunk_dx`` is the forward's chunk scan (``mosaic.py``) transposed. Per chunk and head,
for the chunk's rows ``j``,

    g_j = exp(cum_last − cum_j) B_j · ds_out  +  Σ_{i ≥ j} (B_j · C_i) exp(cum_i − cum_j) dy_i

(the chunk scan's ``y_i`` with B and C exchanged, ``dy`` for ``dt' x``, the state
cotangent after the chunk ``ds_out`` for the carried state and the causal block mirrored),
giving ``dx_j = dt'_j g_j + D dy_j``, ``∂dt'_j = x_j · g_j`` and the state's part of the
chunk total's cotangent, ``q_j = dt'_j x_j · exp(cum_last − cum_j) B_j ds_outᵀ``. The
rows' own terms (dz, ``dy · y_ssm``, the D partial) need no sum over the chunk but
``y_ssm``: the forward's chunk scan, run again, computes them (``mosaic.row_terms``), so
this kernel reads neither z nor ``y_ssm``.

The thread block is the chunk scan's: one per (chunk, 128 of its rows, block of heads of
one B/C group), a producer warpgroup TMA-copying into a ring of shared-memory slots, two
consumer warpgroups with fp32 accumulators in registers; consumer k owns the row block
``b = 2 × half + k``. The producer copies the block's B rows and the chunk's C once; each
consumer computes its rows of ``B Cᵀ`` (entries ``i ≥ j`` of the chunk, the rest
selected to 0) into shared memory for every head of the block; then the ring carries per
head the chunk's ``dy`` rows (gated: ``state_pass``'s ``dyg``), ``ds_out``, dt' and cum.
Right of the diagonal block the decay factors through the row block's **last** row r
(cum falls along the chunk: ``cum_i <= cum_r <= cum_j``): ``exp(cum_i − cum_r)`` per
column, ``exp(cum_r − cum_j)`` per row, both <= 1, and the state term's
``exp(cum_last − cum_j) = exp(cum_last − cum_r) exp(cum_r − cum_j)``. Each consumer
copies its 64 rows of x into its output tile (they land while the products run), and
``dx`` leaves through the same tile.

A short chunk's tiles hold the next rows of the packed batch (NaN in tests): ``B Cᵀ`` is
selected to 0 past the chunk and the consumers zero the ``dy`` rows past it in shared
memory (``0 × NaN`` is NaN); the rows of ``dx`` past the chunk are never stored, and
``ddt``/``q`` past a chunk's end (and of padding chunks) are left for the caller to
select away. A few extra blocks zero ``dx``'s bucket rows no chunk owns.

``chunk_dbc`` is one kernel launched twice, for dC and for dB (:func:`chunk_dbc`): per
(chunk, 128 of its rows, block of heads) the chunk's B (dC) or C (dB) stays in shared
memory, and a ring carries per head the block's own rows (dy for dC, x for dB), the
chunk's other operand and the state (s_in or ds_out). Consumer k's row block sums, over
the block's heads, the state term and for each causal block pair ``∂W`` (one 64 × 64 × P
product, scaled in registers: the decay factored through the row block's edge row off
the diagonal) times B or C, in fp32 registers; the heads are not summed before that
second product, whose per-pair ∂W sums would not fit beside the two ``[64, N]`` sums.
"""

from __future__ import annotations

import functools
from typing import Final

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import decay_factor
from pallas_kernels._mosaic import (
    CONSUMER_REGISTERS,
    PRODUCER_REGISTERS,
    SWIZZLE_BYTES,
    produce_ring,
    store_rows,
    swizzled_tiles,
    zero_rows_past_chunks,
)
from pallas_kernels.ssd import triton_config
from pallas_kernels.ssd.mosaic_config import (
    BLOCK_ROWS,
    CONSUMERS,
    HEAD_DIM,
    ROWS,
    BlockSizes,
    cb_blocks,
    default_heads_per_block,
)

_COLUMNS: Final = 64  # 16-bit columns of a swizzled tile (128 bytes)
_TAIL_BLOCKS: Final = 2  # blocks past the chunks that zero dx's bucket rows


def _chunk_dx_kernel(
    cu_ref,  # [max_chunks + 1] int32
    x_ref,  # [T, H, P]
    B_ref,  # [T, G, N]
    C_ref,  # [T, G, N]
    dt_ref,  # [H, max_chunks, cs] fp32: dt'
    cum_ref,  # [H, max_chunks, cs] fp32
    ds_out_ref,  # [max_chunks, H, P, N] in x's dtype: the state cotangent after the chunk
    dy_ref,  # [T, H, P] in x's dtype: the pre-gate output's cotangent
    *rest,  # D_ref [H, P] fp32 (if given), dx_ref [T, H, P], ddt_ref, q_ref [H, chunks, cs]
    has_D: bool,
    heads_per_group: int,
    heads_per_block: int,
    num_stages: int,
):
    D_ref = rest[0] if has_D else None
    dx_ref, ddt_ref, q_ref = rest[-3:]
    chunk_size = dt_ref.shape[2]
    state_tiles = B_ref.shape[2] // _COLUMNS
    max_chunks = cu_ref.shape[0] - 1
    num_blocks = chunk_size // ROWS
    num_halves = chunk_size // BLOCK_ROWS
    dtype, f32 = x_ref.dtype, jnp.float32
    wgmma_layout = plgpu.Layout.WGMMA
    row_vector, column_vector = wgmma_layout.reduce(1), wgmma_layout.reduce(0)
    block_shape = (ROWS, _COLUMNS)

    def iota(dim):
        return plgpu.broadcasted_iota(jnp.int32, block_shape, dim, layout=wgmma_layout)

    def body(
        b_views,
        ring_views,
        bct_smem,
        dt_smem,
        cum_smem,
        d_smem,
        out_views,
        vec_smem,
        b_full,
        c_full,
        bct_done,
        dy_full,
        ds_full,
        dt_full,
        cum_full,
        d_full,
        zeroed,
        free,
        x_full,
    ):
        b_tiles, b_flat = b_views
        out_tiles, out_flat, out_rows = out_views
        c_tiles, c_flat, (dy_tiles, ds_tiles), dy_flat = ring_views
        chunk = lax.axis_index("chunk")
        half = lax.axis_index("half")
        h0 = lax.axis_index("heads") * heads_per_block
        group = lax.div(h0, heads_per_group)
        wg = lax.axis_index("wg")
        is_chunk = chunk < max_chunks
        c = jnp.minimum(chunk, max_chunks - 1)
        start = cu_ref[c]
        length = jnp.where(is_chunk, cu_ref[c + 1] - start, 0)
        # The block's rows [row_lo, row_lo + 128): consumer k's row block 2 * half + k sees
        # the chunk's column blocks [2 * half + k, n_live).
        row_lo = half * BLOCK_ROWS
        works = length > row_lo
        n_live = lax.div(length + ROWS - 1, ROWS)
        chunk_rows = pl.ds(start, chunk_size)

        @pl.when((wg == CONSUMERS) & works)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            for t in range(state_tiles):
                columns = pl.ds(t * _COLUMNS, _COLUMNS)
                block_rows = pl.ds(start + row_lo, BLOCK_ROWS)
                plgpu.copy_gmem_to_smem(
                    B_ref.at[block_rows, group, columns], b_flat.at[t], b_full.at[t]
                )
                plgpu.copy_gmem_to_smem(
                    C_ref.at[chunk_rows, group, columns], c_flat.at[t], c_full.at[t]
                )
            # The ring reuses C's shared memory: it fills once B·Cᵀ is computed.
            plgpu.barrier_wait(bct_done)

            def load(i, slot):
                h = h0 + i
                plgpu.copy_gmem_to_smem(
                    dy_ref.at[chunk_rows, h], dy_flat.at[slot], dy_full.at[slot]
                )
                plgpu.copy_gmem_to_smem(ds_out_ref.at[c, h], ds_tiles.at[slot], ds_full.at[slot])
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
            rows_b = pl.ds(k * ROWS, ROWS)  # of the block's B tile
            rows_j = pl.ds(b * ROWS, ROWS)  # of the chunk
            bct_first = k * (num_blocks - 2 * half)  # consumer 1's blocks follow consumer 0's
            live = jnp.clip(length - b * ROWS, 0, ROWS)
            for t in range(state_tiles):
                plgpu.barrier_wait(b_full.at[t])
                plgpu.barrier_wait(c_full.at[t])

            # The row block's B·Cᵀ, entries i >= j inside the chunk only (the rest selected
            # to 0: past the chunk C holds other rows), kept for every head.
            @pl.loop(b, n_live)
            def _bct(ib):
                def product(acc_ref):
                    for t in range(state_tiles):
                        plgpu.wgmma(
                            acc_ref,
                            b_tiles.at[t, rows_b],
                            c_tiles.at[t, pl.ds(ib * ROWS, ROWS)].T,
                        )
                    return acc_ref[...]

                value = pl.run_scoped(product, plgpu.ACC(block_shape, f32))
                column = ib * ROWS + iota(1)
                keep = (column < length) & (b * ROWS + iota(0) <= column)
                bct_smem.at[bct_first + ib - b][...] = jnp.where(keep, value, 0.0).astype(dtype)

            plgpu.commit_smem()
            plgpu.barrier_arrive(bct_done)

            def head(i, carry):
                slot = lax.rem(i, num_stages)
                h = h0 + i
                dy_tile = dy_tiles.at[slot]
                plgpu.barrier_wait(dy_full.at[slot])

                @pl.when(lax.rem(length, ROWS) != 0)
                def _zero_past_chunk():
                    # The dy rows past the chunk in its last (partial) column block, which
                    # this block reads: B·Cᵀ is 0 there, but 0 × NaN is not.
                    last = lax.div(length, ROWS)

                    @pl.when(lax.rem(last, CONSUMERS) == k)
                    def _zero():
                        tile = dy_tile.at[pl.ds(last * ROWS, ROWS)]
                        v = plgpu.load(tile, layout=wgmma_layout)
                        keep = last * ROWS + iota(0) < length
                        tile[...] = jnp.where(keep, v, jnp.zeros_like(v))

                    plgpu.commit_smem()
                    plgpu.barrier_arrive(zeroed.at[slot])
                    plgpu.barrier_wait(zeroed.at[slot])

                plgpu.barrier_wait(ds_full.at[slot])
                plgpu.barrier_wait(dt_full.at[slot])
                plgpu.barrier_wait(cum_full.at[slot])
                if has_D:
                    plgpu.barrier_wait(d_full.at[slot])
                # Output tiles alternate, one bulk store group per head: a tile is
                # rewritten once the stores from it two heads ago have read it.
                out_slot = lax.rem(i, 2)

                @pl.when(live <= 0)
                def _no_rows():
                    plgpu.commit_smem_to_gmem_group()  # an empty group keeps the count

                @pl.when(live > 0)
                def _row_block():
                    row0 = start + b * ROWS
                    out_tile = out_tiles.at[k, out_slot]
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    # x's rows into the output tile; they land while the products run.
                    plgpu.copy_gmem_to_smem(
                        x_ref.at[pl.ds(row0, ROWS), h], out_flat.at[k, out_slot], x_full.at[k]
                    )
                    cum_j = plgpu.load(cum_smem.at[slot, rows_j], layout=row_vector)
                    dt_j = plgpu.load(dt_smem.at[slot, rows_j], layout=row_vector)
                    # Past a short chunk's end cum holds cum_last (dt' is 0 there).
                    cum_r = cum_smem[slot, b * ROWS + ROWS - 1]
                    cum_last = cum_smem[slot, chunk_size - 1]

                    def from_state(acc_ref):
                        for t in range(state_tiles):
                            ds_t = ds_tiles.at[slot, :, pl.ds(t * _COLUMNS, _COLUMNS)]
                            plgpu.wgmma(acc_ref, b_tiles.at[t, rows_b], ds_t.T)
                        return acc_ref[...]

                    acc = pl.run_scoped(from_state, plgpu.ACC(block_shape, f32))
                    acc = acc * decay_factor(cum_last - cum_r)
                    row_decay = decay_factor(cum_r - cum_j)
                    plgpu.barrier_wait(x_full.at[k])
                    x = plgpu.load(out_tile, layout=wgmma_layout).astype(f32)
                    q = dt_j * row_decay * jnp.sum(x * acc, axis=1)

                    def column_block(ib, acc, *, diagonal):
                        columns = pl.ds(ib * ROWS, ROWS)
                        cum_i = plgpu.load(cum_smem.at[slot, columns], layout=column_vector)
                        bct = plgpu.load(bct_smem.at[bct_first + ib - b], layout=wgmma_layout)
                        if diagonal:
                            decay = decay_factor(
                                lax.broadcast_in_dim(cum_i, block_shape, [1])
                                - lax.broadcast_in_dim(cum_j, block_shape, [0])
                            )
                        else:
                            decay = lax.broadcast_in_dim(
                                decay_factor(cum_i - cum_r), block_shape, [1]
                            )
                        w = bct.astype(f32) * decay

                        def product(acc_ref):
                            plgpu.wgmma(acc_ref, w.astype(dtype), dy_tile.at[columns])

                        return pl.run_state(product)(plgpu.ACC.init(acc))

                    acc = lax.fori_loop(
                        b + 1, n_live, functools.partial(column_block, diagonal=False), acc
                    )
                    acc = acc * lax.broadcast_in_dim(row_decay, block_shape, [0])
                    g = column_block(b, acc, diagonal=True)
                    ddt = jnp.sum(x * g, axis=1)
                    dx = g * lax.broadcast_in_dim(dt_j, block_shape, [0])
                    if has_D:
                        dy_j = plgpu.load(dy_tile.at[rows_j], layout=wgmma_layout).astype(f32)
                        d = plgpu.load(d_smem.at[slot], layout=column_vector)
                        dx = dx + dy_j * lax.broadcast_in_dim(d, block_shape, [1])
                    vectors = vec_smem.at[k, out_slot]
                    vectors.at[0][...] = ddt
                    vectors.at[1][...] = q
                    dx = dx.astype(dtype)
                    whole = live == ROWS

                    @pl.when(whole)
                    def _stage_block():  # swizzled, for one 64-row store
                        out_tile[...] = dx

                    @pl.when(~whole)
                    def _stage_chunk_end():  # unswizzled, for the store ladder
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        out_rows.at[k, out_slot][...] = dx

                    plgpu.commit_smem()
                    # The rows' vectors whole (the caller selects past the chunk's end),
                    # then dx: one bulk group per head.
                    for v, ref in enumerate((ddt_ref, q_ref)):
                        plgpu.copy_smem_to_gmem(
                            vectors.at[v], ref.at[h, c, rows_j], commit_group=False
                        )

                    @pl.when(whole)
                    def _whole_block():  # one swizzled 64-row store, at any row
                        plgpu.copy_smem_to_gmem(
                            out_flat.at[k, out_slot], dx_ref.at[pl.ds(row0, ROWS), h]
                        )

                    @pl.when(~whole)
                    def _chunk_end():  # the chunk's last rows, through the store ladder
                        store_rows(
                            out_rows.at[k, out_slot],
                            dx_ref,
                            row0=row0,
                            first=0,
                            live=live,
                            head=h,
                            wait=False,
                        )

                plgpu.barrier_arrive(free.at[slot])
                return carry

            lax.fori_loop(0, heads_per_block, head, None)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(~is_chunk & (wg < CONSUMERS))
        def _tail():
            zero_rows_past_chunks(
                out_rows.at[wg, 0],
                dx_ref,
                total=cu_ref[max_chunks],
                worker=((chunk - max_chunks) * num_halves + half) * CONSUMERS + wg,
                workers=_TAIL_BLOCKS * num_halves * CONSUMERS,
                head0=h0,
                num_heads=heads_per_block,
            )

    tiles = swizzled_tiles(dtype)
    flat = (plgpu.SwizzleTransform(SWIZZLE_BYTES),)
    state_dim = B_ref.shape[2]
    pl.run_scoped(
        body,
        # The block's 128 rows of B: tiles for wgmma, aliased by a swizzle-only view that
        # TMA copies into at any row.
        plgpu.RefUnion(
            plgpu.SMEM((state_tiles, BLOCK_ROWS, _COLUMNS), dtype, transforms=tiles),
            plgpu.SMEM((state_tiles, BLOCK_ROWS, _COLUMNS), dtype, transforms=flat),
        ),
        # The chunk's C (for B·Cᵀ only), then the per-head ring of dy tiles and state
        # cotangents in its place.
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
        # Per consumer, two x-then-dx tiles: swizzled (wgmma layout loads and stores),
        # their swizzle-only view (TMA at any row) and an unswizzled view (the store
        # ladder of a chunk's last rows).
        plgpu.RefUnion(
            plgpu.SMEM((CONSUMERS, 2, ROWS, HEAD_DIM), dtype, transforms=tiles),
            plgpu.SMEM((CONSUMERS, 2, ROWS, HEAD_DIM), dtype, transforms=flat),
            plgpu.SMEM((CONSUMERS, 2, ROWS, HEAD_DIM), dtype),
        ),
        plgpu.SMEM((CONSUMERS, 2, 2, ROWS), f32),
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
        plgpu.Barrier(num_barriers=CONSUMERS),
        collective_axes="wg",
    )


def chunk_dx(
    s: triton_config.ScanShapes,
    metadata,
    x: jax.Array,
    B: jax.Array,
    C: jax.Array,
    res: triton_config.Residuals,
    ds_out: jax.Array,
    D: jax.Array | None,
    dyg: jax.Array,
    *,
    config: BlockSizes,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stage 2's sums over the chunk: ``(dx[T, H, P], ddt[H, max_chunks, cs],
    q[H, max_chunks, cs])``, the last two fp32 and unwritten past a chunk's end (the
    caller selects them away). ``ds_out[max_chunks, H, P, N]`` and ``dyg[T, H, P]`` come
    from ``triton_vjp.state_pass``; ``D[H, P]`` fp32 or None."""
    heads_per_group = s.heads // s.groups
    heads_per_block = config.heads_per_block or default_heads_per_block(heads_per_group)
    per_row = jax.ShapeDtypeStruct((s.heads, s.max_chunks, s.chunk_size), jnp.float32)
    kernel = plgpu.kernel(
        functools.partial(
            _chunk_dx_kernel,
            has_D=D is not None,
            heads_per_group=heads_per_group,
            heads_per_block=heads_per_block,
            num_stages=config.num_stages,
        ),
        out_type=(jax.ShapeDtypeStruct(x.shape, x.dtype), per_row, per_row),
        # The last axis varies fastest: the head blocks of a chunk run side by side and
        # share its B and C in L2.
        grid=(s.max_chunks + _TAIL_BLOCKS, s.chunk_size // BLOCK_ROWS, s.heads // heads_per_block),
        grid_names=("chunk", "half", "heads"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        kernel_name=(
            f"ssd_mosaic_bwd_chunk_dx_cs{s.chunk_size}_n{s.state_dim}_hb{heads_per_block}"
            f"_s{config.num_stages}"
        ),
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane
        ),
    )
    operands = [] if D is None else [D]
    return kernel(
        metadata.cu_chunk_seqlens,
        x,
        B,
        C,
        res.dt_chunks,
        res.cum,
        ds_out,
        dyg,
        *operands,
    )


@functools.cache
def chunk_dx_with(config: BlockSizes):
    """:func:`chunk_dx` with this tiling, one object per value (the backward's
    ``chunk_dx_fn``; the Triton scan's compiled-scan cache is keyed by it)."""
    return functools.partial(chunk_dx, config=config)


# ---------------------------------------------------------------------- chunk_dbc: dB, dC


def _chunk_dbc_kernel(
    cu_ref,  # [max_chunks + 1] int32
    own_ref,  # [T, H, P]: the rows' own operand (dy for dC, x for dB)
    other_ref,  # [T, H, P]: the chunk's other operand (x for dC, dy for dB)
    kept_ref,  # [T, G, N]: the group's rows the products end in (B for dC, C for dB)
    state_ref,  # [max_chunks, H, P, N] in x's dtype: s_in (dC) or ds_out (dB)
    dt_ref,  # [H, max_chunks, cs] fp32: dt'
    cum_ref,  # [H, max_chunks, cs] fp32
    out_ref,  # [splits, T, G, N] fp32: this head split's dC or dB
    *,
    for_dc: bool,
    heads_per_group: int,
    heads_per_block: int,
    num_stages: int,
):
    chunk_size = dt_ref.shape[2]
    state_tiles = kept_ref.shape[2] // _COLUMNS
    splits = heads_per_group // heads_per_block
    dtype, f32 = own_ref.dtype, jnp.float32
    wgmma_layout = plgpu.Layout.WGMMA
    row_vector, column_vector = wgmma_layout.reduce(1), wgmma_layout.reduce(0)
    block_shape = (ROWS, _COLUMNS)

    def iota(dim):
        return plgpu.broadcasted_iota(jnp.int32, block_shape, dim, layout=wgmma_layout)

    def body(
        kept_views,
        ring_views,
        dt_smem,
        cum_smem,
        kept_full,
        own_full,
        other_full,
        state_full,
        dt_full,
        cum_full,
        zeroed,
        free,
        done,
    ):
        kept_tiles, kept_flat = kept_views
        (own_tiles, other_tiles, state_tiles_smem), own_flat, (_, other_flat), staged = ring_views
        c = lax.axis_index("chunk")
        half = lax.axis_index("half")
        group_split = lax.axis_index("heads")
        group, split = lax.div(group_split, splits), lax.rem(group_split, splits)
        h0 = group * heads_per_group + split * heads_per_block
        wg = lax.axis_index("wg")
        start = cu_ref[c]
        length = cu_ref[c + 1] - start
        row_lo = half * BLOCK_ROWS
        works = length > row_lo
        n_live = lax.div(length + ROWS - 1, ROWS)
        chunk_rows = pl.ds(start, chunk_size)

        @pl.when((wg == CONSUMERS) & works)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            for t in range(state_tiles):
                columns = pl.ds(t * _COLUMNS, _COLUMNS)
                plgpu.copy_gmem_to_smem(
                    kept_ref.at[chunk_rows, group, columns], kept_flat.at[t], kept_full.at[t]
                )

            def load(i, slot):
                h = h0 + i
                plgpu.copy_gmem_to_smem(
                    own_ref.at[pl.ds(start + row_lo, BLOCK_ROWS), h],
                    own_flat.at[slot],
                    own_full.at[slot],
                )
                plgpu.copy_gmem_to_smem(
                    other_ref.at[chunk_rows, h], other_flat.at[slot], other_full.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    state_ref.at[c, h], state_tiles_smem.at[slot], state_full.at[slot]
                )
                plgpu.copy_gmem_to_smem(dt_ref.at[h, c], dt_smem.at[slot], dt_full.at[slot])
                plgpu.copy_gmem_to_smem(cum_ref.at[h, c], cum_smem.at[slot], cum_full.at[slot])

            produce_ring(load, heads_per_block, free, num_stages=num_stages)

        @pl.when((wg < CONSUMERS) & works)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            k = wg
            b = 2 * half + k  # the consumer's row block of the chunk
            rows_k = pl.ds(k * ROWS, ROWS)  # of the block's own tile
            rows_b = pl.ds(b * ROWS, ROWS)  # of the chunk
            live = jnp.clip(length - b * ROWS, 0, ROWS)
            for t in range(state_tiles):
                plgpu.barrier_wait(kept_full.at[t])

            @pl.when(lax.rem(length, ROWS) != 0)
            def _zero_past_chunk():
                # The kept rows past the chunk in its last (partial) block: ∂W is selected
                # to 0 there, but 0 × NaN is not.
                last = lax.div(length, ROWS)

                @pl.when(lax.rem(last, CONSUMERS) == k)
                def _zero():
                    for t in range(state_tiles):
                        tile = kept_tiles.at[t, pl.ds(last * ROWS, ROWS)]
                        v = plgpu.load(tile, layout=wgmma_layout)
                        keep = last * ROWS + iota(0) < length
                        tile[...] = jnp.where(keep, v, jnp.zeros_like(v))

                plgpu.commit_smem()
                plgpu.barrier_arrive(zeroed)
                plgpu.barrier_wait(zeroed)

            def products(slot, acc):
                own = own_tiles.at[slot, rows_k]
                other = other_tiles.at[slot]
                cum_r = plgpu.load(cum_smem.at[slot, rows_b], layout=row_vector)
                dt_r = plgpu.load(dt_smem.at[slot, rows_b], layout=row_vector)
                cum_last = cum_smem[slot, chunk_size - 1]
                # The state's part, summed over the heads: exp(cum_r) dy_r s_in into dC,
                # exp(cum_last - cum_r) dt'_r x_r ds_out into dB.
                scale = decay_factor(cum_r) if for_dc else decay_factor(cum_last - cum_r) * dt_r
                a = plgpu.load(own, layout=wgmma_layout).astype(f32)
                a = (a * lax.broadcast_in_dim(scale, block_shape, [0])).astype(dtype)

                def state_product(acc_refs):
                    for t in range(state_tiles):
                        state_t = state_tiles_smem.at[slot, :, pl.ds(t * _COLUMNS, _COLUMNS)]
                        plgpu.wgmma(acc_refs[t], a, state_t)

                acc = pl.run_state(state_product)(tuple(plgpu.ACC.init(v) for v in acc))

                # The causal block: ∂W_ij = (dy_i · x_j) exp(cum_i − cum_j) dt'_j (i >= j)
                # ends in dC_i += ∂W_ij B_j over the column blocks j <= the rows, and in
                # dB_j += ∂W_ijᵀ C_i over the row blocks i >= them; off the diagonal block
                # the decay factors through the row block's edge row R (cum falls along
                # the chunk): exp(cum_i - cum_R) exp(cum_R - cum_j), both <= 1.
                edge = b * ROWS if for_dc else b * ROWS + ROWS - 1
                cum_edge = cum_smem[slot, edge]

                def pair(jb, acc, *, diagonal):
                    columns = pl.ds(jb * ROWS, ROWS)

                    def dw_product(acc_ref):
                        plgpu.wgmma(acc_ref, own, other.at[columns].T)
                        return acc_ref[...]

                    dw = pl.run_scoped(dw_product, plgpu.ACC(block_shape, f32))
                    cum_c = plgpu.load(cum_smem.at[slot, columns], layout=column_vector)
                    row = b * ROWS + iota(0)
                    column = jb * ROWS + iota(1)
                    keep = column < length
                    if for_dc:  # rows r = i, columns j: exp(cum_r - cum_j) dt'_j
                        dt_c = plgpu.load(dt_smem.at[slot, columns], layout=column_vector)
                        if diagonal:
                            decay = decay_factor(
                                lax.broadcast_in_dim(cum_r, block_shape, [0])
                                - lax.broadcast_in_dim(cum_c, block_shape, [1])
                            ) * lax.broadcast_in_dim(dt_c, block_shape, [1])
                            keep = keep & (row >= column)
                        else:
                            decay = lax.broadcast_in_dim(
                                decay_factor(cum_r - cum_edge), block_shape, [0]
                            ) * lax.broadcast_in_dim(
                                decay_factor(cum_edge - cum_c) * dt_c, block_shape, [1]
                            )
                    else:  # rows r = j, columns i: exp(cum_i - cum_r) dt'_r
                        if diagonal:
                            decay = decay_factor(
                                lax.broadcast_in_dim(cum_c, block_shape, [1])
                                - lax.broadcast_in_dim(cum_r, block_shape, [0])
                            ) * lax.broadcast_in_dim(dt_r, block_shape, [0])
                            keep = keep & (column >= row)
                        else:
                            decay = lax.broadcast_in_dim(
                                decay_factor(cum_edge - cum_r) * dt_r, block_shape, [0]
                            ) * lax.broadcast_in_dim(
                                decay_factor(cum_c - cum_edge), block_shape, [1]
                            )
                    w = jnp.where(keep, dw * decay, 0.0).astype(dtype)

                    def kept_product(acc_refs):
                        for t in range(state_tiles):
                            plgpu.wgmma(acc_refs[t], w, kept_tiles.at[t, columns])

                    return pl.run_state(kept_product)(tuple(plgpu.ACC.init(v) for v in acc))

                if for_dc:
                    acc = lax.fori_loop(0, b, functools.partial(pair, diagonal=False), acc)
                    return pair(b, acc, diagonal=True)
                acc = pair(b, acc, diagonal=True)
                return lax.fori_loop(b + 1, n_live, functools.partial(pair, diagonal=False), acc)

            def head(i, acc):
                slot = lax.rem(i, num_stages)
                plgpu.barrier_wait(own_full.at[slot])
                plgpu.barrier_wait(other_full.at[slot])
                plgpu.barrier_wait(state_full.at[slot])
                plgpu.barrier_wait(dt_full.at[slot])
                plgpu.barrier_wait(cum_full.at[slot])
                acc = lax.cond(live > 0, functools.partial(products, slot), lambda a: a, acc)
                plgpu.barrier_arrive(free.at[slot])
                return acc

            zeros = plgpu.layout_cast(jnp.zeros(block_shape, f32), wgmma_layout)
            acc = lax.fori_loop(0, heads_per_block, head, (zeros,) * state_tiles)
            # The ring is free once both consumers are past their last head: its bytes
            # stage the sums on their way out.
            plgpu.barrier_arrive(done)
            plgpu.barrier_wait(done)

            @pl.when(live > 0)
            def _store():
                row0 = start + b * ROWS
                for t in range(state_tiles):
                    tile = staged.at[k, t]
                    tile[...] = acc[t]
                plgpu.commit_smem()
                for t in range(state_tiles):
                    store_rows(
                        staged.at[k, t],
                        out_ref.at[split],
                        row0=row0,
                        first=0,
                        live=live,
                        head=group,
                        wait=False,
                        columns=pl.ds(t * _COLUMNS, _COLUMNS),
                    )
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    tiles = swizzled_tiles(dtype)
    flat = (plgpu.SwizzleTransform(SWIZZLE_BYTES),)
    state_dim = kept_ref.shape[2]
    ring_own = (num_stages, BLOCK_ROWS, HEAD_DIM)
    ring_other = (num_stages, chunk_size, HEAD_DIM)
    pl.run_scoped(
        body,
        # The chunk's B or C for every head of the block: tiles for wgmma, aliased by a
        # swizzle-only view that TMA copies into at any row.
        plgpu.RefUnion(
            plgpu.SMEM((state_tiles, chunk_size, _COLUMNS), dtype, transforms=tiles),
            plgpu.SMEM((state_tiles, chunk_size, _COLUMNS), dtype, transforms=flat),
        ),
        # Per head: the block's own rows, the chunk's other operand and the state; their
        # swizzle-only views; after the last head, the consumers' fp32 sums.
        plgpu.RefUnion(
            (
                plgpu.SMEM(ring_own, dtype, transforms=tiles),
                plgpu.SMEM(ring_other, dtype, transforms=tiles),
                plgpu.SMEM((num_stages, HEAD_DIM, state_dim), dtype, transforms=tiles),
            ),
            plgpu.SMEM(ring_own, dtype, transforms=flat),
            (
                plgpu.SMEM(ring_own, dtype),  # the bytes of the own tiles: not aliased below
                plgpu.SMEM(ring_other, dtype, transforms=flat),
            ),
            plgpu.SMEM((CONSUMERS, state_tiles, ROWS, _COLUMNS), f32),
        ),
        plgpu.SMEM((num_stages, chunk_size), f32),
        plgpu.SMEM((num_stages, chunk_size), f32),
        plgpu.Barrier(num_barriers=state_tiles),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=CONSUMERS),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=CONSUMERS),
        collective_axes="wg",
    )


def chunk_dbc(
    s: triton_config.ScanShapes,
    metadata,
    x: jax.Array,
    B: jax.Array,
    C: jax.Array,
    res: triton_config.Residuals,
    ds_out: jax.Array,
    dyg: jax.Array,
    *,
    config: BlockSizes,
) -> tuple[jax.Array, jax.Array]:
    """Stage 3: ``(dB, dC)`` partials ``[splits, T, G, N]`` fp32, one per block of heads
    (rows past the chunks unwritten: the caller sums the splits and selects), from two
    launches of one kernel: dC's rows sum ``exp(cum_r) dy_r s_in`` and ``∂W_rj B_j`` over
    the blocks ``j <= r``, dB's ``exp(cum_last − cum_r) dt'_r x_r ds_out`` and
    ``∂W_irᵀ C_i`` over ``i >= r``, each over the block's heads, ``∂W`` recomputed per
    head from dy and x (64 × 64 × P products) and its product with B or C accumulated in
    fp32 registers."""
    heads_per_group = s.heads // s.groups
    heads_per_block = config.dbc_heads_per_block or default_heads_per_block(heads_per_group)
    splits = heads_per_group // heads_per_block
    part = jax.ShapeDtypeStruct((splits, x.shape[0], s.groups, s.state_dim), jnp.float32)

    def launch(for_dc: bool, own, other, kept, state):
        kernel = plgpu.kernel(
            functools.partial(
                _chunk_dbc_kernel,
                for_dc=for_dc,
                heads_per_group=heads_per_group,
                heads_per_block=heads_per_block,
                num_stages=config.num_stages,
            ),
            out_type=part,
            # The last axis varies fastest: the head blocks of a chunk run side by side
            # and share its rows in L2.
            grid=(s.max_chunks, s.chunk_size // BLOCK_ROWS, s.groups * splits),
            grid_names=("chunk", "half", "heads"),
            num_threads=CONSUMERS + 1,
            thread_name="wg",
            kernel_name=(
                f"ssd_mosaic_bwd_chunk_{'dc' if for_dc else 'db'}_cs{s.chunk_size}"
                f"_n{s.state_dim}_hb{heads_per_block}_s{config.num_stages}"
            ),
            compiler_params=plgpu.CompilerParams(
                approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane
            ),
        )
        return kernel(metadata.cu_chunk_seqlens, own, other, kept, state, res.dt_chunks, res.cum)

    dC = launch(True, dyg, x, B, res.carried)
    dB = launch(False, x, dyg, C, ds_out)
    return dB, dC


@functools.cache
def chunk_dbc_with(config: BlockSizes):
    """:func:`chunk_dbc` with this tiling, one object per value (the backward's
    ``chunk_dbc_fn``)."""
    return functools.partial(chunk_dbc, config=config)
