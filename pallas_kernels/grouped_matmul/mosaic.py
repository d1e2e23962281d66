"""Grouped (MoE expert) matmul as a Pallas Mosaic GPU kernel (Hopper: wgmma, TMA).

``y[r] = x[r] @ w[e]`` for the rows ``r`` of expert ``e`` (``jax.lax.ragged_dot``
semantics), fp32 accumulation, bf16/fp16 operands.

A persistent, warp-specialised grouped GEMM (the Hopper GEMM of CUTLASS 3 /
FlashAttention-3, arXiv 2407.08608, section 3.1, applied to the grouped GEMM of
MegaBlocks, arXiv 2211.15841, section 5):

1. Tile schedule, in the wrapper (:func:`plan`; ``jax.numpy``, jittable, no host sync):
   each expert's rows are cut into *items* of ``block_m`` rows counted from the expert's
   first row rounded down to a multiple of 8 (TMA reads tiled shared-memory tiles only at
   8-row offsets), so an item holds one expert's rows, plus up to 7 leading rows of the
   previous expert that it computes and drops. Rows past ``sum(group_sizes)`` form items
   of their own (``group = -1``) that store zeros and load nothing. A *unit* of work is
   one item times ``_CONSUMERS * block_n`` output columns.
2. One thread block per SM loops over the units ``sm, sm + num_sms, ...`` (columns
   fastest: the units in flight share an item's rows of ``x`` and an expert's ``w`` in L2).
   A producer warpgroup streams ``x[rows, k-step]`` and ``w[e, k-step, cols]`` with TMA
   into a ring of ``num_stages`` shared-memory slots, running ahead across units; two
   consumer warpgroups, each owning ``block_n`` of the unit's columns, issue ``wgmma``
   into fp32 registers and hand a slot back once the tensor cores are done with it
   ("full"/"free" barriers, as in ``attention/mosaic.py``). The producer fills the next
   unit's slots while the consumers run their epilogue.
3. Epilogue: the accumulator goes to shared memory in 64-row chunks and out through TMA
   stores of exactly the item's rows, a ladder of power-of-two row counts (TMA boxes are
   static), so no item writes another expert's rows. ``block_n`` divides N: a store box
   never straddles N. (Mosaic issues a one-row store as a plain bulk copy, clamped only
   at the end of the buffer, so a straddling one-row box would spill into the next row:
   measured on an H200, jax 0.11.2, N = 1856 with ``block_n = 128``.)

Worked example of :func:`plan`, ``block_m = 16``, ``group_sizes = [20, 0, 5]``, ``M = 32``::

    rows    0 .. 15 | 16 .. 19 | 20 .. 24 | 25 .. 31
    expert  0         0          2          (past sum = 25: zeros)
    item    0         1          2          3
    row0    0         16         16         24      (multiples of 8; rows 16..19 of
    first   0         0          4          1        item 2 are expert 0's: computed,
    live    16        4          5          7        dropped)
    group   0         0          2          -1

Serves bf16/fp16 ``x`` and ``w`` with K and N multiples of 64 and M a multiple of 8
(:func:`supports`); fp32 and other shapes go to the Triton kernel.
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

from pallas_kernels._mosaic import (
    CONSUMER_REGISTERS,
    PRODUCER_REGISTERS,
    SWIZZLE_BYTES,
    TMA_ROWS,
    swizzled_tiles,
)
from pallas_kernels._validation import check_int_fields
from pallas_kernels.backend import device_num_sms

# Consumer warpgroups per thread block; each owns block_n of a unit's columns.
_CONSUMERS: Final = 2
# fp32 accumulator registers per consumer thread that leave room for addresses and the
# epilogue within CONSUMER_REGISTERS: block_m * block_n / 128 threads.
_MAX_ACC_REGISTERS: Final = 128
_THREADS_PER_WARPGROUP: Final = 128
_OPERAND_BYTES: Final = 2  # bf16 / fp16
_SWIZZLE_ELEMS: Final = SWIZZLE_BYTES // _OPERAND_BYTES  # 16-bit columns of a swizzled tile
# Rows of one wgmma instruction, and of one epilogue chunk.
_WGMMA_ROWS: Final = 64
# Shared memory of one thread block on Hopper (H100/H200: 227 KiB), less room for the
# barriers.
_MAX_SMEM: Final = 227 * 1024 - 1024
_DTYPES: Final = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Rows per expert (on average) from which a call is bound by the tensor cores; below it
# streams expert weights, which the Triton kernel does faster on an H200 (256 routed
# tokens, Granite-4.0-H-Small gate-up / down: Triton 0.24 / 0.14 ms, this kernel at best
# 0.38 / 0.24 ms), so supports() leaves those calls to it.
_COMPUTE_BOUND_ROWS: Final = 128


def smem_bytes(block_m: int, block_n: int, block_k: int, num_stages: int) -> int:
    """Shared memory of one thread block: the ring of x and w slots plus the consumers'
    64-row output chunks."""
    stage = (block_m * block_k + _CONSUMERS * block_k * block_n) * _OPERAND_BYTES
    out = _CONSUMERS * _WGMMA_ROWS * block_n * _OPERAND_BYTES
    return num_stages * stage + out


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the Mosaic GPU grouped matmul."""

    block_m: int = 128  # rows of an item (both consumers' wgmma M dimension)
    block_n: int = 128  # output columns per consumer warpgroup (a unit has 2 * block_n)
    block_k: int = 64  # contraction step: one TMA slot of x and w
    num_stages: int = 4  # slots in the TMA ring

    def __post_init__(self):
        check_int_fields(self)
        if self.block_m % _WGMMA_ROWS or self.block_m < _WGMMA_ROWS:
            raise ValueError(f"block_m={self.block_m} must be a multiple of {_WGMMA_ROWS}")
        if self.block_n % _SWIZZLE_ELEMS or not _SWIZZLE_ELEMS <= self.block_n <= 256:
            raise ValueError(
                f"block_n={self.block_n} must be a multiple of {_SWIZZLE_ELEMS} in "
                f"[{_SWIZZLE_ELEMS}, 256] (a wgmma N and a TMA box)"
            )
        if self.block_k % _SWIZZLE_ELEMS or not _SWIZZLE_ELEMS <= self.block_k <= 256:
            raise ValueError(
                f"block_k={self.block_k} must be a multiple of {_SWIZZLE_ELEMS} in "
                f"[{_SWIZZLE_ELEMS}, 256]"
            )
        acc = self.block_m * self.block_n // _THREADS_PER_WARPGROUP
        if acc > _MAX_ACC_REGISTERS:
            raise ValueError(
                f"block_m={self.block_m} x block_n={self.block_n} needs {acc} fp32 "
                f"accumulator registers per thread, more than {_MAX_ACC_REGISTERS}"
            )
        if self.num_stages < 2:
            raise ValueError(f"num_stages={self.num_stages} must be >= 2")
        smem = smem_bytes(self.block_m, self.block_n, self.block_k, self.num_stages)
        if smem > _MAX_SMEM:
            raise ValueError(
                f"block_m={self.block_m}, block_n={self.block_n}, block_k={self.block_k}, "
                f"num_stages={self.num_stages} need {smem} bytes of shared memory, "
                f"more than {_MAX_SMEM}"
            )


