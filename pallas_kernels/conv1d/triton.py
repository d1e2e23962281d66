"""Causal depthwise conv1d (prefill and decode) as Pallas kernels lowered through Triton.

Prefill (``causal_conv1d``): one program per (channel block, token block of one sequence).
Token blocks are aligned to each sequence's start (:func:`sequence_block_table`), so a
block never holds two sequences. A program walks its ``block_t`` rows in order, ``unroll_t``
rows per loop step, with the last ``K−1`` inputs in registers (a sliding window; each
step's rows unrolled, and the next step's rows loaded before this step's are stored, so
loads stay in flight): each input element is read from memory once, plus a ``K−1`` row
halo per block. (K shifted tile loads read every element K times through L2
and were bound by L2 bandwidth at a third of the copy rate on an H200.) A sequence's first
block takes its window from the slot's conv state when ``has_initial_state``, zeros
otherwise; later blocks from the sequence's own earlier tokens. The first block also
writes the sequence's new conv state (its last ``K−1`` inputs, shifted together with the
old state when the sequence is shorter), so the only program that reads a slot's state is
the one that overwrites it: no race between programs. A few extra programs past the table
zero the bucket rows no sequence owns. For the fused Mamba2 prefill (``mamba_prefill``) the
kernel reads its channels at a column offset of in_proj's packed rows and writes its output
as two arrays split at a channel (x and ``B | C``): each program writes one of them.

Decode (``causal_conv1d_update``): one program per (row, channel block) keeps the ``K−1``
column window in registers, advances it over the row's ``L`` tokens and writes it back
in place (the cache is aliased input → output).

Both ops are differentiable (``jax.custom_vjp``, wired here) through the Pallas backward
kernels of ``conv1d/triton_vjp.py``; block sizes and their heuristics are in
``conv1d/triton_config.py``.

x is read once from memory, y written once; fp32 accumulation. At 4 channels per thread
the prefill kernel is bound by issue slots as much as by bytes (Nsight Compute on an H200:
95 registers, 20 warps per SM, issue slots 88 % busy with libdevice's ``expf`` and an IEEE
divide in the SiLU), so the per-row arithmetic is kept to fused multiply-adds and a cheap
activation (:func:`_activate`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import LOG2E, checked_slots
from pallas_kernels._pallas import (
    compiler_params,
    for_each_tail_block,
    static_index,
)
from pallas_kernels.conv1d import triton_vjp
from pallas_kernels.conv1d.triton_config import TAIL_PROGRAMS, BlockSizes
from pallas_kernels.metadata import sequence_block_table


def _activate(y: jax.Array, activation: str | None, *, approx_tanh: bool) -> jax.Array:
    """The activation in fp32 on few instructions: the prefill kernel is bound by issue
    slots, not bytes, with ``jax.nn.sigmoid`` (libdevice ``expf`` and an IEEE divide: 0.41
    ms on bamba-conv against 0.37 ms with ``exp2`` and 0.32 ms with ``tanh.approx``).

    ``silu(y) = y / (1 + 2^(-y log2 e))`` (a few ulp in fp32), or with ``approx_tanh``
    ``h + h tanh(h)``, ``h = y / 2``, on the hardware tanh (relative error ~2^-11: under
    half a bf16 ulp; inline PTX, so compiled kernels only)."""
    if activation != "silu":
        return y
    if approx_tanh:
        half = 0.5 * y
        return half + half * plgpu.approx_tanh(half)
    return y / (1.0 + jnp.exp2(y * -LOG2E))


def _approx_tanh(dtype, interpret: bool) -> bool:
    """The hardware tanh serves bf16 outputs (its error is far under their rounding) of
    compiled kernels (interpret mode cannot run inline PTX); fp16 and fp32 take exp2."""
    return dtype == jnp.bfloat16 and not interpret


# ----------------------------------------------------------------------------- prefill


def _prefill_kernel(
    block_seq_ref,  # [num_blocks] int32: sequence of each token block, -1 past the table
    block_row_ref,  # [num_blocks] int32: packed row where the block starts
    qsl_ref,  # [B + 1] int32
    slot_ref,  # [B] int32
    has_state_ref,  # [B] int32 (0/1)
    x_ref,  # [T, ≥ x_col0 + dim]
    w_ref,  # [dim, K]
    bias_ref,  # [dim] or None
    cache_in_ref,  # [S, K-1, dim], aliased to cache_ref
    *refs,  # y_ref [T, dim] (or [T, split] and [T, dim - split]), cache_ref [S, K-1, dim]
    x_col0: int,
    split: int | None,
    width: int,
    block_t: int,
    unroll_t: int,
    block_d: int,
    activation: str | None,
    approx_tanh: bool,
):
    del cache_in_ref  # the same buffer as cache_ref
    *y_refs, cache_ref = refs
    dblk, i = pl.program_id(0), pl.program_id(1)
    num_blocks = block_seq_ref.shape[0]
    num_tokens, dim = x_ref.shape[0], w_ref.shape[0]
    d0 = dblk * block_d
    d_live = d0 + jnp.arange(block_d) < dim
    cols = pl.ds(d0, block_d)  # the channels of the weights, bias and conv state
    x_cols = pl.ds(x_col0 + d0, block_d)

    def x_row(row, live):
        """Input row ``row`` (fp32), zeros where not ``live``; the index is clamped so a
        masked row never forms an address outside x."""
        row = jnp.clip(row, 0, num_tokens - 1)
        return plgpu.load(x_ref.at[row, x_cols], mask=d_live & live, other=0.0).astype(jnp.float32)

    def run(y_ref, y_d0):
        """The program's work, its outputs going to columns ``y_d0 ..`` of ``y_ref``."""
        y_cols = pl.ds(y_d0, block_d)

        def zero_rows(row0, end):
            """Zeros into rows [row0, min(row0 + block_t, end)) of y."""
            rows = row0 + jnp.arange(block_t)
            plgpu.store(
                y_ref.at[pl.ds(row0, block_t), y_cols],
                jnp.zeros((block_t, block_d), y_ref.dtype),
                mask=(rows < end)[:, None] & d_live[None, :],
            )

        def convolve_block(row0, block_end, seq_start, seq_end, slot, first, b):
            """Rows [row0, block_end) of sequence ``b`` (live: ``slot >= 0``)."""
            # The slot's last K-1 inputs (oldest first), read only by the sequence's first
            # block and only with an initial state; zeros otherwise.
            use_state = first & (has_state_ref[b] != 0)
            history = [
                plgpu.load(
                    cache_ref.at[slot, static_index(j), cols],
                    mask=d_live & use_state,
                    other=0.0,
                ).astype(jnp.float32)
                for j in range(width - 1)
            ]
            # The K-1 inputs before the block: its sequence's earlier tokens, or the history.
            window = [x_row(row0 - (width - 1) + j, ~first) + history[j] for j in range(width - 1)]
            weights = [
                plgpu.load(w_ref.at[cols, static_index(k)], mask=d_live, other=0.0).astype(
                    jnp.float32
                )
                for k in range(width)
            ]
            bias = None
            if bias_ref is not None:
                bias = plgpu.load(bias_ref.at[cols], mask=d_live, other=0.0).astype(jnp.float32)

            def load_rows(first_row):
                return [x_row(first_row + r, first_row + r < block_end) for r in range(unroll_t)]

            def rows_step(j, carry):
                window, current = carry  # the K-1 inputs before this step's rows; its rows
                step_row = row0 + j * unroll_t
                # The next step's loads go out before this step's stores: a store may alias
                # a later load as far as the compiler knows, so loads issued after stores
                # would each wait for the one before. Past the block they are masked off.
                upcoming = load_rows(step_row + unroll_t)
                taps_all = window + current
                for r in range(unroll_t):
                    row = step_row + r
                    taps = taps_all[r : r + width]
                    # Bias first, then one fused multiply-add per tap.
                    y = bias
                    for tap, w in zip(taps, weights, strict=True):
                        y = tap * w if y is None else y + tap * w
                    y = _activate(y, activation, approx_tanh=approx_tanh)
                    plgpu.store(
                        y_ref.at[jnp.minimum(row, num_tokens - 1), y_cols],
                        y.astype(y_ref.dtype),
                        mask=d_live & (row < block_end),
                    )
                return taps_all[len(taps_all) - (width - 1) :], upcoming

            num_steps = pl.cdiv(block_end - row0, unroll_t)
            jax.lax.fori_loop(0, num_steps, rows_step, (window, load_rows(row0)))

            # New state: the last K-1 inputs of history ++ tokens.
            @pl.when(first)
            def _():
                length = seq_end - seq_start
                for j in range(width - 1):
                    t = length - (width - 1) + j  # position in the sequence, < 0: history
                    column = x_row(seq_start + t, t >= 0)
                    for h in range(width - 1):
                        column = column + jnp.where(length + j == h, history[h], 0.0)
                    plgpu.store(
                        cache_ref.at[slot, static_index(j), cols],
                        column.astype(cache_ref.dtype),
                        mask=d_live,
                    )

        @pl.when(i < num_blocks)
        def _block():
            b = block_seq_ref[i]

            @pl.when(b >= 0)
            def _():
                row0 = block_row_ref[i]
                seq_start, seq_end = qsl_ref[b], qsl_ref[b + 1]
                slot = slot_ref[b]
                first = row0 == seq_start
                block_end = jnp.minimum(row0 + block_t, seq_end)

                # A padding sequence (slot -1) reads nothing and writes zero rows.
                pl.when(slot < 0)(lambda: zero_rows(row0, block_end))

                @pl.when(slot >= 0)
                def _():
                    convolve_block(row0, block_end, seq_start, seq_end, slot, first, b)

        # Programs past the table zero the bucket rows no sequence owns: [qsl[-1], T).
        @pl.when(i >= num_blocks)
        def _tail():
            for_each_tail_block(
                lambda row0: zero_rows(row0, num_tokens),
                total=qsl_ref[qsl_ref.shape[0] - 1],
                num_rows=num_tokens,
                block=block_t,
                program=i - num_blocks,
                num_programs=TAIL_PROGRAMS,
            )

    if split is None:
        run(y_refs[0], d0)
    else:
        # Channels [0, split) go to the first output, the rest to the second. ``split`` is
        # a multiple of ``block_d``, so each program writes one output; the branch is per
        # program, outside the row loop (a store behind a branch inside the loop would keep
        # the compiler from issuing the next rows' loads ahead of it).
        pl.when(d0 < split)(lambda: run(y_refs[0], d0))
        pl.when(d0 >= split)(lambda: run(y_refs[1], d0 - split))


