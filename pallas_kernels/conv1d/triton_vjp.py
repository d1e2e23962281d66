"""Backward kernels of the causal depthwise conv1d (prefill and decode) as Pallas kernels
lowered through Triton; ``conv1d/triton.py`` wires them into its ``jax.custom_vjp``.

Prefill backward (``jax.custom_vjp`` of ``causal_conv1d``): the same (channel block,
token block) programs walk their rows once more, one row per step, recomputing each
pre-activation ``a_t`` from the sliding window and ``da_t = dy_t · act'(a_t)``. Since
``dx_s = Σ_k w_k · da_{s+K-1-k}`` needs the ``K-1`` later rows, a program runs ``K-1``
rows past its block (to the sequence's end), keeps the last ``K-1`` ``da`` in registers
and writes ``dx_{t-(K-1)}`` at row ``t``. ``dweight`` and ``dbias`` are per-program
partial sums over the block's own rows (each row in exactly one block), summed over
programs in ``jnp``; a sequence's history columns (the cached state) enter ``dweight``.
The cotangent of the new conv state flows to the inputs it copied (the sequence's last
``K-1`` tokens). The cached state's own cotangent (``state_cotangent``) is small ``jnp``
glue on ``[B, K-1, dim]``: each sequence's first ``K-1`` rows' pre-activations recomputed,
their history taps, the columns a sequence shorter than ``K-1`` keeps, and the new
state's cotangent passed through the lines no sequence writes.

Decode backward (``jax.custom_vjp`` of ``causal_conv1d_update``, :func:`update_backward`):
the decode's programs rebuild the row's inputs (the slot's history from the step's input
cache, kept as a residual, then the row's tokens), write dx and the history's cotangent in
place over the new cache's, and per-row partial dweight and dbias.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import LOG2E, checked_slots, slot_scatter_index
from pallas_kernels._pallas import (
    compiler_params,
    for_each_tail_block,
    masked_load,
    static_index,
)
from pallas_kernels.backend import pallas_dtypes
from pallas_kernels.conv1d.triton_config import (
    TAIL_PROGRAMS,
    BlockSizes,
    default_update_block_sizes,
)
from pallas_kernels.metadata import sequence_block_table


def _activation_grad(a: jax.Array, activation: str | None) -> jax.Array:
    """``act'(a)``: ``s (1 + a (1 - s))`` with ``s = sigmoid(a)`` for SiLU, else 1."""
    if activation != "silu":
        return jnp.ones_like(a)
    s = 1.0 / (1.0 + jnp.exp2(a * -LOG2E))
    return s * (1.0 + a * (1.0 - s))


