"""The SSD scan's stage 1 on the tensor cores: the Mosaic GPU state scan (the thread block
and the walk that ``mosaic.py``'s module docstring describes under **State scan**)."""

from __future__ import annotations

import functools
from typing import Final

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import search_sorted
from pallas_kernels._mosaic import (
    CONSUMER_REGISTERS,
    PRODUCER_REGISTERS,
    SWIZZLE_BYTES,
    produce_ring,
    swizzled_tiles,
)
from pallas_kernels.ssd import triton, triton_config
from pallas_kernels.ssd.mosaic_config import CONSUMERS, HEAD_DIM, ROWS

_COLUMNS: Final = 64  # 16-bit columns of a swizzled tile (128 bytes)

_STEP_ROWS: Final = 128  # chunk rows per state-scan step (a chunk is 1 or 2 steps)
# Steps of the window whose sequences one state-scan block walks (state_scan_groups), at
# most; fewer where the batch would otherwise leave the GPU idle: its thread blocks should
# fill four per SM of an H100 or H200 (132 SMs).
_WINDOW_STEPS: Final = 16
_FILL_BLOCKS: Final = 4 * 132
_STATE_DIMS_OF_STATE_SCAN: Final = (64, 128)


def state_scan_supports(*, heads_per_group: int, state_dim: int, intermediate: bool) -> bool:
    """Whether the Mosaic state scan takes the call (else the Triton one runs): final
    states only, head pairs within a group, state dims that leave two ring slots in
    shared memory."""
    return (
        not intermediate
        and heads_per_group % CONSUMERS == 0
        and state_dim in _STATE_DIMS_OF_STATE_SCAN
    )