def prefill(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    *,
    query_start_loc: jax.Array,
    conv_state_cache: jax.Array,
    slot_ids: jax.Array,
    has_initial_state: jax.Array,
    activation: str | None,
    config: BlockSizes,
    interpret: bool,
    x_col0: int = 0,
    split: int | None = None,
) -> tuple[jax.Array, ...]:
    """``(y[T, dim], new_conv_state_cache)``; ``x`` may be wider, the conv's channels at
    columns ``x_col0 .. x_col0 + dim``; with ``split``, y comes as two arrays, its
    channels before ``split`` and from it on (``split`` a multiple of ``block_d``)."""
    num_tokens = x.shape[0]
    dim, width = weight.shape
    num_seqs = slot_ids.shape[0]
    block_t, unroll_t, block_d = config.block_t, config.unroll_t, config.block_d
    num_blocks = pl.cdiv(num_tokens, block_t) + num_seqs
    block_seq, block_row = sequence_block_table(
        query_start_loc, block_size=block_t, num_blocks=num_blocks
    )
    args = (
        block_seq,
        block_row,
        query_start_loc,
        checked_slots(slot_ids, conv_state_cache.shape[0]),
        has_initial_state.astype(jnp.int32),
        x,
        weight,
        bias,
        conv_state_cache,
    )
    cache_index = sum(a is not None for a in args) - 1
    if split is not None and (split % block_d or not 0 < split < dim):
        raise ValueError(f"{split=} must be a multiple of block_d={block_d} inside (0, {dim})")
    widths = (dim,) if split is None else (split, dim - split)
    return pl.pallas_call(
        functools.partial(
            _prefill_kernel,
            x_col0=x_col0,
            split=split,
            width=width,
            block_t=block_t,
            unroll_t=unroll_t,
            block_d=block_d,
            activation=activation,
            approx_tanh=_approx_tanh(x.dtype, interpret),
        ),
        # Channel blocks vary fastest: programs in flight together read whole rows.
        grid=(pl.cdiv(dim, block_d), num_blocks + TAIL_PROGRAMS),
        out_shape=(
            *(jax.ShapeDtypeStruct((num_tokens, n), x.dtype) for n in widths),
            jax.ShapeDtypeStruct(conv_state_cache.shape, conv_state_cache.dtype),
        ),
        input_output_aliases={cache_index: len(widths)},
        compiler_params=compiler_params(num_warps=config.num_warps, num_stages=1),
        interpret=interpret,
        name=f"causal_conv1d_k{width}_bt{block_t}_ut{unroll_t}_bd{block_d}"
        + ("" if split is None else f"_split{split}"),
    )(*args)