def _prefill_backward_kernel(
    block_seq_ref,  # [num_blocks] int32: sequence of each token block, -1 past the table
    block_row_ref,  # [num_blocks] int32: packed row where the block starts
    qsl_ref,  # [B + 1] int32
    slot_ref,  # [B] int32
    has_state_ref,  # [B] int32 (0/1)
    x_ref,  # [T, dim]
    w_ref,  # [dim, K]
    bias_ref,  # [dim] or None
    cache_ref,  # [S, K-1, dim]: the conv state the forward read
    dy_ref,  # [T, dim]
    dstate_ref,  # [S, K-1, dim]: cotangent of the new conv state cache
    dx_ref,  # [T, dim]
    dw_ref,  # [num_blocks + tail programs, K, dim] fp32: this program's partial dweight
    db_ref,  # [num_blocks + tail programs, dim] fp32: this program's partial dbias
    *,
    width: int,
    block_t: int,
    block_d: int,
    activation: str | None,
):
    dblk, i = pl.program_id(0), pl.program_id(1)
    num_blocks = block_seq_ref.shape[0]
    num_tokens, dim = dx_ref.shape
    d0 = dblk * block_d
    cols = pl.ds(d0, block_d)
    d_live = d0 + jnp.arange(block_d) < dim
    zeros = jnp.zeros((block_d,), jnp.float32)

    def row_of(ref, row, live):
        row = jnp.clip(row, 0, num_tokens - 1)
        return plgpu.load(ref.at[row, cols], mask=d_live & live, other=0.0).astype(jnp.float32)

    def store_partials(dw, db):
        for k in range(width):
            plgpu.store(dw_ref.at[i, static_index(k), cols], dw[k], mask=d_live)
        plgpu.store(db_ref.at[i, cols], db, mask=d_live)

    def zero_rows(row0, end):
        rows = row0 + jnp.arange(block_t)
        plgpu.store(
            dx_ref.at[pl.ds(row0, block_t), cols],
            jnp.zeros((block_t, block_d), dx_ref.dtype),
            mask=(rows < end)[:, None] & d_live[None, :],
        )

    def block_grads(row0, block_end, seq_start, seq_end, slot, first, b):
        use_state = first & (has_state_ref[b] != 0)
        history = [
            plgpu.load(
                cache_ref.at[slot, static_index(j), cols], mask=d_live & use_state, other=0.0
            ).astype(jnp.float32)
            for j in range(width - 1)
        ]
        window = [
            row_of(x_ref, row0 - (width - 1) + j, ~first) + history[j] for j in range(width - 1)
        ]
        weights = [
            plgpu.load(w_ref.at[cols, static_index(k)], mask=d_live, other=0.0).astype(jnp.float32)
            for k in range(width)
        ]
        bias = zeros
        if bias_ref is not None:
            bias = plgpu.load(bias_ref.at[cols], mask=d_live, other=0.0).astype(jnp.float32)
        # Rows of the new conv state: [seq_end - (K-1), seq_end) (only those at or after
        # seq_start; earlier state columns came from the old state: state_cotangent's).
        state_row0 = seq_end - (width - 1)

        def step(n, carry):
            window, das, dw, db = carry  # inputs t-(K-1)..t-1; da_{t-(K-1)}..da_{t-1}
            t = row0 + n
            in_seq = t < seq_end
            taps = [*window, row_of(x_ref, t, in_seq)]
            a = bias
            for tap, w in zip(taps, weights, strict=True):
                a = a + tap * w
            da = row_of(dy_ref, t, in_seq) * _activation_grad(a, activation)
            da = jnp.where(in_seq, da, 0.0)
            # Rows of this block (not the halo) add to dweight and dbias.
            own = jnp.where(t < block_end, da, 0.0)
            dw = [acc + own * tap for acc, tap in zip(dw, taps, strict=True)]
            db = db + own
            # dx of row s = t - (K-1): the K taps that read it, da_{s+K-1-k} = da_{t-k}.
            all_da = [*das, da]
            s = t - (width - 1)
            dx = zeros
            for k in range(width):
                dx = dx + weights[k] * all_da[width - 1 - k]
            j = s - state_row0
            from_state = (j >= 0) & (s >= row0)
            dx = dx + plgpu.load(
                dstate_ref.at[slot, jnp.clip(j, 0, width - 2), cols],
                mask=d_live & from_state,
                other=0.0,
            ).astype(jnp.float32)
            plgpu.store(
                dx_ref.at[jnp.clip(s, 0, num_tokens - 1), cols],
                dx.astype(dx_ref.dtype),
                mask=d_live & (s >= row0),
            )
            return taps[1:], all_da[1:], dw, db

        carry = (window, [zeros] * (width - 1), [zeros] * width, zeros)
        _, _, dw, db = jax.lax.fori_loop(0, block_end - row0 + width - 1, step, carry)
        store_partials(dw, db)

    @pl.when(i < num_blocks)
    def _block():
        b = block_seq_ref[i]
        row0 = block_row_ref[i]
        live = b >= 0
        bb = jnp.maximum(b, 0)
        slot = jnp.where(live, slot_ref[bb], -1)
        seq_start, seq_end = qsl_ref[bb], qsl_ref[bb + 1]
        first = row0 == seq_start
        block_end = jnp.minimum(row0 + block_t, seq_end)

        @pl.when(live & (slot < 0))
        def _():
            zero_rows(row0, block_end)

        @pl.when(slot < 0)
        def _():
            store_partials([zeros] * width, zeros)

        @pl.when(slot >= 0)
        def _():
            block_grads(row0, block_end, seq_start, seq_end, slot, first, bb)

    @pl.when(i >= num_blocks)
    def _tail():
        store_partials([zeros] * width, zeros)
        for_each_tail_block(
            lambda row0: zero_rows(row0, num_tokens),
            total=qsl_ref[qsl_ref.shape[0] - 1],
            num_rows=num_tokens,
            block=block_t,
            program=i - num_blocks,
            num_programs=TAIL_PROGRAMS,
        )


