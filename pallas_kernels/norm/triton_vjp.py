"""Backward kernel of the gated grouped RMSNorm (and of the residual add with its
RMSNorm) as a Pallas kernel lowered through Triton; ``norm/triton.py`` wires it into
its ``jax.custom_vjp``.

The backward pass is a second kernel on the same tiles: it reloads
x, z and dy, recomputes the group statistics (nothing but the inputs is saved) and writes
dx, dz and, per program (a few row blocks each), a partial sum of dweight, summed over
programs in ``jnp``.
With ``u`` the normalised input (``x·silu(z)`` or ``x``), ``r = rsqrt(mean(u²) + eps)``,
``n = u·r`` and ``dn`` the cotangent of ``n``: ``du = r·(dn − n·mean(dn·n))``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import silu, silu_grad
from pallas_kernels._pallas import block_dim, compiler_params
from pallas_kernels.backend import device_num_sms, pallas_dtypes
from pallas_kernels.norm.triton_config import BlockSizes


def _backward_kernel(
    x_ref,  # [T, Dm]
    z_ref,  # [T, Dm] or None
    w_ref,  # [Dm]
    dy_ref,  # [T, Dm]
    *out_refs,  # dx [T, Dm]; dz [T, Dm] when z is given; dw [num_programs, Dm] fp32
    group_size: int,
    block_rows: int,
    blocks_per_program: int,
    eps: float,
    norm_before_gate: bool,
):
    # dw: this program's partial sum of dweight over its row blocks.
    dx_ref, dz_ref, dw_ref = out_refs if z_ref is not None else (out_refs[0], None, out_refs[1])
    i, g = pl.program_id(0), pl.program_id(1)
    num_rows = x_ref.shape[0]
    block_cols = block_dim(group_size)
    col0 = g * group_size
    col_live = jnp.arange(block_cols) < group_size
    cols = pl.ds(col0, block_cols)
    w = plgpu.load(w_ref.at[cols], mask=col_live, other=0.0).astype(jnp.float32)

    def row_block(j, dw):
        row0 = (i * blocks_per_program + j) * block_rows
        row_live = row0 + jnp.arange(block_rows) < num_rows
        tile = row_live[:, None] & col_live[None, :]
        rows = pl.ds(row0, block_rows)
        x = plgpu.load(x_ref.at[rows, cols], mask=tile, other=0.0).astype(jnp.float32)
        dy = plgpu.load(dy_ref.at[rows, cols], mask=tile, other=0.0).astype(jnp.float32)
        z = gate = None
        if z_ref is not None:
            z = plgpu.load(z_ref.at[rows, cols], mask=tile, other=0.0).astype(jnp.float32)
            gate = silu(z)
        u = x * gate if gate is not None and not norm_before_gate else x
        inv_rms = jax.lax.rsqrt(jnp.sum(u * u, axis=1) / group_size + eps)[:, None]
        n = u * inv_rms
        # Cotangent of w·n (the gate after the norm folded in).
        dwn = dy * gate if gate is not None and norm_before_gate else dy
        dn = dwn * w[None, :]
        du = inv_rms * (dn - n * (jnp.sum(dn * n, axis=1, keepdims=True) / group_size))
        if gate is None:
            dx = du
        elif norm_before_gate:
            dx = du
            dz = dy * n * w[None, :] * silu_grad(z)
        else:
            dx = du * gate
            dz = du * x * silu_grad(z)
        plgpu.store(dx_ref.at[rows, cols], dx.astype(dx_ref.dtype), mask=tile)
        if dz_ref is not None:
            plgpu.store(dz_ref.at[rows, cols], dz.astype(dz_ref.dtype), mask=tile)
        # Rows past T loaded as 0 and contribute 0.
        return dw + jnp.sum(dwn * n, axis=0)

    # Row blocks of this program that start before T.
    first = i * blocks_per_program
    count = jnp.clip(pl.cdiv(num_rows, block_rows) - first, 0, blocks_per_program)
    dw = jax.lax.fori_loop(0, count, row_block, jnp.zeros((block_cols,), jnp.float32))
    plgpu.store(dw_ref.at[i, cols], dw, mask=col_live)


def _backward_programs(num_row_blocks: int, num_groups: int) -> int:
    """Row programs of the backward kernel: about four per SM over all groups (enough
    programs in flight to stream at the copy rate), so the fp32 dweight partials take
    ``programs × Dm`` floats, not one row per row block."""
    target = max(1, (4 * device_num_sms()) // max(num_groups, 1))
    return min(num_row_blocks, target)


def backward(
    x: jax.Array,
    z: jax.Array | None,
    weight: jax.Array,
    dy: jax.Array,
    *,
    group_size: int,
    eps: float,
    norm_before_gate: bool,
    config: BlockSizes,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Pallas backward kernel of ``triton.gated_rms_norm``: ``dy[T, Dm]`` ->
    ``(dx[T, Dm], dz[T, Dm] or None, dweight[Dm])``, each in its input's dtype."""
    num_rows, dim = x.shape
    blocks = config
    num_row_blocks = pl.cdiv(num_rows, blocks.block_rows)
    num_programs = _backward_programs(num_row_blocks, dim // group_size)
    blocks_per_program = pl.cdiv(num_row_blocks, num_programs)
    num_programs = pl.cdiv(num_row_blocks, blocks_per_program)
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    if z is not None:
        out_shape.append(jax.ShapeDtypeStruct(z.shape, z.dtype))
    out_shape.append(jax.ShapeDtypeStruct((num_programs, dim), jnp.float32))
    with pallas_dtypes():
        grads = pl.pallas_call(
            functools.partial(
                _backward_kernel,
                group_size=group_size,
                block_rows=blocks.block_rows,
                blocks_per_program=blocks_per_program,
                eps=eps,
                norm_before_gate=norm_before_gate,
            ),
            grid=(num_programs, dim // group_size),
            out_shape=out_shape,
            compiler_params=compiler_params(num_warps=blocks.num_warps, num_stages=1),
            interpret=interpret,
            name=f"gated_rms_norm_bwd_gs{group_size}_rows{blocks.block_rows}",
        )(x, z, weight, dy.astype(x.dtype))
        dw = jnp.sum(grads[-1], axis=0).astype(weight.dtype)
    return grads[0], (None if z is None else grads[1]), dw