@functools.cache
def _differentiable(activation: str | None, config: BlockSizes, interpret: bool):
    """The prefill kernel with its Pallas backward kernel, for one set of static options."""
    options = dict(activation=activation, config=config, interpret=interpret)

    @jax.custom_vjp
    def conv(x, weight, bias, query_start_loc, conv_state_cache, slot_ids, has_initial_state):
        return prefill(
            x,
            weight,
            bias,
            query_start_loc=query_start_loc,
            conv_state_cache=conv_state_cache,
            slot_ids=slot_ids,
            has_initial_state=has_initial_state,
            **options,
        )

    def forward(*args):
        return conv(*args), args

    def backward_rule(residuals, cotangents):
        x, weight, bias, qsl, cache, slot_ids, has_initial_state = residuals
        dy, dstate = cotangents
        dx, dweight, dbias = triton_vjp.prefill_backward(
            x,
            weight,
            bias,
            dy,
            dstate,
            query_start_loc=qsl,
            conv_state_cache=cache,
            slot_ids=slot_ids,
            has_initial_state=has_initial_state,
            **options,
        )
        checked = (*residuals[:5], checked_slots(slot_ids, cache.shape[0]), has_initial_state)
        dcache = triton_vjp.state_cotangent(checked, dy, dstate, activation)
        return dx, dweight, dbias, None, dcache, None, None

    conv.defvjp(forward, backward_rule)
    return conv


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    *,
    query_start_loc: jax.Array,
    conv_state_cache: jax.Array,
    slot_ids: jax.Array,
    has_initial_state: jax.Array,
    activation: str | None,
    config: BlockSizes,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """See :func:`pallas_kernels.causal_conv1d`; arguments are already validated.
    Differentiable in x, weight and bias through ``triton_vjp.prefill_backward``."""
    return _differentiable(activation, config, interpret)(
        x, weight, bias, query_start_loc, conv_state_cache, slot_ids, has_initial_state
    )


