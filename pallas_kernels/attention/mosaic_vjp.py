"""The Mosaic backend's attention backward as Pallas Mosaic GPU kernels (Hopper: wgmma, TMA).

Both kernels start from the ``lse`` the Mosaic forward saves (``mosaic.prefill_attention``
with ``with_lse``) and ``delta = rowsum(dO ∘ O)``, and follow FlashAttention-2's backward
(Dao, arXiv 2307.08691, Algorithm 2) on FlashAttention-3's thread block (Shah et al.,
arXiv 2407.08608): a producer warpgroup streams tiles into a ring of shared-memory slots
with TMA, two consumer warpgroups run the products on the tensor cores with their fp32
accumulators in registers. ``triton_vjp.attention_backward`` calls them (``dq_kernel``,
``dkv_kernel``).

**dK, dV** (``attention_bwd_dkv``): a thread block owns ``CONSUMERS * _BLOCK_K`` keys of
one cache line and one KV head; each consumer holds ``_BLOCK_K`` keys and values in shared
memory, and the producer streams, for every query head of the GQA group, the Q and dO
tiles of the rows whose band meets the keys, with their ``lse`` and ``delta``. Per tile::

    Sᵀ  = K Qᵀ            Pᵀ  = 2^(Sᵀ · sm_scale · log2 e − lse)   (masked: 0)
    dPᵀ = V dOᵀ           dSᵀ = Pᵀ ∘ (dPᵀ − delta)                 (masked: 0)
    dV += Pᵀ dO           dK += dSᵀ Q                              (dK × sm_scale at the end)

``Pᵀ`` and ``dSᵀ`` are the left operands of the last two as they leave the first two, in
registers, and dK, dV come out summed over the group's heads with no second pass. Only
the tiles on the band's edges, at ``kv_len`` and at the row range's ends are masked.

**dQ** (``attention_bwd_dq``): the forward's items and KV ring (:func:`mosaic_common.plan`,
:func:`mosaic_common.produce_kv_ring`); each consumer holds its 64 rows' Q, dO, ``lse`` and
``delta`` and accumulates ``dQ += dS K`` over the forward's KV blocks, masked as the
forward masks them.

Layout and masking follow the forward: Q tiles start at rows that are multiples of 8 (TMA
reads tiled tiles only there), so a tile may hold rows of neighbouring sequences; a row
outside the range, a key at or past ``kv_len`` and a pair outside the band get ``P = dS =
0`` by selection, and the dQ kernel zeroes the key rows past ``kv_len`` in shared memory
before ``dS K`` (``0 · NaN`` is NaN), so cache tails (NaN in tests) never reach a
gradient. dK and dV go to gradient lines that are written whole (zeros where nothing is
read): one per slot for contiguous caches (the cache gradients themselves), one per
sequence for paged ones (the caller adds them into the pages). ``lse`` and ``delta`` come
in head-major ``[Hq, T]`` so a tile's entries are contiguous (one TMA copy each).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Final

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels._common import checked_slots
from pallas_kernels._mosaic import (
    CONSUMER_REGISTERS,
    PRODUCER_REGISTERS,
    TMA_ROWS,
    produce_ring,
    store_rows,
    swizzled_tiles,
)
from pallas_kernels.attention import mosaic_common
from pallas_kernels.attention._layout import backward_scale_operand, band_operand
from pallas_kernels.attention.mosaic_common import CONSUMERS

# Keys of each of the CONSUMERS consumer warpgroups of a dK/dV thread block (the wgmma M
# dimension of the dK and dV products).
_BLOCK_K: Final = 64
# Query rows per step (the N dimension of Sᵀ and dPᵀ, the K dimension of dV and dK).
_BLOCK_Q: Final = 64
_STAGES: Final = 2  # Q/dO/lse/delta slots in the ring
_KEYS_PER_BLOCK: Final = CONSUMERS * _BLOCK_K


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
    """The kernel's work, one entry per item (``_KEYS_PER_BLOCK`` keys of one gradient
    line) in launch order, most query tiles first. All fields int32 ``[I]``; ``table`` is
    the sequence's block table row ``[I, max_blocks]`` when paged."""

    line: jax.Array  # gradient line written (contiguous: the slot; paged: the sequence)
    key0: jax.Array  # first key of the item
    kv_len: jax.Array  # keys of the line's sequence (0: none, the line is zeros)
    offset: jax.Array  # packed row r of the sequence sits at position r + offset
    row_lo: jax.Array  # rows [row_lo, row_hi) see some key of the item
    row_hi: jax.Array
    row_base: jax.Array  # first row of the first Q tile: row_lo rounded down to 8
    num_tiles: jax.Array  # Q tiles per query head (0: the item's lines are zeros)
    table: jax.Array | None = None


