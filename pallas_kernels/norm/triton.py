"""Gated grouped RMSNorm, and the residual add with its RMSNorm, as a Pallas kernel
lowered through Triton.

One program per (row block, group): the group's ``group_size`` channels of a few rows are
loaded once, the gate applied (before or after the norm), the mean square taken in fp32
and the result written once. Memory-bound: x and z are read once, y written once. With a
``residual`` (``rms_norm``, one group a row) the program first adds it to x, writes the sum
(the residual stream) and normalises that: one launch and one pass where XLA takes an add,
a reduction and an elementwise kernel.

Differentiable (``jax.custom_vjp``, wired here) through the backward kernel of
``norm/triton_vjp.py``; block sizes and their heuristic are in ``norm/triton_config.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import silu
from pallas_kernels._pallas import block_dim, compiler_params
from pallas_kernels.norm import triton_vjp
from pallas_kernels.norm.triton_config import BlockSizes


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
        return triton_vjp.backward(x, z, weight, dy, **options)

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
    Differentiable in x, z and weight through ``triton_vjp.backward``."""
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
        dnorm, _, dweight = triton_vjp.backward(total, None, weight, dy, **options)
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
    Differentiable in x, residual and weight through ``triton_vjp.backward``."""
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
