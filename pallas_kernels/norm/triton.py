"""Gated grouped RMSNorm, and the residual add with its RMSNorm, as a Pallas kernel
lowered through Triton.

One program per (row block, group): the group's ``group_size`` channels of a few rows are
loaded once, the gate applied (before or after the norm), the mean square taken in fp32
and the result written once. Memory-bound: x and z are read once, y written once. With a
``residual`` (``rms_norm``, one group a row) the program first adds it to x, writes the sum
(the residual stream) and normalises that: one launch and one pass where XLA takes an add,
a reduction and an elementwise kernel.

The backward pass (``jax.custom_vjp``) is a second kernel on the same tiles: it reloads
x, z and dy, recomputes the group statistics (nothing but the inputs is saved) and writes
dx, dz and, per program (a few row blocks each), a partial sum of dweight, summed over
programs in ``jnp``.
With ``u`` the normalised input (``x·silu(z)`` or ``x``), ``r = rsqrt(mean(u²) + eps)``,
``n = u·r`` and ``dn`` the cotangent of ``n``: ``du = r·(dn − n·mean(dn·n))``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import silu, silu_grad
from pallas_kernels._pallas import block_dim, compiler_params
from pallas_kernels._validation import check_int_fields
from pallas_kernels.backend import device_num_sms, pallas_dtypes

# Elements of one program's tile: 32 fp32 registers per thread at 8 warps.
_TILE_ELEMENTS = 8192


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiling of the norm kernel."""

    block_rows: int = 1  # rows per program
    num_warps: int = 8  # warps per program

    def __post_init__(self):
        check_int_fields(self)
        if self.block_rows < 1 or self.block_rows & (self.block_rows - 1):
            raise ValueError(f"block_rows={self.block_rows} must be a power of two")
        if self.num_warps < 1:
            raise ValueError(f"num_warps={self.num_warps} must be >= 1")


