"""Backward kernel of the decode SSM step as a Pallas kernel lowered through Triton;
``state_update/triton.py`` wires it into its ``jax.custom_vjp``.

Backward (:func:`backward`, of ``triton.selective_state_update``): one
program per (row, head, block of head-dim rows) recomputes its new state tile from the
step's input cache (kept as a residual). It writes the old state's cotangent in place over
the new cache's, dx and dz whole, and partial sums of the other inputs' gradients.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import checked_slots, decay_factor, process_dt, silu, silu_grad
from pallas_kernels._pallas import block_dim, compiler_params, masked_load, static_index
from pallas_kernels.backend import pallas_dtypes


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
    """Gradients of ``triton.selective_state_update`` from the cotangents ``dy[Bd, H, P]``
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
