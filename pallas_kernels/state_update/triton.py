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

Backward (``jax.custom_vjp`` of :func:`selective_state_update`, :func:`backward`): one
program per (row, head, block of head-dim rows) recomputes its new state tile from the
step's input cache (kept as a residual). It writes the old state's cotangent in place over
the new cache's, dx and dz whole, and partial sums of the other inputs' gradients.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import checked_slots, decay_factor, process_dt, silu, silu_grad
from pallas_kernels._pallas import block_dim, compiler_params, masked_load, static_index
from pallas_kernels._validation import check_int_fields
from pallas_kernels.backend import pallas_dtypes


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the state-update kernel."""

    block_p: int = 32  # head-dim rows of the state tile per program
    block_h: int = 1  # heads per program, a loop (a power of two)
    num_warps: int = 4  # warps per program
    num_stages: int = 1  # software-pipelining depth of the loop over heads
    # The loop over heads unrolled, each head's dt', decay and D computed for the whole
    # block as vectors before it, and B and C loaded once when the block's heads share a
    # group: the loads of every head's state tile can then be issued at once.
    unroll_heads: bool = False

    def __post_init__(self):
        check_int_fields(self)
        for name in ("block_p", "block_h"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two")
        for name in ("num_warps", "num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


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


# Programs per launch below which heads are not grouped: 4 per SM of an H200 (132 SMs).
_MIN_PROGRAMS = 512
# Heads per program at most (measured best on the H200, below).
_MAX_BLOCK_H = 16
# Heads per program of an unrolled loop (``BlockSizes.unroll_heads``; best on the H200).
_UNROLLED_HEADS = 4


def default_block_sizes(
    head_dim: int, state_dim: int, *, rows: int = 1, num_heads: int = 1, gated: bool = False
) -> BlockSizes:
    """Heuristic: tiles of up to 8k elements with 8 warps (32 fp32 registers per thread),
    a whole head of Mamba2's 64 × 128 states per program; that reached 85-86% of the copy
    rate on the H200 (64 and 256 rows, H 128, P 64, N 128, fp32 states) with the state
    loads kept in L2 for their write-back, against 82% for 4k tiles with 4 warps. With
    many rows, up to 16 heads per program in a 2-stage loop at 16 warps, as long as the
    launch keeps ``_MIN_PROGRAMS`` programs: 88-89% at 64 and 256 rows (2 heads 86-87%,
    4 heads 86-88%, 8 heads at 8 warps 85-89%; benchmarks/results/nvidia_h200.json).
    With the z gate (``gated``) the 16-warp whole-head tiles fall to 74-75% of copy; half
    heads (32 × 128) at 8 warps keep 87-88% (H200, 2026-11-27, same run). Without it, where
    the loop would take 4 heads or more, 4 heads unrolled at 16 warps instead: 89.3 / 89.3%
    of copy at 64 / 256 rows against the 16-head loop's 86.9 / 87.3% (H200, 2026-11-28, same
    run; 89.2-89.3 / 89.2-89.4 against 88.2-88.3 / 88.5-88.8 in others; benchmarks/results/
    nvidia_h200_ssu_variants.json). Since the row became the slowest dimension of the launch
    (:func:`launch_grid`), those 4 heads in half-head tiles at 8 warps: 91.1-91.4 /
    91.5-92.5% against 89.8-90.7 / 90.3-91.5% for whole heads at 16 warps (H200, 2026-11-29,
    two processes); gated, 4 heads unrolled in quarter-head tiles at 4 warps: 90.1 / 90.4%
    against the 16-head loop's 87.2 / 88.0% (same day, one process). Both keep 16 fp32
    state elements a thread a head. Below half ``_MIN_PROGRAMS`` whole-head programs (a
    one-row step), half-head tiles."""
    block_p = max(1, min(block_dim(head_dim), 8192 // block_dim(state_dim)))
    programs = rows * pl.cdiv(head_dim, block_p) * num_heads
    if programs < _MIN_PROGRAMS // 2 and block_p > 32:
        # Too few programs to keep the loads in flight (one row: 128): half-head tiles
        # double them. 2.61 µs against 2.88 for the one-row update of Bamba-9B's 128
        # heads (H200, 2026-11-27, same run).
        block_p //= 2
        programs *= 2
    block_h = 1
    while block_h < _MAX_BLOCK_H and programs // (2 * block_h) >= _MIN_PROGRAMS:
        block_h *= 2
    if block_h == 1:
        return BlockSizes(block_p=block_p, num_warps=8)
    if block_h >= _UNROLLED_HEADS:
        # Gated, quarter-head tiles at 4 warps: half-head ones at 8 ran 88.3 / 89.4%.
        tile, warps = (2048, 4) if gated else (4096, 8)
        block_p = max(1, min(block_p, tile // block_dim(state_dim)))
        return BlockSizes(
            block_p=block_p, block_h=_UNROLLED_HEADS, num_warps=warps, unroll_heads=True
        )
    if gated:
        block_p = max(1, min(block_p, 4096 // block_dim(state_dim)))
        return BlockSizes(block_p=block_p, block_h=block_h, num_warps=8, num_stages=2)
    return BlockSizes(block_p=block_p, block_h=block_h, num_warps=16, num_stages=2)


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
    """The kernel with its Pallas backward kernel (:func:`backward`), for one set of static
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
        grads = backward(
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
    Differentiable in every float input through :func:`backward`."""
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


# ---------------------------------------------------------------------------- backward


def _backward_kernel(
    slot_ref,  # [Bd] int32
    x_ref,  # [Bd, H P]
    dt_ref,  # [Bd, H]
    A_ref,  # [H] fp32
    B_ref,  # [Bd, G N]
    C_ref,  # [Bd, G N]
    *refs,
    has_D: bool,
    D_per_channel: bool,
    has_z: bool,
    has_dt_bias: bool,
    heads_per_group: int,
    head_dim: int,
    state_dim: int,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    block_p: int,
):
    refs = list(refs)
    D_ref = refs.pop(0) if has_D else None
    z_ref = refs.pop(0) if has_z else None
    dt_bias_ref = refs.pop(0) if has_dt_bias else None
    cache_ref, dy_ref, dcache_in_ref, dx_ref = refs[:4]
    refs = refs[4:]
    dz_ref = refs.pop(0) if has_z else None
    ddt_ref, dA_ref = refs[:2]  # [Bd, H, PB] fp32 partials
    refs = refs[2:]
    dD_ref = refs.pop(0) if has_D else None  # [Bd, H, PB] or [Bd, H, P] fp32
    dB_ref, dC_ref, dcache_ref = refs  # [Bd, H, PB, N] fp32 partials; [S, H, P, N]
    del dcache_in_ref  # the same buffer as dcache_ref
    r, h, pb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32 = jnp.float32
    P, N = head_dim, state_dim
    bp, bn = block_p, block_dim(state_dim)
    p0 = pb * bp
    p_live = p0 + jnp.arange(bp) < P
    n_live = jnp.arange(bn) < N
    tile = p_live[:, None] & n_live[None, :]
    g = h // heads_per_group
    slot = slot_ref[r]
    channels = pl.ds(h * P + p0, bp)
    group_cols = pl.ds(g * N, bn)

    def load(ref, mask):
        return masked_load(ref, mask).astype(f32)

    @pl.when(slot >= 0)
    def _live():
        u = dt_ref[r, h].astype(f32)
        if dt_bias_ref is not None:
            u = u + dt_bias_ref[h]
        pre = jnp.logaddexp(u, 0.0) if dt_softplus else u  # dt' before the clamp
        dtp = process_dt(pre, None, dt_softplus=False, dt_limit=dt_limit)
        A = A_ref[h]
        exponent = dtp * A
        decay = decay_factor(exponent)
        # d decay / d exponent: exp(exponent) below the clamp at 0, 0 above it.
        # (Half at 0 exactly: jax.grad of the xla path's jnp.minimum splits ties. Selects of
        # two constants are avoided: Triton's lowering typed one as i1.)
        ddecay = jnp.where(exponent < 0.0, decay, jnp.where(exponent == 0.0, 0.5 * decay, 0.0))
        x = load(x_ref.at[r, channels], p_live)
        B = load(B_ref.at[r, group_cols], n_live)
        C = load(C_ref.at[r, group_cols], n_live)
        state_tile = cache_ref.at[slot, h, pl.ds(p0, bp), pl.ds(static_index(0), bn)]
        cotangent_tile = dcache_ref.at[slot, h, pl.ds(p0, bp), pl.ds(static_index(0), bn)]
        old = load(state_tile, tile)
        new = decay * old + (dtp * x)[:, None] * B[None, :]
        if D_ref is None:
            skip = jnp.zeros((bp,), f32)
        elif D_per_channel:
            skip = load(D_ref.at[h, pl.ds(p0, bp)], p_live)
        else:
            skip = jnp.full((bp,), D_ref[h], f32)
        dy = load(dy_ref.at[r, h, pl.ds(p0, bp)], p_live)
        if z_ref is not None:
            zv = load(z_ref.at[r, channels], p_live)
            y0 = jnp.sum(new * C[None, :], axis=1) + skip * x
            dz = dy * y0 * silu_grad(zv)
            plgpu.store(dz_ref.at[r, h, pl.ds(p0, bp)], dz.astype(dz_ref.dtype), mask=p_live)
            dy = dy * silu(zv)
        # Cotangent of the new state: the cache's, plus what y = new · C feeds back.
        dnew = load(cotangent_tile, tile) + dy[:, None] * C[None, :]
        plgpu.store(cotangent_tile, (decay * dnew).astype(dcache_ref.dtype), mask=tile)
        plgpu.store(
            dC_ref.at[r, h, pb, pl.ds(static_index(0), bn)],
            jnp.sum(dy[:, None] * new, axis=0),
            mask=n_live,
        )
        dx = skip * dy + dtp * jnp.sum(dnew * B[None, :], axis=1)
        plgpu.store(dx_ref.at[r, h, pl.ds(p0, bp)], dx.astype(dx_ref.dtype), mask=p_live)
        dx_B = jnp.sum(dnew * x[:, None], axis=0)  # Σ_p dnew[p, :] x[p]
        plgpu.store(dB_ref.at[r, h, pb, pl.ds(static_index(0), bn)], dtp * dx_B, mask=n_live)
        if D_ref is not None and D_per_channel:
            plgpu.store(dD_ref.at[r, h, pl.ds(p0, bp)], dy * x, mask=p_live)
        elif D_ref is not None:
            dD_ref[r, h, pb] = jnp.sum(dy * x)
        d_decay = jnp.sum(dnew * old)
        dA_ref[r, h, pb] = d_decay * ddecay * dtp
        ddtp = jnp.sum(dx_B * B) + d_decay * ddecay * A
        # The clamp passes the gradient where it is inactive, none where it holds dt' at a
        # limit, half where the unclamped value is a limit exactly (jax.grad of the xla
        # path's jnp.clip: max and min split ties).
        lo, hi = dt_limit
        ddtp = jnp.where(pre > lo, ddtp, jnp.where(pre == lo, 0.5 * ddtp, 0.0))
        ddtp = jnp.where(pre < hi, ddtp, jnp.where(pre == hi, 0.5 * ddtp, 0.0))
        if dt_softplus:
            ddtp = ddtp * jax.nn.sigmoid(u)  # d softplus(u) / du
        ddt_ref[r, h, pb] = ddtp

    @pl.when(slot < 0)
    def _padding():
        zeros_p = jnp.zeros((bp,), f32)
        plgpu.store(dx_ref.at[r, h, pl.ds(p0, bp)], zeros_p.astype(dx_ref.dtype), mask=p_live)
        if dz_ref is not None:
            plgpu.store(dz_ref.at[r, h, pl.ds(p0, bp)], zeros_p.astype(dz_ref.dtype), mask=p_live)
        zeros_n = jnp.zeros((bn,), f32)
        plgpu.store(dB_ref.at[r, h, pb, pl.ds(static_index(0), bn)], zeros_n, mask=n_live)
        plgpu.store(dC_ref.at[r, h, pb, pl.ds(static_index(0), bn)], zeros_n, mask=n_live)
        if D_ref is not None and D_per_channel:
            plgpu.store(dD_ref.at[r, h, pl.ds(p0, bp)], zeros_p, mask=p_live)
        elif D_ref is not None:
            dD_ref[r, h, pb] = jnp.float32(0.0)
        dA_ref[r, h, pb] = jnp.float32(0.0)
        ddt_ref[r, h, pb] = jnp.float32(0.0)


def backward(
    state_cache: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    dy: jax.Array,
    dcache: jax.Array,
    *,
    slot_ids: jax.Array,
    D: jax.Array | None,
    z: jax.Array | None,
    dt_bias: jax.Array | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    interpret: bool = False,
) -> tuple:
    """Gradients of :func:`selective_state_update` from the cotangents ``dy[Bd, H, P]``
    and ``dcache[S, H, P, N]`` (of the new cache), ``state_cache`` the step's input cache.

    One program per (row, head, block of head-dim rows) recomputes its new state tile from
    the old one, forms the new state's cotangent ``dnew = dcache[s] + dy' ⊗ C`` (``dy'``
    the gated ``dy``), writes the old state's, ``exp(min(dt' A, 0)) dnew``, in place over
    ``dcache`` (slots no row names keep their cotangent: the step copies them through),
    and dx and dz whole; dt's, A's, B's and C's per-program partial sums (over the block's
    rows, and its state columns for the scalars) and D's (per program for ``D[H]``, per
    row for ``D[H, P]``) are summed over blocks, heads of a group and rows in ``jnp``.
    Padding rows get 0 everywhere. Built under :func:`pallas_dtypes` (a backward runs
    outside the op's dispatch, where x64 would widen the kernel's indices). Returns
    ``(dstate_cache, dx, ddt, dA, dB, dC, dD, dz, ddt_bias)``, each in its input's dtype
    (None for absent inputs)."""
    rows, H, P = x.shape
    G, N = B.shape[1:]
    f32 = jnp.float32
    bn = block_dim(N)
    # Three fp32 tiles live at once (old, new, dnew): 4k elements with 8 warps.
    block_p = max(1, min(block_dim(P), 4096 // bn))
    num_pb = pl.cdiv(P, block_p)
    D_per_channel = D is not None and D.ndim == 2
    args = [
        checked_slots(slot_ids, state_cache.shape[0]),
        x.reshape(rows, -1),
        dt,
        A.astype(f32),
        B.reshape(rows, -1),
        C.reshape(rows, -1),
    ]
    args += [
        a
        for a in (
            None if D is None else D.astype(f32),
            None if z is None else z.reshape(rows, -1),
            None if dt_bias is None else dt_bias.astype(f32),
        )
        if a is not None
    ]
    args += [state_cache, dy, dcache]
    partial_shape = (rows, H, num_pb)
    out_shape = [jax.ShapeDtypeStruct((rows, H, P), x.dtype)]
    if z is not None:
        out_shape.append(jax.ShapeDtypeStruct((rows, H, P), z.dtype))
    out_shape += [jax.ShapeDtypeStruct(partial_shape, f32)] * 2  # ddt, dA
    if D is not None:
        out_shape.append(
            jax.ShapeDtypeStruct((rows, H, P) if D_per_channel else partial_shape, f32)
        )
    out_shape += [jax.ShapeDtypeStruct((rows, H, num_pb, N), f32)] * 2  # dB, dC
    out_shape.append(jax.ShapeDtypeStruct(dcache.shape, dcache.dtype))
    with pallas_dtypes():  # 32-bit indices whatever x64 says (the docstring)
        outs = pl.pallas_call(
            functools.partial(
                _backward_kernel,
                has_D=D is not None,
                D_per_channel=D_per_channel,
                has_z=z is not None,
                has_dt_bias=dt_bias is not None,
                heads_per_group=H // G,
                head_dim=P,
                state_dim=N,
                dt_softplus=dt_softplus,
                dt_limit=dt_limit,
                block_p=block_p,
            ),
            grid=(rows, H, num_pb),
            out_shape=tuple(out_shape),
            input_output_aliases={len(args) - 1: len(out_shape) - 1},
            compiler_params=compiler_params(num_warps=8, num_stages=1),
            interpret=interpret,
            name=f"selective_state_update_bwd_bp{block_p}",
        )(*args)
    outs = list(outs)
    dx = outs.pop(0)
    dz = outs.pop(0) if z is not None else None
    ddt_parts, dA_parts = outs[:2]
    outs = outs[2:]
    dD_parts = outs.pop(0) if D is not None else None
    dB_parts, dC_parts, dstate_cache = outs
    ddt = jnp.sum(ddt_parts, axis=2)  # [Bd, H]

    def group_sum(parts):  # [Bd, H, PB, N] → [Bd, G, N]
        return jnp.sum(parts.reshape(rows, G, H // G, num_pb, N), axis=(2, 3))

    dD = None
    if D is not None:
        dD = jnp.sum(dD_parts, axis=0 if D_per_channel else (0, 2)).astype(D.dtype)
    ddt_bias = None if dt_bias is None else jnp.sum(ddt, axis=0).astype(dt_bias.dtype)
    return (
        dstate_cache,
        dx,
        ddt.astype(dt.dtype),
        jnp.sum(dA_parts, axis=(0, 2)).astype(A.dtype),
        group_sum(dB_parts).astype(B.dtype),
        group_sum(dC_parts).astype(C.dtype),
        dD,
        dz,
        ddt_bias,
    )