# ------------------------------------------------------------------------------ decode


def _update_kernel(
    slot_ref,  # [Bd] int32
    x_ref,  # [Bd, L, ≥ x_col0 + dim]
    w_ref,  # [dim, K]
    bias_ref,  # [dim] or None
    cache_in_ref,  # [S, K-1, dim], aliased to cache_ref
    y_ref,  # [Bd, L, dim]
    cache_ref,  # [S, K-1, dim]
    *,
    x_col0: int,
    width: int,
    block_d: int,
    activation: str | None,
    approx_tanh: bool,
):
    del cache_in_ref  # the same buffer as cache_ref
    r, dblk = pl.program_id(0), pl.program_id(1)
    steps, dim = y_ref.shape[1:]
    d0 = dblk * block_d
    d_live = d0 + jnp.arange(block_d) < dim
    slot = slot_ref[r]

    @pl.when(slot >= 0)
    def _():
        weights = [
            plgpu.load(
                w_ref.at[pl.ds(d0, block_d), static_index(k)], mask=d_live, other=0.0
            ).astype(jnp.float32)
            for k in range(width)
        ]
        bias = None
        if bias_ref is not None:
            bias = plgpu.load(bias_ref.at[pl.ds(d0, block_d)], mask=d_live, other=0.0)
            bias = bias.astype(jnp.float32)
        window = tuple(
            plgpu.load(
                cache_ref.at[slot, static_index(j), pl.ds(d0, block_d)], mask=d_live, other=0.0
            ).astype(jnp.float32)
            for j in range(width - 1)
        )

        def step(l, window):
            current = plgpu.load(
                x_ref.at[r, l, pl.ds(x_col0 + d0, block_d)], mask=d_live, other=0.0
            ).astype(jnp.float32)
            taps = (*window, current)
            y = sum(tap * w for tap, w in zip(taps, weights, strict=True))
            if bias is not None:
                y = y + bias
            plgpu.store(
                y_ref.at[r, l, pl.ds(d0, block_d)],
                _activate(y, activation, approx_tanh=approx_tanh).astype(y_ref.dtype),
                mask=d_live,
            )
            return taps[1:]

        window = jax.lax.fori_loop(0, steps, step, window)
        for j in range(width - 1):
            plgpu.store(
                cache_ref.at[slot, static_index(j), pl.ds(d0, block_d)],
                window[j].astype(cache_ref.dtype),
                mask=d_live,
            )

    @pl.when(slot < 0)
    def _():
        for l in range(steps):
            plgpu.store(
                y_ref.at[r, static_index(l), pl.ds(d0, block_d)],
                jnp.zeros((block_d,), y_ref.dtype),
                mask=d_live,
            )