def _state_scan_kernel(
    order_ref,  # [B] int32: the sequences, longest first
    window_ref,  # [B] int32: the window of sorted position j (state_scan_groups)
    group_end_ref,  # [B] int32: the first sorted position past j's window
    first_ref,  # [B] int32: each sequence's first chunk
    count_ref,  # [B] int32: its number of chunks
    cu_ref,  # [max_chunks + 1] int32
    x_ref,  # [T, H, P]
    B_ref,  # [T, G, N]
    weight_ref,  # [H, max_chunks, cs] fp32: exp(cum_end - cum_j) dt'_j
    decay_ref,  # [H, max_chunks] fp32: exp(cum_end), the chunk's decay
    *rest,  # initial_ref [B, H, P, N] (if given), carried_ref, final_ref
    has_initial: bool,
    skip_first_carried: bool,
    heads_per_group: int,
):
    initial_ref = rest[0] if has_initial else None
    carried_ref, final_ref = rest[-2:]
    chunk_size = weight_ref.shape[2]
    state_dim = B_ref.shape[2]
    state_tiles = state_dim // _COLUMNS
    dtype, f32 = x_ref.dtype, jnp.float32
    wgmma_layout = plgpu.Layout.WGMMA
    num_stages = 2
    tile_shape = (ROWS, _COLUMNS)

    def body(b_views, x_views, w_smem, out_views, b_full, x_full, w_full, zeroed, free, init_full):
        b_tiles, b_flat = b_views
        x_tiles, x_flat = x_views
        out_tiles, out_final = out_views
        # The block of sorted position j walks the sequences of j's window, back to back,
        # when j is the window's first; other blocks exit at once.
        j = lax.axis_index("seq")
        window = window_ref[j]
        leads = (j == 0) | (window_ref[jnp.maximum(j - 1, 0)] != window)
        seq_lo, seq_hi = j, jnp.where(leads, group_end_ref[j], j)
        h0 = lax.axis_index("heads") * CONSUMERS
        group = lax.div(h0, heads_per_group)
        wg = lax.axis_index("wg")
        steps_per_chunk = chunk_size // _STEP_ROWS

        def steps_of(b):  # sequence b's (first chunk, number of steps, step -> (chunk, row))
            first = first_ref[b]
            return first, *sequence_steps(
                cu_ref, first, count_ref[b], steps_per_chunk=steps_per_chunk
            )

        def step_rows(step_of, i):  # (chunk, first row, first packed row, live rows)
            c, row0 = step_of(i)
            start = cu_ref[c]
            return c, row0, start + row0, jnp.clip(cu_ref[c + 1] - start - row0, 0, _STEP_ROWS)

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            def load(step, slot):
                c, row0, row, _ = step
                rows = pl.ds(row, _STEP_ROWS)
                for t in range(state_tiles):
                    columns = pl.ds(t * _COLUMNS, _COLUMNS)
                    plgpu.copy_gmem_to_smem(
                        B_ref.at[rows, group, columns],
                        b_flat.at[slot, t],
                        b_full.at[slot * state_tiles + t],
                    )
                w_rows = pl.ds(row0, _STEP_ROWS)
                for k in range(CONSUMERS):
                    h = h0 + k
                    plgpu.copy_gmem_to_smem(
                        x_ref.at[rows, h], x_flat.at[slot, k], x_full.at[slot * CONSUMERS + k]
                    )
                    plgpu.copy_gmem_to_smem(
                        weight_ref.at[h, c, w_rows],
                        w_smem.at[slot, k],
                        w_full.at[slot * CONSUMERS + k],
                    )

            def sequence(position, done):  # `done`: the block's steps before this sequence
                _, num_steps, step_of = steps_of(order_ref[position])
                produce_ring(
                    lambda i, slot: load(step_rows(step_of, i), slot),
                    num_steps,
                    free,
                    num_stages=num_stages,
                    done=done,
                )
                return done + num_steps

            lax.fori_loop(seq_lo, seq_hi, sequence, jnp.int32(0))

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            k = wg
            h = h0 + k
            stage = out_tiles.at[k]  # [2, 64, N] in x's dtype: the carried states' tiles
            final_stage = out_final.at[k]  # [64, N] fp32, the same bytes

            def step(i, states, *, first, step_of, done):
                slot = lax.rem(done + i, num_stages)
                c, row0, _, live = step_rows(step_of, i)
                chunk_start = row0 == 0
                # Without initial states a sequence's first chunk starts from zero: the
                # chunk scan that reads the carried states knows, and none is stored.
                store = chunk_start & (c != first) if skip_first_carried else chunk_start

                @pl.when(store)
                def _store_carried():
                    # The state entering chunk c, in the chunk scan's dtype; the two tiles
                    # alternate, rewritten once the store from two chunks ago read them.
                    tile = stage.at[lax.rem(c - first, 2)]
                    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                    for t in range(state_tiles):
                        tile.at[:, pl.ds(t * _COLUMNS, _COLUMNS)][...] = states[t].astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(tile, carried_ref.at[c, h])

                decay = jnp.where(chunk_start, decay_ref[h, c], 1.0)
                x_tile = x_tiles.at[slot, k]
                plgpu.barrier_wait(x_full.at[slot * CONSUMERS + k])
                plgpu.barrier_wait(w_full.at[slot * CONSUMERS + k])
                # x rows weighted by exp(cum_end - cum_j) dt'_j, rows past the chunk 0
                # (selected: they hold other rows, NaN in tests), in place.
                for r in range(_STEP_ROWS // ROWS):
                    rows = pl.ds(r * ROWS, ROWS)
                    x = plgpu.load(x_tile.at[rows], layout=wgmma_layout).astype(f32)
                    w = plgpu.load(w_smem.at[slot, k, rows], layout=wgmma_layout.reduce(1))
                    row = r * ROWS + plgpu.broadcasted_iota(
                        jnp.int32, tile_shape, 0, layout=wgmma_layout
                    )
                    weighted = x * lax.broadcast_in_dim(w, tile_shape, [0])
                    x_tile.at[rows][...] = jnp.where(row < live, weighted, 0.0).astype(dtype)
                plgpu.commit_smem()
                for t in range(state_tiles):
                    plgpu.barrier_wait(b_full.at[slot * state_tiles + t])

                @pl.when(live < _STEP_ROWS)
                def _zero_past_chunk():
                    # B rows past the chunk: the weighted x is 0 there, but 0 × NaN is
                    # not. Each consumer zeroes its share of B's column tiles.
                    for t in range(state_tiles):

                        @pl.when(t % CONSUMERS == k)
                        def _zero(t=t):
                            for r in range(_STEP_ROWS // ROWS):
                                tile = b_tiles.at[slot, t, pl.ds(r * ROWS, ROWS)]
                                v = plgpu.load(tile, layout=wgmma_layout)
                                row = r * ROWS + plgpu.broadcasted_iota(
                                    jnp.int32, tile_shape, 0, layout=wgmma_layout
                                )
                                tile[...] = jnp.where(row < live, v, jnp.zeros_like(v))

                    plgpu.commit_smem()
                    plgpu.barrier_arrive(zeroed.at[slot])
                    plgpu.barrier_wait(zeroed.at[slot])

                def product(acc_refs):
                    for t in range(state_tiles):
                        plgpu.wgmma(acc_refs[t], x_tile.T, b_tiles.at[slot, t])

                states = [state * decay for state in states]
                states = pl.run_state(product)(tuple(plgpu.ACC.init(state) for state in states))
                plgpu.barrier_arrive(free.at[slot])
                return list(states)

            def sequence(position, done):
                b = order_ref[position]
                first, num_steps, step_of = steps_of(b)
                if initial_ref is None:
                    states = [
                        plgpu.layout_cast(jnp.zeros(tile_shape, f32), wgmma_layout)
                        for _ in range(state_tiles)
                    ]
                else:  # final_stage is free: the last sequence's final state has left it
                    plgpu.copy_gmem_to_smem(initial_ref.at[b, h], final_stage, init_full.at[k])
                    plgpu.barrier_wait(init_full.at[k])
                    states = [
                        plgpu.load(
                            final_stage.at[:, pl.ds(t * _COLUMNS, _COLUMNS)], layout=wgmma_layout
                        ).astype(f32)
                        for t in range(state_tiles)
                    ]
                # A sequence without chunks has no steps: its final state is its initial.
                states = lax.fori_loop(
                    0,
                    num_steps,
                    functools.partial(step, first=first, step_of=step_of, done=done),
                    states,
                )
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for t in range(state_tiles):
                    final_stage.at[:, pl.ds(t * _COLUMNS, _COLUMNS)][...] = states[t]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(final_stage, final_ref.at[b, h])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                return done + num_steps

            lax.fori_loop(seq_lo, seq_hi, sequence, jnp.int32(0))

    tiles = swizzled_tiles(dtype)
    flat = (plgpu.SwizzleTransform(SWIZZLE_BYTES),)
    ring_b = (num_stages, state_tiles, _STEP_ROWS, _COLUMNS)
    ring_x = (num_stages, CONSUMERS, _STEP_ROWS, HEAD_DIM)
    pl.run_scoped(
        body,
        plgpu.RefUnion(
            plgpu.SMEM(ring_b, dtype, transforms=tiles), plgpu.SMEM(ring_b, dtype, transforms=flat)
        ),
        plgpu.RefUnion(
            plgpu.SMEM(ring_x, dtype, transforms=tiles), plgpu.SMEM(ring_x, dtype, transforms=flat)
        ),
        plgpu.SMEM((num_stages, CONSUMERS, _STEP_ROWS), f32),
        # Per consumer: two tiles of carried states (x's dtype) or, the same bytes, one
        # fp32 tile (the initial and the final state).
        plgpu.RefUnion(
            plgpu.SMEM((CONSUMERS, 2, HEAD_DIM, state_dim), dtype, transforms=tiles),
            plgpu.SMEM((CONSUMERS, HEAD_DIM, state_dim), f32, transforms=swizzled_tiles(f32)),
        ),
        plgpu.Barrier(num_barriers=num_stages * state_tiles),
        plgpu.Barrier(num_barriers=num_stages * CONSUMERS),
        plgpu.Barrier(num_barriers=num_stages * CONSUMERS),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=num_stages),
        plgpu.Barrier(num_barriers=CONSUMERS),
        collective_axes="wg",
    )


def sequence_steps(cu, first, count, *, steps_per_chunk: int):
    """The state scan's 128-row steps over one sequence's chunks, none past a chunk's end:
    ``(num_steps, step)``, ``step(i) -> (chunk, row)`` for ``i`` in ``[0, num_steps)``
    (step ``i`` covers rows ``row + [0, 128)`` of the chunk). ``cu``: the chunk starts
    (``cu_chunk_seqlens``, a ref or an array); ``first``/``count``: the sequence's first
    chunk and its number of chunks (``triton_config.sequence_chunks``), int32 scalars.

    Only a sequence's first and last chunks can be short (the others end at multiples of
    the chunk size), so they take ``ceil(rows / 128)`` steps and every other chunk
    ``steps_per_chunk``: a chunk of 128 rows or fewer is one step whatever its size."""

    def steps_of(c):
        return lax.div(cu[c + 1] - cu[c] + _STEP_ROWS - 1, _STEP_ROWS)

    # A sequence without chunks may have first == max_chunks (after the last real chunk):
    # its steps are 0 whatever the lookups give, but they must stay inside cu.
    first = jnp.where(count > 0, first, jnp.minimum(first, cu.shape[0] - 2))
    last = first + jnp.maximum(count, 1) - 1
    head = steps_of(first)  # the first chunk's steps
    middle = jnp.maximum(count - 2, 0) * steps_per_chunk
    tail = jnp.where(count > 1, steps_of(last), 0)
    num_steps = jnp.where(count > 0, head + middle + tail, 0)

    def step(i):
        j = i - head  # steps past the first chunk
        in_middle = (j >= 0) & (j < middle)
        chunk = jnp.where(
            j < 0, first, jnp.where(in_middle, first + 1 + lax.div(j, steps_per_chunk), last)
        )
        row = jnp.where(
            j < 0,
            i,
            jnp.where(in_middle, lax.rem(j, steps_per_chunk), j - middle),
        )
        return chunk, row * _STEP_ROWS

    return num_steps, step


def state_scan_groups(
    s: triton_config.ScanShapes, order: jax.Array, count: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(window, group_end)``, int32 ``[B]`` each, over the sequences in ``order`` (longest
    first): sorted position ``j``'s window is ``start_j // window_steps``, ``start_j`` the
    steps of the positions before it (``steps_per_chunk`` a chunk, an upper bound), and
    ``group_end[j]`` the first position in a later window. The state scan's block of a
    window's first position walks that window's sequences back to back, so short sequences
    share a block (and its TMA ring stays full across their boundaries); a sequence of a
    window or more is alone in its block, and so is each sequence without chunks (a bucket's
    empty slots, sorted last: each only writes its final state). ``window_steps`` is
    ``_WINDOW_STEPS``, or fewer (down to 1: no sharing) where the batch's steps over all
    head pairs would leave fewer than ``_FILL_BLOCKS`` blocks' worth of work per window."""
    count = count[order]
    steps_per_chunk = s.chunk_size // _STEP_ROWS
    steps = count * steps_per_chunk
    end = jnp.cumsum(steps)
    start = end - steps
    head_pairs = s.heads // CONSUMERS
    window_steps = jnp.clip(end[-1] * head_pairs // _FILL_BLOCKS, 1, _WINDOW_STEPS)
    # Past every window of the real sequences' steps (at most max_chunks of them).
    alone = s.max_chunks * steps_per_chunk + 1
    window = jnp.where(count > 0, start // window_steps, alone + jnp.arange(s.num_seqs))
    window = window.astype(jnp.int32)
    return window, search_sorted(window, window + 1, side="left").astype(jnp.int32)


def state_scan(
    s: triton_config.ScanShapes,
    metadata,
    x,
    dt,
    A,
    B,
    dt_bias,
    initial_states,
    *,
    dt_softplus,
    dt_limit,
    intermediate: bool,
    state_dtype,
    carried_dtype,
    blocks=None,
    interpret=False,
    skip_first_carried: bool = False,
):
    """Stage 1 on the tensor cores, :func:`triton.state_scan`'s signature and results (final
    states only, ``state_scan_supports``): dt', cum and the chunk decays from one Triton
    launch (:func:`triton.chunk_decay`), then one thread block per (two heads, sequence),
    longest sequences first (short ones grouped, :func:`state_scan_groups`), walking the
    sequence's chunks in 128-row steps
    (:func:`sequence_steps`: none past a chunk's end): per step a TMA ring slot holds B
    (shared by the two heads) and each head's x; consumer k owns head ``h0 + k``, keeps its
    state ``[P, N]`` in fp32 registers and adds ``(x ∘ w)ᵀ B`` with ``w = exp(cum_end −
    cum_j) dt'_j`` (one wgmma per 64 state columns). ``skip_first_carried`` (no initial
    states): no carried state is written for a sequence's first chunk, where a chunk scan
    given ``first_states_zero`` reads none."""
    del blocks, intermediate
    dt_chunks, cum, weight, decay = triton.chunk_decay(
        s,
        metadata,
        dt,
        A,
        dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        interpret=interpret,
    )
    order, first, count = triton_config.sequence_chunks(s, metadata)
    window, group_end = state_scan_groups(s, order, count)
    initial = None if initial_states is None else initial_states.astype(jnp.float32)
    kernel = plgpu.kernel(
        functools.partial(
            _state_scan_kernel,
            has_initial=initial is not None,
            skip_first_carried=skip_first_carried and initial is None,
            heads_per_group=s.heads // s.groups,
        ),
        out_type=(
            jax.ShapeDtypeStruct((s.max_chunks, s.heads, s.head_dim, s.state_dim), carried_dtype),
            jax.ShapeDtypeStruct((s.num_seqs, s.heads, s.head_dim, s.state_dim), jnp.float32),
        ),
        # The last axis varies fastest: the head pairs of a sequence run side by side and
        # share its B in L2.
        grid=(s.num_seqs, s.heads // CONSUMERS),
        grid_names=("seq", "heads"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        kernel_name=(
            f"ssd_mosaic_state_scan_cs{s.chunk_size}_n{s.state_dim}"
            f"_init{int(initial is not None)}_skip{int(skip_first_carried and initial is None)}"
        ),
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane
        ),
    )
    operands = [] if initial is None else [initial]
    carried, final = kernel(
        order,
        window,
        group_end,
        first,
        count,
        metadata.cu_chunk_seqlens,
        x,
        B,
        weight,
        decay,
        *operands,
    )
    return dt_chunks, cum, carried, final.astype(state_dtype)
