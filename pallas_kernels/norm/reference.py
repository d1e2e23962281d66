"""Pure ``jax.numpy`` gated grouped RMSNorm: the ``xla`` implementation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import silu


def gated_rms_norm(
    x: jax.Array,
    z: jax.Array | None,
    weight: jax.Array,
    *,
    group_size: int,
    eps: float,
    norm_before_gate: bool,
) -> jax.Array:
    """See :func:`pallas_kernels.gated_rms_norm`; arguments are already validated."""
    f32 = jnp.float32
    rows, dim = x.shape
    u = x.astype(f32)
    gate = None if z is None else silu(z.astype(f32))
    if gate is not None and not norm_before_gate:
        u = u * gate
    grouped = u.reshape(rows, dim // group_size, group_size)
    inv_rms = jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + eps)
    y = (grouped * inv_rms).reshape(rows, dim) * weight.astype(f32)
    if gate is not None and norm_before_gate:
        y = y * gate
    return y.astype(x.dtype)


def rms_norm(
    x: jax.Array, weight: jax.Array, *, residual: jax.Array | None, eps: float
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """See :func:`pallas_kernels.rms_norm`; arguments are already validated."""
    total = x if residual is None else x + residual
    y = gated_rms_norm(
        total, None, weight, group_size=total.shape[1], eps=eps, norm_before_gate=False
    )
    return y if residual is None else (y, total)