def default_block_sizes(m: int, k: int, n: int, num_experts: int, dtype) -> BlockSizes:
    """Heuristic tiling for ``x[m, k] @ w[num_experts, k, n]`` (measured on an H200).

    * 128-row items and 2 x 128 columns per unit (the Hopper GEMM tile) with 4 ring slots
      where 128 divides N; else 64 columns per consumer (``block_n`` must divide N) and
      the shared memory this frees as 6 slots. Prefill, 8192 tokens: Granite-4.0-H-Small
      gate-up / down 563 / 426 TFLOP/s, Nemotron-3-Nano 406 / 412 (81 / 73 / 69 / 67 %
      of a dense matmul of equal FLOPs); 64-row items lost 10-30 % there (more K steps per
      FLOP, and the items' ``first``/tail rows cost relatively more).
    """
    del m, k, num_experts, dtype  # compute-bound 16-bit calls only (supports)
    wide = n % 128 == 0
    if wide:
        return BlockSizes(block_m=128, block_n=128, block_k=64, num_stages=4)
    return BlockSizes(block_m=128, block_n=64, block_k=64, num_stages=6)


def supports(x: jax.Array, w: jax.Array, group_sizes: jax.Array, **_) -> str | None:
    """Why the Mosaic GPU kernel cannot take this call (None: it can). Static facts only:
    shapes and dtypes."""
    del group_sizes
    if jnp.dtype(x.dtype) not in _DTYPES:
        return f"x is {jnp.dtype(x.dtype).name}; the wgmma kernel takes bf16 or fp16"
    if w.dtype != x.dtype:
        return f"w is {jnp.dtype(w.dtype).name}, x is {jnp.dtype(x.dtype).name}; they must match"
    (m, k), (num_experts, _, n) = x.shape, w.shape
    if m < _COMPUTE_BOUND_ROWS * num_experts:
        return (
            f"M={m} rows over E={num_experts} experts is a weight-streaming call (fewer than "
            f"{_COMPUTE_BOUND_ROWS} rows per expert): the Triton kernel serves it faster"
        )
    if k % _SWIZZLE_ELEMS:
        return f"K={k} must be a multiple of {_SWIZZLE_ELEMS} (the kernel's K step)"
    # TMA views x in tiles of 8 rows, and rows of w and y must be 16-byte aligned.
    if n % _SWIZZLE_ELEMS:
        return f"N={n} must be a multiple of {_SWIZZLE_ELEMS} (the narrowest block_n)"
    # TMA views x in tiles of 8 rows.
    if m % TMA_ROWS:
        return f"M={m} must be a multiple of {TMA_ROWS}"
    return None