def default_block_sizes(group_size: int) -> BlockSizes:
    """Heuristic: tiles of about 8k elements, so small groups still move a useful amount
    per program; 4 warps once the tile is small enough to be spread thin over 8."""
    block_rows = max(1, _TILE_ELEMENTS // block_dim(group_size))
    num_warps = 8 if block_rows * block_dim(group_size) >= 4096 else 4
    return BlockSizes(block_rows=block_rows, num_warps=num_warps)


def _kernel(
    x_ref,  # [T, Dm]
    z_ref,  # [T, ≥ Dm] or None
    w_ref,  # [Dm]
    live_ref,  # [T] int32 or None: rows where 0 gives y = 0
    residual_ref,  # [T, Dm] or None: normalise x + residual, written to sum_ref
    *out_refs,  # y [T, Dm]; sum [T, Dm] with a residual
    group_size: int,
    block_rows: int,
    eps: float,
    norm_before_gate: bool,
):
    y_ref, sum_ref = out_refs if residual_ref is not None else (out_refs[0], None)
    i, g = pl.program_id(0), pl.program_id(1)
    num_rows = x_ref.shape[0]
    block_cols = block_dim(group_size)
    row0, col0 = i * block_rows, g * group_size
    row_live = row0 + jnp.arange(block_rows) < num_rows
    col_live = jnp.arange(block_cols) < group_size
    tile = row_live[:, None] & col_live[None, :]
    rows, cols = pl.ds(row0, block_rows), pl.ds(col0, block_cols)
    u = plgpu.load(x_ref.at[rows, cols], mask=tile, other=0.0).astype(jnp.float32)
    if residual_ref is not None:
        residual = plgpu.load(residual_ref.at[rows, cols], mask=tile, other=0.0)
        # Rounded to the stream's dtype before the statistics, as an add then a norm are.
        total = (u + residual.astype(jnp.float32)).astype(sum_ref.dtype)
        plgpu.store(sum_ref.at[rows, cols], total, mask=tile)
        u = total.astype(jnp.float32)
    gate = None
    if z_ref is not None:
        z = plgpu.load(z_ref.at[rows, cols], mask=tile, other=0.0)
        gate = silu(z.astype(jnp.float32))
    if gate is not None and not norm_before_gate:
        u = u * gate
    inv_rms = jax.lax.rsqrt(jnp.sum(u * u, axis=1) / group_size + eps)
    w = plgpu.load(w_ref.at[cols], mask=col_live, other=0.0).astype(jnp.float32)
    y = u * inv_rms[:, None] * w[None, :]
    if gate is not None and norm_before_gate:
        y = y * gate
    if live_ref is not None:
        live = plgpu.load(live_ref.at[rows], mask=row_live, other=0) != 0
        y = jnp.where(live[:, None], y, 0.0)
    plgpu.store(y_ref.at[rows, cols], y.astype(y_ref.dtype), mask=tile)


def forward(
    x: jax.Array,
    z: jax.Array | None,
    weight: jax.Array,
    *,
    group_size: int,
    eps: float,
    norm_before_gate: bool,
    config: BlockSizes,
    live_rows: jax.Array | None = None,
    residual: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The norm without its VJP: ``y[T, Dm]`` of ``x[T, Dm]``. ``z`` may be wider than x,
    its first ``Dm`` columns the gate (the fused Mamba2 steps pass in_proj's packed
    ``z | xBC | dt`` rows, whose z comes first). ``live_rows[T]``: rows where it is 0 give
    0, whatever x and z hold (a select, not a product). ``residual[T, Dm]`` (x's dtype):
    ``(y, s)``, y the norm of ``s = x + residual``."""
    num_rows, dim = x.shape
    blocks = config
    out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    prefix = "gated_rms_norm"
    if residual is not None:
        out_shape, prefix = (out_shape, out_shape), "add_rms_norm"
    return pl.pallas_call(
        functools.partial(
            _kernel,
            group_size=group_size,
            block_rows=blocks.block_rows,
            eps=eps,
            norm_before_gate=norm_before_gate,
        ),
        grid=(pl.cdiv(num_rows, blocks.block_rows), dim // group_size),
        out_shape=out_shape,
        compiler_params=compiler_params(num_warps=blocks.num_warps, num_stages=1),
        interpret=interpret,
        name=f"{prefix}_gs{group_size}_rows{blocks.block_rows}",
    )(x, z, weight, None if live_rows is None else live_rows.astype(jnp.int32), residual)


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
    """Pallas backward kernel of :func:`gated_rms_norm`: ``dy[T, Dm]`` ->
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


@functools.cache
def _differentiable(
    group_size: int, eps: float, norm_before_gate: bool, config: BlockSizes, interpret: bool
):
    """The forward kernel with its Pallas backward kernel, for one set of static options."""
    options = dict(
        group_size=group_size,
        eps=eps,
        norm_before_gate=norm_before_gate,
        config=config,
        interpret=interpret,
    )

    @jax.custom_vjp
    def norm(x, z, weight):
        return forward(x, z, weight, **options)

    def forward_rule(x, z, weight):
        return norm(x, z, weight), (x, z, weight)

    def backward_rule(residuals, dy):
        x, z, weight = residuals
        return backward(x, z, weight, dy, **options)

    norm.defvjp(forward_rule, backward_rule)
    return norm


def gated_rms_norm(
    x: jax.Array,
    z: jax.Array | None,
    weight: jax.Array,
    *,
    group_size: int,
    eps: float,
    norm_before_gate: bool,
    config: BlockSizes,
    interpret: bool = False,
) -> jax.Array:
    """See :func:`pallas_kernels.gated_rms_norm`; arguments are already validated.
    Differentiable in x, z and weight through :func:`backward`."""
    return _differentiable(group_size, eps, norm_before_gate, config, interpret)(x, z, weight)


@functools.cache
def _differentiable_add(dim: int, eps: float, config: BlockSizes, interpret: bool):
    """The add-and-norm kernel with its backward (the norm's backward kernel on the saved
    sum, plus the sum's own cotangent), for one set of static options."""
    options = dict(
        group_size=dim, eps=eps, norm_before_gate=False, config=config, interpret=interpret
    )

    @jax.custom_vjp
    def add_norm(x, residual, weight):
        return forward(x, None, weight, residual=residual, **options)

    def forward_rule(x, residual, weight):
        y, total = add_norm(x, residual, weight)
        return (y, total), (total, weight)

    def backward_rule(saved, cotangents):
        total, weight = saved
        dy, dtotal = cotangents
        dnorm, _, dweight = backward(total, None, weight, dy, **options)
        # x and residual reach y only through their sum.
        dsum = (dnorm.astype(jnp.float32) + dtotal.astype(jnp.float32)).astype(total.dtype)
        return dsum, dsum, dweight

    add_norm.defvjp(forward_rule, backward_rule)
    return add_norm


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    *,
    residual: jax.Array | None,
    eps: float,
    config: BlockSizes,
    interpret: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """See :func:`pallas_kernels.rms_norm`; arguments are already validated.
    Differentiable in x, residual and weight through :func:`backward`."""
    dim = x.shape[1]
    if residual is None:
        return gated_rms_norm(
            x,
            None,
            weight,
            group_size=dim,
            eps=eps,
            norm_before_gate=False,
            config=config,
            interpret=interpret,
        )
    return _differentiable_add(dim, eps, config, interpret)(x, residual, weight)