def plan(
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    band: jax.Array,
    *,
    num_tokens: int,
    num_slots: int,
    cache_len: int,
    block_table: jax.Array | None = None,
) -> Plan:
    """The kernel's :class:`Plan` (jittable): items ``(line, key block j)``, and the rows
    ``start - right <= pos <= start + _KEYS_PER_BLOCK - 2 + left`` of the line's sequence
    for each, sorted by work. Contiguous caches have a line per slot (the gradient of the
    slot's sequence, zeros for a slot no sequence names), paged ones a line per sequence."""
    num_seqs = slot_ids.shape[0]
    if block_table is None:
        slot = checked_slots(slot_ids, num_slots)
        seq_of_line = jnp.full((num_slots,), -1, jnp.int32)
        seq_of_line = seq_of_line.at[jnp.where(slot >= 0, slot, num_slots)].set(
            jnp.arange(num_seqs, dtype=jnp.int32), mode="drop"
        )
    else:
        seq_of_line = jnp.where(slot_ids >= 0, jnp.arange(num_seqs, dtype=jnp.int32), -1)
    key_blocks = pl.cdiv(cache_len, _KEYS_PER_BLOCK)
    item = jnp.arange(seq_of_line.shape[0] * key_blocks, dtype=jnp.int32)
    line, key0 = item // key_blocks, item % key_blocks * _KEYS_PER_BLOCK
    seq = jnp.maximum(seq_of_line[line], 0)
    qsl = jnp.clip(query_start_loc, 0, num_tokens).astype(jnp.int32)
    seq_start, seq_end = qsl[:-1][seq], qsl[1:][seq]
    q_len = (query_start_loc[1:] - query_start_loc[:-1])[seq]
    offset = (kv_lens[seq] - q_len - query_start_loc[:-1][seq]).astype(jnp.int32)
    live = (seq_of_line[line] >= 0) & (key0 < kv_lens[seq])
    kv_len = jnp.where(live, jnp.clip(kv_lens[seq], 0, cache_len), 0)
    left, right = band[0], band[1]
    row_lo = jnp.clip(key0 - right - offset, seq_start, seq_end)
    row_hi = jnp.clip(key0 + _KEYS_PER_BLOCK - 1 + left - offset, row_lo, seq_end)
    row_base = row_lo - row_lo % TMA_ROWS
    num_tiles = jnp.where(live & (row_hi > row_lo), pl.cdiv(row_hi - row_base, _BLOCK_Q), 0)
    item_plan = Plan(
        line=line,
        key0=key0,
        kv_len=kv_len,
        offset=offset,
        row_lo=row_lo,
        row_hi=row_hi,
        row_base=row_base,
        num_tiles=num_tiles,
        table=None if block_table is None else block_table[seq],
    )
    order = jnp.argsort(-num_tiles, stable=True)
    return jax.tree.map(lambda field: field.astype(jnp.int32)[order], item_plan)