def check_block_sizes(config: BlockSizes, x: jax.Array, w: jax.Array, *_, **__) -> None:
    """``block_k`` must divide K (the K loop has no tail) and ``block_n`` must divide N (no
    store box straddles N; see the module docstring)."""
    k, n = x.shape[1], w.shape[2]
    if k % config.block_k:
        raise ValueError(f"config.block_k={config.block_k} must divide K={k}")
    if n % config.block_n:
        raise ValueError(f"config.block_n={config.block_n} must divide N={n}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
    """The kernel's items in row order (built by :func:`plan`); int32 arrays, ``[I]`` per
    item (``I`` a static bound), of which the first ``num_items[0]`` are live."""

    row0: jax.Array  # [I] first row of x the item reads, a multiple of 8
    group: jax.Array  # [I] expert whose w the item uses; -1: rows past sum(group_sizes)
    first: jax.Array  # [I] first stored row, relative to row0 (0 <= first < 8)
    live: jax.Array  # [I] rows stored: [row0 + first, row0 + first + live)
    num_items: jax.Array  # [1] live items

    @property
    def max_items(self) -> int:
        return self.row0.shape[0]


def max_items(num_rows: int, num_experts: int, block_m: int) -> int:
    """Static bound on the items of :func:`plan`: segment ``s`` (E experts and the zero
    tail) of ``len_s`` rows, starting ``< 8`` rows past its aligned start, has
    ``cdiv(len_s + 7, block_m) <= (len_s + 6 + block_m) / block_m`` items."""
    segments = num_experts + 1
    return pl.cdiv(num_rows + segments * (block_m + TMA_ROWS - 2), block_m)


def plan(group_sizes: jax.Array, *, num_rows: int, block_m: int) -> Plan:
    """The kernel's :class:`Plan` (jittable, no host sync); the module docstring has a
    worked example.

    Segments are the experts' rows (``[offset_e, offset_e + group_sizes[e])``, clamped to
    ``[0, M)``) and then the rows past ``sum(group_sizes)``. A segment's items are
    ``block_m``-row blocks from its first row rounded down to a multiple of 8.
    """
    num_experts = group_sizes.shape[0]
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, num_rows)
    ends = jnp.minimum(jnp.cumsum(sizes, dtype=jnp.int32), num_rows)
    seg_end = jnp.append(ends, jnp.int32(num_rows))
    seg_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    seg_aligned = seg_start - seg_start % TMA_ROWS
    seg_items = jnp.where(seg_end > seg_start, pl.cdiv(seg_end - seg_aligned, block_m), 0)
    seg_items_end = jnp.cumsum(seg_items, dtype=jnp.int32)
    bound = max_items(num_rows, num_experts, block_m)
    item = jnp.arange(bound, dtype=jnp.int32)
    seg = jnp.minimum(jnp.searchsorted(seg_items_end, item, side="right"), num_experts)
    used = item < seg_items_end[-1]
    row0 = seg_aligned[seg] + (item - (seg_items_end[seg] - seg_items[seg])) * block_m
    first = jnp.clip(seg_start[seg] - row0, 0, block_m)
    live = jnp.where(used, jnp.clip(seg_end[seg] - row0, 0, block_m) - first, 0)
    group = jnp.where(used & (seg < num_experts), seg, -1)
    return Plan(
        row0=row0.astype(jnp.int32),
        group=group.astype(jnp.int32),
        first=first.astype(jnp.int32),
        live=jnp.maximum(live, 0).astype(jnp.int32),
        num_items=seg_items_end[-1:].astype(jnp.int32),
    )