@functools.cache
def _differentiable_update(activation: str | None, config: BlockSizes, interpret: bool):
    """The decode kernel with its Pallas backward kernel (``triton_vjp.update_backward``), for one
    set of static options."""
    options = dict(activation=activation, config=config, interpret=interpret)

    @jax.custom_vjp
    def update(x, conv_state_cache, weight, bias, slot_ids):
        return update_rows(x, conv_state_cache, weight, bias, slot_ids=slot_ids, **options)

    def forward(*args):
        # The input cache is a residual: the backward reads the history the step shifted
        # out (under differentiation XLA keeps a copy instead of updating in place).
        return update(*args), args

    def backward_rule(residuals, cotangents):
        x, cache, weight, bias, slot_ids = residuals
        dy, dcache = cotangents
        dx, dcache_in, dweight, dbias = triton_vjp.update_backward(
            x,
            cache,
            weight,
            bias,
            dy,
            dcache,
            slot_ids=slot_ids,
            activation=activation,
            interpret=interpret,
        )
        return dx, dcache_in, dweight, dbias, None

    update.defvjp(forward, backward_rule)
    return update


def causal_conv1d_update(
    x: jax.Array,
    conv_state_cache: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    *,
    slot_ids: jax.Array,
    activation: str | None,
    config: BlockSizes,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """See :func:`pallas_kernels.causal_conv1d_update`; ``x`` is ``[Bd, L, dim]`` here and
    arguments are already validated. Differentiable in x, the cache, weight and bias
    through ``triton_vjp.update_backward``."""
    return _differentiable_update(activation, config, interpret)(
        x, conv_state_cache, weight, bias, slot_ids
    )


def update_rows(
    x: jax.Array,
    conv_state_cache: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    *,
    slot_ids: jax.Array,
    activation: str | None,
    config: BlockSizes,
    x_col0: int = 0,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The decode kernel: ``x`` is ``[Bd, L, dim]``, or wider with the conv's channels at
    columns ``x_col0 .. x_col0 + dim`` (the fused Mamba2 decode step reads them from
    in_proj's packed output; the caller checks the window). Returns ``(y[Bd, L, dim],
    new_conv_state_cache)``."""
    rows, steps = x.shape[:2]
    dim, width = weight.shape
    blocks = config
    block_d = blocks.block_d
    args = (checked_slots(slot_ids, conv_state_cache.shape[0]), x, weight, bias, conv_state_cache)
    cache_index = sum(a is not None for a in args) - 1
    return pl.pallas_call(
        functools.partial(
            _update_kernel,
            x_col0=x_col0,
            width=width,
            block_d=block_d,
            activation=activation,
            approx_tanh=_approx_tanh(x.dtype, interpret),
        ),
        grid=(rows, pl.cdiv(dim, block_d)),
        out_shape=(
            jax.ShapeDtypeStruct((rows, steps, dim), x.dtype),
            jax.ShapeDtypeStruct(conv_state_cache.shape, conv_state_cache.dtype),
        ),
        input_output_aliases={cache_index: 1},
        compiler_params=compiler_params(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name=f"causal_conv1d_update_k{width}_bd{block_d}",
    )(*args)