def prefill_backward(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    dy: jax.Array,
    dstate: jax.Array,
    *,
    query_start_loc: jax.Array,
    conv_state_cache: jax.Array,
    slot_ids: jax.Array,
    has_initial_state: jax.Array,
    activation: str | None,
    config: BlockSizes,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Pallas backward kernel of :func:`causal_conv1d`: cotangents ``dy[T, dim]`` of y and
    ``dstate[S, K-1, dim]`` of the new conv state cache -> ``(dx[T, dim], dweight[dim, K],
    dbias[dim] or None)``, each in its input's dtype (the cached state's cotangent is
    :func:`state_cotangent`'s); rows of padding sequences and past ``query_start_loc[-1]``
    get 0."""
    num_tokens, dim = x.shape
    width = weight.shape[1]
    num_seqs = slot_ids.shape[0]
    block_t, block_d = config.block_t, config.block_d
    num_blocks = pl.cdiv(num_tokens, block_t) + num_seqs
    num_programs = num_blocks + TAIL_PROGRAMS
    with pallas_dtypes():
        block_seq, block_row = sequence_block_table(
            query_start_loc, block_size=block_t, num_blocks=num_blocks
        )
        dx, dw, db = pl.pallas_call(
            functools.partial(
                _prefill_backward_kernel,
                width=width,
                block_t=block_t,
                block_d=block_d,
                activation=activation,
            ),
            grid=(pl.cdiv(dim, block_d), num_programs),
            out_shape=(
                jax.ShapeDtypeStruct(x.shape, x.dtype),
                jax.ShapeDtypeStruct((num_programs, width, dim), jnp.float32),
                jax.ShapeDtypeStruct((num_programs, dim), jnp.float32),
            ),
            compiler_params=compiler_params(num_warps=config.num_warps, num_stages=1),
            interpret=interpret,
            name=f"causal_conv1d_bwd_k{width}_bt{block_t}_bd{block_d}",
        )(
            block_seq,
            block_row,
            query_start_loc,
            checked_slots(slot_ids, conv_state_cache.shape[0]),
            has_initial_state.astype(jnp.int32),
            x,
            weight,
            bias,
            conv_state_cache,
            dy.astype(x.dtype),
            dstate.astype(jnp.float32),
        )
        dweight = jnp.sum(dw, axis=0).T.astype(weight.dtype)
        dbias = None if bias is None else jnp.sum(db, axis=0).astype(bias.dtype)
    return dx, dweight, dbias


def state_cotangent(
    primals: tuple[jax.Array, ...], dy: jax.Array, dstate: jax.Array, activation: str | None
) -> jax.Array:
    """Cotangent of the conv state cache read by :func:`causal_conv1d` (``primals``: its
    differentiated function's arguments, slot ids checked): ``dstate`` where no
    sequence writes, nothing else there (a written line's old value reaches only what
    reads it); plus, in the slot of each sequence that starts from its state, what its
    ``K-1`` history columns feed: its first ``K-1`` outputs (the pre-activations
    recomputed for those ``B (K-1)`` rows only) and, for a sequence shorter than ``K-1``,
    the columns its new state keeps. Small ``[B, K-1, dim]`` arrays in fp32."""
    x, weight, bias, qsl, conv_state_cache, slot_ids, has_initial_state = primals
    f32 = jnp.float32
    num_tokens = x.shape[0]
    num_slots, hist, _ = conv_state_cache.shape  # hist = K - 1
    width = hist + 1
    seq_len = qsl[1:] - qsl[:-1]
    safe_slot = jnp.maximum(slot_ids, 0)
    history = conv_state_cache[safe_slot].astype(f32)  # [B, K-1, dim]
    reads = (has_initial_state != 0) & (slot_ids >= 0)
    w = weight.astype(f32)

    # Each sequence's first K-1 tokens (local position l) read history column K-1+l-s at
    # tap s > l.
    local = jnp.arange(hist)
    token = jnp.clip(qsl[:-1, None] + local[None, :], 0, max(num_tokens - 1, 0))  # [B, K-1]
    live = (local[None, :] < seq_len[:, None]) & reads[:, None]
    xf = x.astype(f32)[token]  # [B, K-1, dim]
    pre = xf * w[:, width - 1]
    for shift in range(1, width):
        from_x = jnp.roll(xf, shift, axis=1)  # token l - shift, for l >= shift
        column = jnp.clip(width - 1 + local - shift, 0, hist - 1)
        from_state = history[:, column]
        taken = jnp.where((local >= shift)[None, :, None], from_x, from_state)
        pre = pre + taken * w[:, width - 1 - shift]
    if bias is not None:
        pre = pre + bias.astype(f32)
    dpre = dy.astype(f32)[token]
    dpre = jnp.where(live[..., None], dpre * _activation_grad(pre, activation), 0.0)
    dhistory = jnp.zeros_like(history)
    for shift in range(1, width):
        for row in range(min(shift, hist)):  # row l < shift reads column K-1+l-shift
            column = width - 1 + row - shift
            tap = dpre[:, row] * w[:, width - 1 - shift]
            dhistory = dhistory.at[:, column].add(tap)

    # A sequence shorter than K-1 keeps history columns len..K-2 as new columns 0..K-2-len.
    writes = (slot_ids >= 0) & (seq_len > 0)
    dnew = jnp.where(writes[:, None, None], dstate.astype(f32)[safe_slot], 0.0)  # [B, K-1, dim]
    col = jnp.arange(hist)
    kept = (col[None, :] + seq_len[:, None] < hist) & reads[:, None] & writes[:, None]
    source = jnp.clip(col[None, :] + seq_len[:, None], 0, hist - 1)  # [B, K-1]
    onehot = (source[..., None] == col[None, None, :]) & kept[..., None]  # [B, new, old]
    dhistory = dhistory + jnp.einsum(  # exact: a 0/1 matrix, no TF32 rounding on GPUs
        "bnc,bno->boc", dnew, onehot.astype(f32), precision=jax.lax.Precision.HIGHEST
    )

    dcache = dstate.astype(f32).at[slot_scatter_index(jnp.where(writes, slot_ids, -1), num_slots)]
    dcache = dcache.set(0.0, mode="drop")
    dcache = dcache.at[slot_scatter_index(jnp.where(reads, slot_ids, -1), num_slots)].add(
        jnp.where(reads[:, None, None], dhistory, 0.0), mode="drop"
    )
    return dcache.astype(conv_state_cache.dtype)


def _update_backward_kernel(
    slot_ref,  # [Bd] int32
    x_ref,  # [Bd, L, dim]
    w_ref,  # [dim, K]
    *refs,
    has_bias: bool,
    width: int,
    block_d: int,
    activation: str | None,
):
    refs = list(refs)
    bias_ref = refs.pop(0) if has_bias else None
    cache_ref, dy_ref, dcache_in_ref, dx_ref, dw_ref = refs[:5]  # dw: [Bd, K, dim] partials
    refs = refs[5:]
    db_ref = refs.pop(0) if has_bias else None  # [Bd, dim] partials
    (dcache_ref,) = refs
    del dcache_in_ref  # the same buffer as dcache_ref
    r, dblk = pl.program_id(0), pl.program_id(1)
    steps, dim = x_ref.shape[1:]
    hist = width - 1
    d0 = dblk * block_d
    cols = pl.ds(d0, block_d)
    d_live = d0 + jnp.arange(block_d) < dim
    slot = slot_ref[r]
    f32 = jnp.float32

    def load(ref):
        return masked_load(ref, d_live).astype(f32)

    @pl.when(slot >= 0)
    def _live():
        w = [load(w_ref.at[cols, static_index(k)]) for k in range(width)]
        # The row's inputs in order: the K-1 history columns, then its L tokens.
        u = [load(cache_ref.at[slot, static_index(j), cols]) for j in range(hist)]
        u += [load(x_ref.at[r, static_index(l), cols]) for l in range(steps)]
        pre = [sum(u[l + k] * w[k] for k in range(width)) for l in range(steps)]
        if bias_ref is not None:
            bias = load(bias_ref.at[cols])
            pre = [a + bias for a in pre]
        dpre = [
            load(dy_ref.at[r, static_index(l), cols]) * _activation_grad(pre[l], activation)
            for l in range(steps)
        ]
        # The new state is u[L : L + K - 1]: its cotangent joins those inputs'.
        du = [jnp.zeros((block_d,), f32) for _ in range(hist + steps)]
        for c in range(hist):
            du[steps + c] = load(dcache_ref.at[slot, static_index(c), cols])
        for l in range(steps):
            for k in range(width):
                du[l + k] = du[l + k] + dpre[l] * w[k]
        for l in range(steps):
            plgpu.store(
                dx_ref.at[r, static_index(l), cols], du[hist + l].astype(dx_ref.dtype), mask=d_live
            )
        for j in range(hist):
            plgpu.store(
                dcache_ref.at[slot, static_index(j), cols],
                du[j].astype(dcache_ref.dtype),
                mask=d_live,
            )
        for k in range(width):
            dw = sum(dpre[l] * u[l + k] for l in range(steps))
            plgpu.store(dw_ref.at[r, static_index(k), cols], dw, mask=d_live)
        if db_ref is not None:
            plgpu.store(db_ref.at[r, cols], sum(dpre), mask=d_live)

    @pl.when(slot < 0)
    def _padding():
        zeros = jnp.zeros((block_d,), f32)
        for l in range(steps):
            plgpu.store(
                dx_ref.at[r, static_index(l), cols], zeros.astype(dx_ref.dtype), mask=d_live
            )
        for k in range(width):
            plgpu.store(dw_ref.at[r, static_index(k), cols], zeros, mask=d_live)
        if db_ref is not None:
            plgpu.store(db_ref.at[r, cols], zeros, mask=d_live)


def update_backward(
    x: jax.Array,
    conv_state_cache: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    dy: jax.Array,
    dcache: jax.Array,
    *,
    slot_ids: jax.Array,
    activation: str | None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Gradients of :func:`causal_conv1d_update` (``x[Bd, L, dim]``) from the cotangents
    ``dy[Bd, L, dim]`` and ``dcache[S, K-1, dim]`` (of the new cache), ``conv_state_cache``
    the step's input cache.

    One program per (row, channel block) rebuilds the row's inputs, its slot's ``K-1``
    history columns then its ``L`` tokens, and their pre-activations; each input's
    cotangent is what its taps feed (``dpre_l w_k``) plus, for the last ``K-1``, the new
    state's. It writes dx whole and the history's cotangent in place over ``dcache`` (slots
    no row names keep theirs: the step copies them through); dweight and dbias are
    per-row partial sums, summed in ``jnp``. Padding rows get 0. Built under
    :func:`pallas_dtypes` (a backward runs outside the op's dispatch). Returns ``(dx,
    dconv_state_cache, dweight, dbias)`` in their inputs' dtypes."""
    rows, steps, dim = x.shape
    width = weight.shape[1]
    block_d = default_update_block_sizes(dim).block_d
    f32 = jnp.float32
    args = [checked_slots(slot_ids, conv_state_cache.shape[0]), x, weight]
    args += [] if bias is None else [bias]
    args += [conv_state_cache, dy, dcache]
    out_shape = [
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        jax.ShapeDtypeStruct((rows, width, dim), f32),
    ]
    if bias is not None:
        out_shape.append(jax.ShapeDtypeStruct((rows, dim), f32))
    out_shape.append(jax.ShapeDtypeStruct(dcache.shape, dcache.dtype))
    with pallas_dtypes():  # 32-bit indices whatever x64 says (the docstring)
        outs = pl.pallas_call(
            functools.partial(
                _update_backward_kernel,
                has_bias=bias is not None,
                width=width,
                block_d=block_d,
                activation=activation,
            ),
            grid=(rows, pl.cdiv(dim, block_d)),
            out_shape=tuple(out_shape),
            input_output_aliases={len(args) - 1: len(out_shape) - 1},
            compiler_params=compiler_params(num_warps=4, num_stages=1),
            interpret=interpret,
            name=f"causal_conv1d_update_bwd_k{width}_bd{block_d}",
        )(*args)
    dx, dw_parts = outs[:2]
    dbias = None if bias is None else jnp.sum(outs[2], axis=0).astype(bias.dtype)
    dweight = jnp.sum(dw_parts, axis=0).T.astype(weight.dtype)
    return dx, outs[-1], dweight, dbias
