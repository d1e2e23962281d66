"""Decode SSM step as a Pallas kernel lowered through Triton.

One program per (row, block of heads, head-dim block), the row slowest in the launch order
(:func:`launch_grid`): for each of its heads, gather the row's state tile from its cache
slot, advance it one token (``s ← exp(dt' A) s + dt' x ⊗ B``), write it back in place (the
cache is aliased input → output), and reduce ``y = s · C + D x`` with the z gate. dt and A
are scalars per head (Mamba2), so the decay is one ``exp`` per head. The heads of a program
are a loop, which keeps more bytes in flight per SM than one head per program: software-
pipelined (the next head's state loads while this one's is reduced and stored), or unrolled
after the block's dt', decays and D are computed as vectors (``BlockSizes.unroll_heads``,
the default with many rows), so that nothing stands between the heads' state loads. Rows
whose slot is ``-1`` read and write nothing and produce zeros. Memory-bound: each named
state is read once and written once, fp32 or bf16, with fp32 arithmetic.

The kernel reads its per-row inputs as ``[Bd, width]`` row arrays at column offsets
(:class:`Columns`): the op passes x, dt, B, C and z flattened, each at column 0; the fused
Mamba2 decode step (``pallas_kernels.mamba_decode``) passes the conv output and in_proj's
packed ``z | xBC | dt`` rows, so XLA does not copy their column slices into arrays of their
own before the kernel (a copy kernel each, about 1 µs at one row and 3.5 µs at 64).

Differentiable (``jax.custom_vjp``, wired here) through the backward kernel of
``state_update/triton_vjp.py``; block sizes and their heuristic are in
``state_update/triton_config.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import checked_slots, decay_factor, process_dt, silu
from pallas_kernels._pallas import block_dim, compiler_params, masked_load, static_index
from pallas_kernels.state_update import triton_vjp
from pallas_kernels.state_update.triton_config import BlockSizes


@dataclasses.dataclass(frozen=True)
class Columns:
    """Where each per-row input starts in its ``[Bd, width]`` row array: head ``h``'s x at
    ``x + h P``, its dt at ``dt + h``, group ``g``'s B and C at ``B + g N`` and ``C + g N``,
    the gate z at ``z + h P``."""

    x: int = 0
    dt: int = 0
    B: int = 0
    C: int = 0
    z: int = 0


def launch_grid(rows: int, num_heads: int, head_dim: int, config: BlockSizes) -> tuple[int, ...]:
    """The grid of the state update: (head-dim block, block of heads, row), the row
    slowest. Programs launched one after another then take the neighbouring tiles of one
    slot, so those in flight stream a few slots' contiguous states rather than one tile of
    each of many: 91.1-92.5% of the copy rate at 64 and 256 rows against 88.8-89.8% with
    the row fastest, the same tiling (H200, 2026-11-29, two processes; benchmarks/results/
    nvidia_h200_ssu_variants.json). Shared with ``tools/state_update_floor.py``."""
    return (pl.cdiv(head_dim, config.block_p), pl.cdiv(num_heads, config.block_h), rows)


def program_indices() -> tuple[jax.Array, jax.Array, jax.Array]:
    """(row, block of heads, head-dim block) of this program on :func:`launch_grid`."""
    return pl.program_id(2), pl.program_id(1), pl.program_id(0)


def for_each_head(block_h: int, unroll: bool, body: Callable[[int, None], object]) -> None:
    """``body(i, None)`` for the ``block_h`` heads of a program: a static (unrolled) loop
    under ``unroll``, else one ``fori_loop``, which the compiler pipelines; one head needs
    neither. Shared with ``tools/state_update_floor.py``, whose passes loop as the kernel."""
    if block_h == 1:
        body(0, None)
    elif unroll:
        for i in range(block_h):
            body(i, None)
    else:
        jax.lax.fori_loop(0, block_h, body, None)


def _kernel(
    slot_ref,  # [Bd] int32
    x_ref,  # [Bd, ≥ columns.x + H P]
    dt_ref,  # [Bd, ≥ columns.dt + H]
    A_ref,  # [H] fp32: A, or A_log (A = -exp(A_log)) under A_is_log
    B_ref,  # [Bd, ≥ columns.B + G N]
    C_ref,  # [Bd, ≥ columns.C + G N]
    D_ref,  # [H] or [H, P] fp32, or None
    z_ref,  # [Bd, ≥ columns.z + H P] or None
    dt_bias_ref,  # [H] fp32 or None
    cache_in_ref,  # [S, H, P, N], aliased to cache_ref
    y_ref,  # [Bd, H, P]
    cache_ref,  # [S, H, P, N]
    *,
    columns: Columns,
    heads_per_group: int,
    head_dim: int,
    state_dim: int,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    block_p: int,
    block_h: int,
    unroll_heads: bool,
    A_is_log: bool,
):
    del cache_in_ref  # the same buffer as cache_ref
    r, hb, pb = program_indices()
    num_heads = y_ref.shape[1]
    bp, bn = block_p, block_dim(state_dim)
    p0 = pb * bp
    slot = slot_ref[r]
    # Masks only where a tile or the last block of heads can run past the arrays: a
    # branch or a mask the compiler cannot drop inside the loop over heads keeps it from
    # pipelining the state loads (measured: 85% of copy instead of 88-89%).
    exact_tile = head_dim % bp == 0 and bn == state_dim
    ragged_heads = num_heads % block_h != 0

    def masks(h):
        """(h clamped into [0, H), the [bp] and [bp, bn] masks, None where all true)."""
        p_live = None if exact_tile else p0 + jnp.arange(bp) < head_dim
        if ragged_heads:
            live = h < num_heads
            h = jnp.minimum(h, num_heads - 1)
            p_live = jnp.full((bp,), live) if p_live is None else p_live & live
        if p_live is None:
            return h, None, None
        n_live = jnp.arange(bn) < state_dim
        return h, p_live, p_live[:, None] & n_live[None, :]

    n_live = None if exact_tile else jnp.arange(bn) < state_dim
    D_per_head = D_ref is not None and len(D_ref.shape) == 1

    def step_scalars(dt, bias, A):
        """(dt', decay) of a head, or of a block's heads as vectors."""
        dt = process_dt(dt.astype(jnp.float32), bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
        return dt, decay_factor(dt * (-jnp.exp(A) if A_is_log else A))

    def group_inputs(g):
        """The row's B[bn] and C[bn] of group ``g``, fp32."""
        B = masked_load(B_ref.at[r, pl.ds(columns.B + g * state_dim, bn)], n_live)
        C = masked_load(C_ref.at[r, pl.ds(columns.C + g * state_dim, bn)], n_live)
        return B.astype(jnp.float32), C.astype(jnp.float32)

    def head_scalars(i, h):
        """(dt', decay, D or None) of head ``h``, the block's ``i``-th, each loaded alone."""
        bias = None if dt_bias_ref is None else dt_bias_ref[h]
        dt, decay = step_scalars(dt_ref[r, columns.dt + h], bias, A_ref[h])
        return dt, decay, D_ref[h] if D_per_head else None

    def block_scalars():
        """head_scalars of the unrolled path: every head's of the block computed at once as
        ``[block_h]`` vectors before the heads' state tiles are touched; the ``i``-th
        picked by a masked sum (a static index into a vector does not lower)."""
        lanes = jnp.arange(block_h)
        # Clamped like masks(): a last block running past H repeats head H - 1's scalars
        # for heads whose tiles masks() leaves alone.
        heads = jnp.minimum(hb * block_h + lanes, num_heads - 1)
        bias = None if dt_bias_ref is None else plgpu.load(dt_bias_ref.at[heads])
        dt = plgpu.load(dt_ref.at[r, columns.dt + heads])
        dts, decays = step_scalars(dt, bias, plgpu.load(A_ref.at[heads]))
        Ds = plgpu.load(D_ref.at[heads]) if D_per_head else None

        def pick(i, h):
            del h
            one = lanes == i
            return tuple(None if v is None else jnp.sum(jnp.where(one, v, 0.0)) for v in
                         (dts, decays, Ds))  # fmt: skip

        return pick

    # B and C once a program where its heads share a group (the unrolled path only: in the
    # pipelined loop it moved nothing, nvidia_h200_ssu_variants.json).
    shared_group = unroll_heads and heads_per_group % block_h == 0

    def advance(i, carry, scalars=head_scalars, shared=None):
        h, p_live, tile = masks(hb * block_h + i)
        cache_tile = cache_ref.at[slot, h, pl.ds(p0, bp), pl.ds(static_index(0), bn)]
        x_cols = pl.ds(columns.x + h * head_dim + p0, bp)
        # evict_last: the tile is written back right after, to the same lines.
        state = plgpu.load(
            cache_tile, mask=tile, other=None if tile is None else 0.0, eviction_policy="evict_last"
        ).astype(jnp.float32)
        dt, decay, D_h = scalars(i, h)
        x = masked_load(x_ref.at[r, x_cols], p_live).astype(jnp.float32)
        B, C = group_inputs(h // heads_per_group) if shared is None else shared
        state = decay * state + (dt * x)[:, None] * B[None, :]
        plgpu.store(cache_tile, state.astype(cache_ref.dtype), mask=tile)
        y = jnp.sum(state * C[None, :], axis=1)
        if D_per_head:
            y = y + D_h * x
        elif D_ref is not None:
            y = y + masked_load(D_ref.at[h, pl.ds(p0, bp)], p_live) * x
        if z_ref is not None:
            z_cols = pl.ds(columns.z + h * head_dim + p0, bp)
            y = y * silu(masked_load(z_ref.at[r, z_cols], p_live).astype(jnp.float32))
        plgpu.store(y_ref.at[r, h, pl.ds(p0, bp)], y.astype(y_ref.dtype), mask=p_live)
        return carry

    def zero(i, carry):
        h, p_live, _ = masks(hb * block_h + i)
        plgpu.store(y_ref.at[r, h, pl.ds(p0, bp)], jnp.zeros((bp,), y_ref.dtype), mask=p_live)
        return carry

    def heads(body):
        for_each_head(block_h, unroll_heads, body)

    def advance_heads():
        if not unroll_heads:
            return heads(advance)
        shared = group_inputs(hb * block_h // heads_per_group) if shared_group else None
        return heads(functools.partial(advance, scalars=block_scalars(), shared=shared))

    pl.when(slot >= 0)(advance_heads)
    pl.when(slot < 0)(lambda: heads(zero))


def _forward(state_cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, *, options):
    """The kernel on ``[Bd, H, P]`` / ``[Bd, G, N]`` arrays (flattened to row arrays, a
    bitcast)."""
    rows = x.shape[0]

    def flat(a: jax.Array | None) -> jax.Array | None:
        """[Bd, ...] → [Bd, width]: a bitcast, no copy."""
        return None if a is None else a.reshape(rows, -1)

    return state_update_rows(
        state_cache,
        flat(x),
        dt,
        A,
        flat(B),
        flat(C),
        z=flat(z),
        columns=Columns(),
        num_groups=B.shape[1],
        slot_ids=slot_ids,
        D=D,
        dt_bias=dt_bias,
        **options,
    )


@functools.cache
def _differentiable(
    dt_softplus: bool, dt_limit: tuple[float, float], config: BlockSizes, interpret: bool
):
    """The kernel with its Pallas backward kernel (``triton_vjp.backward``), for one set of static
    options."""
    options = dict(dt_softplus=dt_softplus, dt_limit=dt_limit, config=config, interpret=interpret)

    @jax.custom_vjp
    def update(state_cache, x, dt, A, B, C, slot_ids, D, z, dt_bias):
        return _forward(state_cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, options=options)

    def forward(*args):
        # The input cache is a residual: the backward recomputes the new states from the
        # old ones (under differentiation XLA keeps a copy instead of updating in place).
        return update(*args), args

    def backward_rule(residuals, cotangents):
        state_cache, x, dt, A, B, C, slot_ids, D, z, dt_bias = residuals
        dy, dcache = cotangents
        grads = triton_vjp.backward(
            state_cache,
            x,
            dt,
            A,
            B,
            C,
            dy,
            dcache,
            slot_ids=slot_ids,
            D=D,
            z=z,
            dt_bias=dt_bias,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            interpret=interpret,
        )
        dcache_in, dx, ddt, dA, dB, dC, dD, dz, ddt_bias = grads
        return dcache_in, dx, ddt, dA, dB, dC, None, dD, dz, ddt_bias

    update.defvjp(forward, backward_rule)
    return update


def selective_state_update(
    state_cache: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    *,
    slot_ids: jax.Array,
    D: jax.Array | None,
    z: jax.Array | None,
    dt_bias: jax.Array | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    config: BlockSizes,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """See :func:`pallas_kernels.selective_state_update`; arguments are already validated.
    Differentiable in every float input through ``triton_vjp.backward``."""
    return _differentiable(bool(dt_softplus), tuple(dt_limit), config, interpret)(
        state_cache, x, dt, A, B, C, slot_ids, D, z, dt_bias
    )


def state_update_rows(
    state_cache: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    *,
    z: jax.Array | None,
    columns: Columns,
    num_groups: int,
    slot_ids: jax.Array,
    D: jax.Array | None,
    dt_bias: jax.Array | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    config: BlockSizes,
    A_is_log: bool = False,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The state update on row arrays: ``x``, ``dt``, ``B``, ``C``, ``z`` are ``[Bd, width]``
    arrays (possibly one and the same) holding each input at its :class:`Columns` offset.
    The caller checks that every window lies inside its array. ``A_is_log``: ``A`` holds
    the mixer's ``A_log[H]`` and the kernel takes ``A = -exp(A_log)`` itself (computed by
    XLA before the call, it would be a kernel launch of its own every decode step). Returns
    ``(y[Bd, H, P], new_state_cache)``, ``y`` in ``x``'s dtype."""
    rows = x.shape[0]
    H, P, N = state_cache.shape[1:]
    blocks = config
    block_p = blocks.block_p
    f32 = jnp.float32
    # D[H] stays a scalar per head: broadcasting it to [H, P] would be one more XLA op
    # (a launch) before every decode step's kernel.
    D = None if D is None else D.astype(f32)
    dt_bias = None if dt_bias is None else dt_bias.astype(f32)
    slot_ids = checked_slots(slot_ids, state_cache.shape[0])  # in bounds when called directly
    args = (slot_ids, x, dt, A.astype(f32), B, C, D, z, dt_bias, state_cache)
    cache_index = sum(a is not None for a in args) - 1
    return pl.pallas_call(
        functools.partial(
            _kernel,
            columns=columns,
            heads_per_group=H // num_groups,
            head_dim=P,
            state_dim=N,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            block_p=block_p,
            block_h=blocks.block_h,
            unroll_heads=blocks.unroll_heads,
            A_is_log=A_is_log,
        ),
        grid=launch_grid(rows, H, P, blocks),
        out_shape=(
            jax.ShapeDtypeStruct((rows, H, P), x.dtype),
            jax.ShapeDtypeStruct(state_cache.shape, state_cache.dtype),
        ),
        input_output_aliases={cache_index: 1},
        compiler_params=compiler_params(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"selective_state_update_bp{block_p}_bh{blocks.block_h}"
        + ("_unrolled" if blocks.unroll_heads else ""),
    )(*args)