def _dkv_kernel(
    plan: Plan,
    scale_ref,  # [2] fp32: (sm_scale * log2(e), sm_scale)
    band_ref,  # [2] int32: (left, right)
    q_ref,  # [T, Hq, D]
    k_ref,  # [S, L, Hkv, D] (paged: [num_blocks, page_size, Hkv, D])
    v_ref,  # like k_ref
    do_ref,  # [T, Hq, D]
    lse_ref,  # [Hq, T] fp32
    delta_ref,  # [Hq, T] fp32
    dk_ref,  # [lines, L', Hkv, D]: one line per slot (contiguous) or per sequence (paged)
    dv_ref,  # like dk_ref
    *,
    group: int,
):
    head_dim = q_ref.shape[2]
    dtype = q_ref.dtype
    tiles = swizzled_tiles(dtype)
    f32 = jnp.float32

    def body(k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, k_full, v_full, *ring):
        q_full, do_full, lse_full, delta_full, free = ring
        item = lax.axis_index("item")
        h = lax.axis_index("head")
        wg = lax.axis_index("wg")
        num_tiles = plan.num_tiles[item]
        num_steps = num_tiles * group
        row_base = plan.row_base[item]

        def step_rows(s):
            """(query head, first row) of step s: heads outer, tiles inner."""
            g = lax.div(s, jnp.maximum(num_tiles, 1))
            return h * group + g, row_base + (s - g * num_tiles) * _BLOCK_Q

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            def load(s, slot):
                head, row0 = step_rows(s)
                rows = pl.ds(row0, _BLOCK_Q)
                plgpu.copy_gmem_to_smem(q_ref.at[rows, head], q_smem.at[slot], q_full.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[rows, head], do_smem.at[slot], do_full.at[slot])
                plgpu.copy_gmem_to_smem(
                    lse_ref.at[head, rows], lse_smem.at[slot], lse_full.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    delta_ref.at[head, rows], delta_smem.at[slot], delta_full.at[slot]
                )

            produce_ring(load, num_steps, free, num_stages=_STAGES)

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            c = wg
            key0 = plan.key0[item] + c * _BLOCK_K
            kv_len, offset = plan.kv_len[item], plan.offset[item]
            row_lo, row_hi = plan.row_lo[item], plan.row_hi[item]
            qk_scale, sm_scale = scale_ref[0], scale_ref[1]
            left, right = band_ref[0], band_ref[1]
            k_tile, v_tile = k_smem.at[c], v_smem.at[c]
            if plan.table is None:
                line, row = plan.line[item], key0  # the slot's line
            else:  # the page of the consumer's keys (block_k divides the page), clamped
                page_size = k_ref.shape[1]
                column = jnp.minimum(lax.div(key0, page_size), plan.table.shape[1] - 1)
                page = plan.table[item, column]
                line, row = jnp.clip(page, 0, k_ref.shape[0] - 1), lax.rem(key0, page_size)

            @pl.when(num_steps > 0)
            def _load_kv():
                keys = pl.ds(row, _BLOCK_K)
                plgpu.copy_gmem_to_smem(k_ref.at[line, keys, h], k_tile, k_full.at[c])
                plgpu.copy_gmem_to_smem(v_ref.at[line, keys, h], v_tile, v_full.at[c])
                plgpu.barrier_wait(k_full.at[c])
                plgpu.barrier_wait(v_full.at[c])

            shape = (_BLOCK_K, _BLOCK_Q)
            key = key0 + plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA)
            column = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)

            def step(s, carry, *, masked):
                dk, dv = carry
                slot = lax.rem(s, _STAGES)
                _, row0 = step_rows(s)
                q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
                plgpu.barrier_wait(q_full.at[slot])

                def scores(acc_ref):
                    plgpu.wgmma(acc_ref, k_tile, q_tile.transpose((1, 0)))
                    return acc_ref[...]

                s_t = pl.run_scoped(scores, plgpu.ACC(shape, f32))
                plgpu.barrier_wait(lse_full.at[slot])
                lse = plgpu.load(lse_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                p_t = jnp.exp2(s_t * qk_scale - lax.broadcast_in_dim(lse, shape, [1]))
                if masked:
                    row = row0 + column
                    pos = row + offset
                    visible = (row >= row_lo) & (row < row_hi) & (key < kv_len)
                    visible &= (key <= pos + right) & (key > pos - left)
                    p_t = jnp.where(visible, p_t, 0.0)
                plgpu.barrier_wait(do_full.at[slot])

                def dv_and_dp(refs):
                    # Both products in one block: one wgmma wait instead of two.
                    dv_ref_, dp_ref = refs
                    plgpu.wgmma(dv_ref_, p_t.astype(dtype), do_tile)
                    plgpu.wgmma(dp_ref, v_tile, do_tile.transpose((1, 0)))

                zeros = plgpu.layout_cast(jnp.zeros(shape, f32), plgpu.Layout.WGMMA)
                dv, dp_t = pl.run_state(dv_and_dp)((plgpu.ACC.init(dv), plgpu.ACC.init(zeros)))
                plgpu.barrier_wait(delta_full.at[slot])
                delta = plgpu.load(delta_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                ds_t = p_t * (dp_t - lax.broadcast_in_dim(delta, shape, [1]))
                if masked:
                    # Selected, not multiplied: a NaN value row (cache tail) makes dPᵀ NaN.
                    ds_t = jnp.where(visible, ds_t, 0.0)

                def dk_product(acc_ref):
                    plgpu.wgmma(acc_ref, ds_t.astype(dtype), q_tile)

                dk = pl.run_state(dk_product)(plgpu.ACC.init(dk))
                plgpu.barrier_arrive(free.at[slot])
                return dk, dv

            # Tiles whose rows all see every key of this consumer (rows [full_lo, full_hi),
            # keys below kv_len) need no mask: the interior of each head's tiles.
            full_lo = jnp.maximum(row_lo, key0 + _BLOCK_K - 1 - right - offset)
            full_hi = jnp.minimum(row_hi, key0 + left - offset)
            full_hi = jnp.where(key0 + _BLOCK_K <= kv_len, full_hi, full_lo)
            # (full_lo >= row_base; a negative full_hi - row_base truncates to 0 = mid_lo.)
            mid_lo = jnp.minimum(lax.div(full_lo - row_base + _BLOCK_Q - 1, _BLOCK_Q), num_tiles)
            mid_hi = jnp.clip(lax.div(full_hi - row_base, _BLOCK_Q), mid_lo, num_tiles)
            masked_step = functools.partial(step, masked=True)

            def head(g, carry):  # steps [g * num_tiles, (g + 1) * num_tiles)
                first = g * num_tiles
                carry = lax.fori_loop(first, first + mid_lo, masked_step, carry)
                carry = lax.fori_loop(
                    first + mid_lo, first + mid_hi, functools.partial(step, masked=False), carry
                )
                return lax.fori_loop(first + mid_hi, first + num_tiles, masked_step, carry)

            zeros = plgpu.layout_cast(jnp.zeros((_BLOCK_K, head_dim), f32), plgpu.Layout.WGMMA)
            dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
            # The key tiles are free now: they stage the gradients for the TMA stores.
            k_tile[...] = (dk * sm_scale).astype(dtype)
            v_tile[...] = dv.astype(dtype)
            plgpu.commit_smem()
            where = (plan.line[item], pl.ds(key0, _BLOCK_K), h)
            plgpu.copy_smem_to_gmem(k_tile, dk_ref.at[where])
            plgpu.copy_smem_to_gmem(v_tile, dv_ref.at[where])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(
        body,
        plgpu.SMEM((CONSUMERS, _BLOCK_K, head_dim), dtype, transforms=tiles),
        plgpu.SMEM((CONSUMERS, _BLOCK_K, head_dim), dtype, transforms=tiles),
        plgpu.SMEM((_STAGES, _BLOCK_Q, head_dim), dtype, transforms=tiles),
        plgpu.SMEM((_STAGES, _BLOCK_Q, head_dim), dtype, transforms=tiles),
        plgpu.SMEM((_STAGES, _BLOCK_Q), jnp.float32),
        plgpu.SMEM((_STAGES, _BLOCK_Q), jnp.float32),
        plgpu.Barrier(num_barriers=CONSUMERS),
        plgpu.Barrier(num_barriers=CONSUMERS),
        plgpu.Barrier(num_barriers=_STAGES),
        plgpu.Barrier(num_barriers=_STAGES),
        plgpu.Barrier(num_barriers=_STAGES),
        plgpu.Barrier(num_barriers=_STAGES),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=_STAGES),
        collective_axes="wg",
    )


def dkv_gradients(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    *,
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    block_table: jax.Array | None = None,
    causal: bool | jax.Array,
    sm_scale: float | jax.Array,
    sliding_window: int | jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """``(dk, dv)`` from ``dout[T, Hq, D]``, ``lse[T, Hq]`` and ``delta[T, Hq]`` fp32:
    contiguous, ``[S, L, Hkv, D]`` like the caches; paged, per-sequence lines
    ``[B, max_blocks * page_size, Hkv, D]`` (the Triton dK/dV kernel's layouts). Keys no
    row sees get 0. The call must be one the Mosaic forward supports
    (``mosaic_config.supports``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_slots, cache_len, num_kv_heads = k_cache.shape[:3]
    num_lines = num_slots
    if block_table is not None:
        cache_len *= block_table.shape[1]
        num_lines = slot_ids.shape[0]
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
        block_table=block_table,
    )
    # Lines as long as the items' key blocks: every TMA store lands inside.
    key_blocks = pl.cdiv(cache_len, _KEYS_PER_BLOCK)
    line_shape = (num_lines, key_blocks * _KEYS_PER_BLOCK, num_kv_heads, head_dim)
    line = jax.ShapeDtypeStruct(line_shape, k_cache.dtype)
    scales = backward_scale_operand(sm_scale)

    def attention_bwd_dkv(*refs):
        _dkv_kernel(*refs, group=num_q_heads // num_kv_heads)

    kernel = plgpu.kernel(
        attention_bwd_dkv,
        out_type=(line, line),
        # The last axis varies fastest: every KV head of the busiest items first.
        grid=(key_blocks * num_lines, num_kv_heads),
        grid_names=("item", "head"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        kernel_name=(
            f"attention_bwd_dkv_mosaic_bq{_BLOCK_Q}_bk{_BLOCK_K}_g{num_q_heads // num_kv_heads}"
            f"_d{head_dim}{'' if block_table is None else f'_paged{k_cache.shape[1]}'}"
        ),
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane
        ),
    )
    dk, dv = kernel(
        item_plan,
        scales,
        band,
        q,
        k_cache,
        v_cache,
        dout.astype(q.dtype),
        lse.T,
        delta.T,
    )
    if line_shape[1] != cache_len:
        dk, dv = dk[:, :cache_len], dv[:, :cache_len]
    return dk, dv


# ----------------------------------------------------------------------------------- dQ


def _dq_kernel(
    plan: mosaic_common.Plan,  # the forward's, built with block_q=_BLOCK_Q, block_k=_BLOCK_K
    scale_ref,  # [2] fp32: (sm_scale * log2(e), sm_scale)
    band_ref,  # [2] int32: (left, right)
    q_ref,  # [T, Hq, D]
    k_ref,  # [S, L, Hkv, D] (paged: [num_blocks, page_size, Hkv, D])
    v_ref,  # like k_ref
    do_ref,  # [T, Hq, D]
    lse_ref,  # [Hq, T] fp32
    delta_ref,  # [Hq, T] fp32
    dq_ref,  # [T, Hq, D]
    *,
    group: int,
):
    head_dim = q_ref.shape[2]
    dtype = q_ref.dtype
    tiles = swizzled_tiles(dtype)
    f32 = jnp.float32

    def body(q_smem, do_smem, dq_smem, lse_smem, delta_smem, k_smem, v_smem, *barriers):
        q_full, do_full, lse_full, delta_full, k_full, v_full, k_free, v_free = barriers
        item = lax.axis_index("item")
        head = lax.axis_index("head")
        wg = lax.axis_index("wg")
        kv_head = head // group
        kv_lo, kv_hi = plan.kv_lo[item], plan.kv_hi[item]

        @pl.when(wg == CONSUMERS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
            mosaic_common.produce_kv_ring(
                plan,
                item,
                (k_ref, v_ref),
                (k_smem, v_smem),
                (k_full, v_full),
                (k_free, v_free),
                kv_head=kv_head,
                block_k=_BLOCK_K,
            )

        @pl.when(wg < CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            c = wg
            work = mosaic_common.ConsumerWork.of(plan, item, c, _BLOCK_Q)
            row0, pos0, first, live = work.row0, work.pos0, work.first, work.live
            lo_blk, mid_lo, mid_hi, hi_blk = work.lo_blk, work.mid_lo, work.mid_hi, work.hi_blk
            kv_len = plan.kv_len[item]
            q_tile, do_tile = q_smem.at[c], do_smem.at[c]
            left, right = band_ref[0], band_ref[1]
            qk_scale, sm_scale = scale_ref[0], scale_ref[1]
            rows = pl.ds(row0, _BLOCK_Q)

            @pl.when((plan.slot[item] >= 0) & (lo_blk < hi_blk))
            def _load_rows():
                plgpu.copy_gmem_to_smem(q_ref.at[rows, head], q_tile, q_full.at[c])
                plgpu.copy_gmem_to_smem(do_ref.at[rows, head], do_tile, do_full.at[c])
                plgpu.copy_gmem_to_smem(lse_ref.at[head, rows], lse_smem.at[c], lse_full.at[c])
                plgpu.copy_gmem_to_smem(
                    delta_ref.at[head, rows], delta_smem.at[c], delta_full.at[c]
                )
                for full in (q_full, do_full, lse_full, delta_full):
                    plgpu.barrier_wait(full.at[c])

            lse = plgpu.load(lse_smem.at[c], layout=plgpu.Layout.WGMMA.reduce(1))
            delta = plgpu.load(delta_smem.at[c], layout=plgpu.Layout.WGMMA.reduce(1))
            shape = (_BLOCK_Q, _BLOCK_K)

            def release(j, carry):
                slot = lax.rem(j - kv_lo, _STAGES)
                plgpu.barrier_wait(k_full.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_wait(v_full.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                return carry

            def step(j, dq, *, masked):
                slot = lax.rem(j - kv_lo, _STAGES)
                k_tile, v_tile = k_smem.at[slot], v_smem.at[slot]
                plgpu.barrier_wait(k_full.at[slot])

                def scores(acc_ref):
                    plgpu.wgmma(acc_ref, q_tile, k_tile.transpose((1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC(shape, f32))
                p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(lse, shape, [0]))
                if masked:
                    pos = pos0 + plgpu.broadcasted_iota(
                        jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA
                    )
                    key = j * _BLOCK_K + plgpu.broadcasted_iota(
                        jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA
                    )
                    visible = (key < kv_len) & (key <= pos + right) & (key > pos - left)
                    p = jnp.where(visible, p, 0.0)
                plgpu.barrier_wait(v_full.at[slot])

                def dp_product(acc_ref):
                    plgpu.wgmma(acc_ref, do_tile, v_tile.transpose((1, 0)))
                    return acc_ref[...]

                dp = pl.run_scoped(dp_product, plgpu.ACC(shape, f32))
                plgpu.barrier_arrive(v_free.at[slot])
                ds = p * (dp - lax.broadcast_in_dim(delta, shape, [0]))
                if masked:
                    # Selected, not multiplied (a NaN value row makes dP NaN); key rows at
                    # or past kv_len hold the cache tail (NaN in tests) and 0 · NaN is NaN
                    # inside the product: both consumers zero them (the same zeros).
                    ds = jnp.where(visible, ds, 0.0)

                    @pl.when((j + 1) * _BLOCK_K > kv_len)
                    def _zero_tail():
                        k = plgpu.load(k_tile, layout=plgpu.Layout.WGMMA)
                        key_row = j * _BLOCK_K + plgpu.broadcasted_iota(
                            jnp.int32, k.shape, 0, layout=plgpu.Layout.WGMMA
                        )
                        k_tile[...] = jnp.where(key_row < kv_len, k, jnp.zeros_like(k))
                        plgpu.commit_smem()

                def dq_product(acc_ref):
                    plgpu.wgmma(acc_ref, ds.astype(dtype), k_tile)

                dq = pl.run_state(dq_product)(plgpu.ACC.init(dq))
                plgpu.barrier_arrive(k_free.at[slot])
                return dq

            dq = plgpu.layout_cast(jnp.zeros((_BLOCK_Q, head_dim), f32), plgpu.Layout.WGMMA)
            lax.fori_loop(kv_lo, lo_blk, release, None)
            dq = lax.fori_loop(lo_blk, mid_lo, functools.partial(step, masked=True), dq)
            dq = lax.fori_loop(mid_lo, mid_hi, functools.partial(step, masked=False), dq)
            dq = lax.fori_loop(mid_hi, hi_blk, functools.partial(step, masked=True), dq)
            lax.fori_loop(hi_blk, kv_hi, release, None)
            # Stored: the rows this consumer owns (zeros for rows with no visible key and
            # for items with nothing to do), from an untiled tile (the stores of a few rows
            # start at any row).
            dq_tile = dq_smem.at[c]
            dq_tile[...] = (dq * sm_scale).astype(dtype)
            plgpu.commit_smem()
            store_rows(dq_tile, dq_ref, row0=row0, first=first, live=live, head=head)

    pl.run_scoped(
        body,
        plgpu.SMEM((CONSUMERS, _BLOCK_Q, head_dim), dtype, transforms=tiles),
        plgpu.SMEM((CONSUMERS, _BLOCK_Q, head_dim), dtype, transforms=tiles),
        plgpu.SMEM((CONSUMERS, _BLOCK_Q, head_dim), dtype),
        plgpu.SMEM((CONSUMERS, _BLOCK_Q), jnp.float32),
        plgpu.SMEM((CONSUMERS, _BLOCK_Q), jnp.float32),
        plgpu.SMEM((_STAGES, _BLOCK_K, head_dim), dtype, transforms=tiles),
        plgpu.SMEM((_STAGES, _BLOCK_K, head_dim), dtype, transforms=tiles),
        plgpu.Barrier(num_barriers=CONSUMERS),
        plgpu.Barrier(num_barriers=CONSUMERS),
        plgpu.Barrier(num_barriers=CONSUMERS),
        plgpu.Barrier(num_barriers=CONSUMERS),
        plgpu.Barrier(num_barriers=_STAGES),
        plgpu.Barrier(num_barriers=_STAGES),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=_STAGES),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=_STAGES),
        collective_axes="wg",
    )


def dq_gradient(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    *,
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    block_table: jax.Array | None = None,
    causal: bool | jax.Array,
    sm_scale: float | jax.Array,
    sliding_window: int | jax.Array | None,
) -> jax.Array:
    """``dq[T, Hq, D]`` from ``dout[T, Hq, D]``, ``lse[T, Hq]`` and ``delta[T, Hq]`` fp32,
    on the forward's items (:func:`mosaic_common.plan`): each consumer holds its 64 query rows'
    Q, dO, lse and delta and walks the forward's KV blocks, ``dQ += dS K`` with ``P`` and
    ``dS`` recomputed. Rows of padding sequences and past the sequences get 0. The call
    must be one the Mosaic forward supports (``mosaic_config.supports``)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_slots, cache_len, num_kv_heads = k_cache.shape[:3]
    if block_table is not None:
        cache_len *= block_table.shape[1]
        block_table = block_table.astype(jnp.int32)
    band = band_operand(causal, sliding_window)
    item_plan = mosaic_common.plan(
        query_start_loc,
        kv_lens,
        slot_ids,
        band,
        num_tokens=num_tokens,
        num_slots=num_slots,
        cache_len=cache_len,
        block_q=_BLOCK_Q,
        block_k=_BLOCK_K,
        block_table=block_table,
    )
    scales = backward_scale_operand(sm_scale)

    def attention_bwd_dq(*refs):
        _dq_kernel(*refs, group=num_q_heads // num_kv_heads)

    kernel = plgpu.kernel(
        attention_bwd_dq,
        out_type=jax.ShapeDtypeStruct(q.shape, q.dtype),
        # The last axis varies fastest: the heads of an item (those sharing a KV head
        # adjacent) side by side, items longest first.
        grid=(item_plan.num_items, num_q_heads),
        grid_names=("item", "head"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        kernel_name=(
            f"attention_bwd_dq_mosaic_bq{_BLOCK_Q}_bk{_BLOCK_K}_g{num_q_heads // num_kv_heads}"
            f"_d{head_dim}{'' if block_table is None else f'_paged{k_cache.shape[1]}'}"
        ),
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane
        ),
    )
    return kernel(
        item_plan, scales, band, q, k_cache, v_cache, dout.astype(q.dtype), lse.T, delta.T
    )