def _kernel(
    plan: Plan,  # a Plan of int32 refs, [I] each ([1] for num_items)
    x_ref,  # [M, K]
    w_ref,  # [E, K, N]
    o_ref,  # [M, N]
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    num_stages: int,
    num_sms: int,
):
    num_rows, k_size = x_ref.shape
    n_size = o_ref.shape[1]
    dtype = x_ref.dtype
    k_steps = k_size // block_k
    unit_cols = _CONSUMERS * block_n
    n_units = pl.cdiv(n_size, unit_cols)
    x_pieces = block_m // _WGMMA_ROWS
    tiles = swizzled_tiles(dtype)

    def body(x_smem, w_smem, o_smem, full, free):
        # The ring: the s-th K step this block loads (counted over all its units) goes to
        # slot s % num_stages; full[slot] fires when its x and w tiles have landed
        # (x_pieces + _CONSUMERS copies, skipped ones arriving with 0 bytes), free[slot]
        # when both consumers' wgmmas have read it.
        sm = lax.axis_index("sm")
        wg = lax.axis_index("wg")
        num_units = plan.num_items[0] * n_units
        my_units = lax.div(jnp.maximum(num_units - sm, 0) + num_sms - 1, num_sms)

        def unit(i):  # (item, first output column) of this block's i-th unit
            u = sm + i * num_sms
            return lax.div(u, n_units), lax.rem(u, n_units) * unit_cols

        def steps(group):  # K steps a unit puts through the ring (none for zero items)
            return jnp.where(group >= 0, k_steps, 0)

        @pl.when(wg == _CONSUMERS)
        def _producer():
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            def load_unit(i, s0):
                item, col0 = unit(i)
                group, row0 = plan.group[item], plan.row0[item]
                first, live = plan.first[item], plan.live[item]
                # 64-row pieces of x holding no stored row are not loaded (a boundary
                # item of a small expert): their wgmma rows read stale shared memory and
                # are dropped; a matmul row depends on its own row of x only.
                has_rows = [
                    (first < (h + 1) * _WGMMA_ROWS) & (first + live > h * _WGMMA_ROWS)
                    for h in range(x_pieces)
                ]

                @pl.when(group >= 0)
                def _load():
                    @pl.loop(0, k_steps)
                    def _step(k):
                        s = s0 + k
                        slot = lax.rem(s, num_stages)

                        @pl.when(s >= num_stages)  # the slot's previous step is consumed
                        def _wait():
                            plgpu.barrier_wait(free.at[slot])

                        ks = pl.ds(k * block_k, block_k)
                        for h in range(x_pieces):
                            rows = pl.ds(h * _WGMMA_ROWS, _WGMMA_ROWS)
                            plgpu.copy_gmem_to_smem(
                                x_ref.at[pl.ds(row0 + h * _WGMMA_ROWS, _WGMMA_ROWS), ks],
                                x_smem.at[slot, rows],
                                full.at[slot],
                                predicate=has_rows[h],
                            )
                        for c in range(_CONSUMERS):
                            plgpu.copy_gmem_to_smem(
                                w_ref.at[group, ks, pl.ds(col0 + c * block_n, block_n)],
                                w_smem.at[slot, c],
                                full.at[slot],
                            )

                return s0 + steps(group)

            lax.fori_loop(0, my_units, load_unit, jnp.int32(0))

        @pl.when(wg < _CONSUMERS)
        def _consumer():
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            c = wg
            o_tile = o_smem.at[c]

            def store(out, row0, first, live, col):
                """Stores rows [first, first + live) of out[block_m, block_n] at
                y[row0 + ., col:]: 64-row chunks through o_tile, each as TMA boxes of
                power-of-two row counts (boxes are static). A consumer whose columns
                start at or past N (the second half of the last unit) stores nothing."""
                for h in range(block_m // _WGMMA_ROWS):
                    lo = h * _WGMMA_ROWS
                    begin = jnp.clip(first - lo, 0, _WGMMA_ROWS)
                    end = jnp.clip(first + live - lo, 0, _WGMMA_ROWS)
                    count = jnp.maximum(end - begin, 0)
                    # The previous chunk's (or unit's) stores have read o_tile.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    o_tile[...] = out[lo : lo + _WGMMA_ROWS]
                    plgpu.commit_smem()
                    start = begin
                    size = _WGMMA_ROWS
                    while size >= 1:
                        take = (count & size) != 0
                        plgpu.copy_smem_to_gmem(
                            o_tile.at[pl.ds(start, size)],
                            o_ref.at[pl.ds(row0 + lo + start, size), pl.ds(col, block_n)],
                            predicate=take & (col < n_size),
                        )
                        start = start + jnp.where(take, size, 0)
                        size //= 2

            def compute_unit(i, s0):
                item, col0 = unit(i)
                group, row0 = plan.group[item], plan.row0[item]
                first, live = plan.first[item], plan.live[item]
                col = col0 + c * block_n

                @pl.when(group >= 0)
                def _matmul():
                    def mma(acc_ref):
                        def step(k, carry):
                            slot = lax.rem(s0 + k, num_stages)
                            plgpu.barrier_wait(full.at[slot])
                            plgpu.wgmma(acc_ref, x_smem.at[slot], w_smem.at[slot, c])
                            # At most this step's wgmma in flight: the previous step's
                            # slot has been read and goes back to the producer.
                            plgpu.wgmma_wait(1)

                            @pl.when(k > 0)
                            def _release():
                                plgpu.barrier_arrive(free.at[lax.rem(s0 + k - 1, num_stages)])

                            return carry

                        lax.fori_loop(0, k_steps, step, None)
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(free.at[lax.rem(s0 + k_steps - 1, num_stages)])
                        return acc_ref[...]

                    acc = pl.run_scoped(mma, plgpu.ACC((block_m, block_n), jnp.float32))
                    store(acc.astype(dtype), row0, first, live, col)

                @pl.when(group < 0)
                def _zeros():  # rows past sum(group_sizes)
                    zeros = plgpu.layout_cast(
                        jnp.zeros((block_m, block_n), dtype), plgpu.Layout.WGMMA
                    )
                    store(zeros, row0, first, live, col)

                return s0 + steps(group)

            lax.fori_loop(0, my_units, compute_unit, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        body,
        plgpu.SMEM((num_stages, block_m, block_k), dtype, transforms=tiles),
        plgpu.SMEM((num_stages, _CONSUMERS, block_k, block_n), dtype, transforms=tiles),
        plgpu.SMEM((_CONSUMERS, _WGMMA_ROWS, block_n), dtype),
        plgpu.Barrier(num_arrivals=x_pieces + _CONSUMERS, num_barriers=num_stages),
        plgpu.Barrier(num_arrivals=_CONSUMERS, num_barriers=num_stages),
        collective_axes="wg",
    )


@functools.partial(jax.jit, static_argnames=("config",))
def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, config: BlockSizes
) -> jax.Array:
    """See :func:`pallas_kernels.grouped_matmul`: ``x[M, K]``, ``w[E, K, N]``,
    ``group_sizes[E]`` -> ``y[M, N]`` in ``x``'s dtype. The call must be
    :func:`supports`-ed (bf16/fp16, K and N multiples of 64, M a multiple of 8) and
    :func:`check_block_sizes` must accept ``config``."""
    check_block_sizes(config, x, w)
    (num_rows, _), n_size = x.shape, w.shape[2]
    item_plan = plan(group_sizes, num_rows=num_rows, block_m=config.block_m)
    num_sms = device_num_sms()
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            block_m=config.block_m,
            block_n=config.block_n,
            block_k=config.block_k,
            num_stages=config.num_stages,
            num_sms=num_sms,
        ),
        out_type=jax.ShapeDtypeStruct((num_rows, n_size), x.dtype),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=_CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        kernel_name=f"grouped_matmul_mosaic_bm{config.block_m}_bn{config.block_n}"
        f"_bk{config.block_k}_s{config.num_stages}",
    )
    return kernel(item_plan, x, w)
