"""Small numerics shared by the references and kernels of several ops (written once)."""

from __future__ import annotations

import math
from typing import Final

import jax
import jax.numpy as jnp

LOG2E: Final = math.log2(math.e)  # e^v = 2^(v log2 e): kernels use the cheaper exp2


def process_dt(
    dt: jax.Array,
    dt_bias: jax.Array | None,
    *,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> jax.Array:
    """``dt' = clamp(softplus(dt + dt_bias) if dt_softplus else dt + dt_bias, *dt_limit)``.

    ``dt[..., H]`` in fp32; ``dt_bias[H]`` broadcasts over the leading axes.
    """
    if dt_bias is not None:
        dt = dt + dt_bias.astype(jnp.float32)
    if dt_softplus:
        # softplus(v) = log(1 + e^v), stable for large |v|.
        dt = jnp.logaddexp(dt, 0.0)
    # NaN stays NaN: Triton's min/max on the GPU return the other operand, so a clamp alone
    # would turn a NaN dt into a limit there and hide it (the references propagate it).
    return jnp.where(jnp.isnan(dt), dt, jnp.clip(dt, dt_limit[0], dt_limit[1]))


def search_sorted(sorted_values: jax.Array, queries: jax.Array, *, side: str = "left") -> jax.Array:
    """``jnp.searchsorted`` for a step's short sorted arrays (sequence, chunk or tile
    boundaries): every query compared with every value, one fused reduction. The default
    binary search is a loop whose every iteration is its own small kernels, each launched
    by the host, which a one-row step or a short kernel cannot hide."""
    return jnp.searchsorted(sorted_values, queries, side=side, method="compare_all")


def silu(v: jax.Array) -> jax.Array:
    """``v * sigmoid(v)``."""
    return v * jax.nn.sigmoid(v)


def silu_grad(v: jax.Array) -> jax.Array:
    """``d silu(v) / dv = s (1 + v (1 - s))``, ``s = sigmoid(v)``."""
    s = jax.nn.sigmoid(v)
    return s * (1.0 + v * (1.0 - s))


def decay_factor(exponent: jax.Array) -> jax.Array:
    """``exp(exponent)`` of an SSM decay exponent, clamped to <= 0: a decay never grows
    (an exponent above 0 comes only from bad data or rounding, and would overflow)."""
    return jnp.exp(jnp.minimum(exponent, 0.0))


def checked_slots(slot_ids: jax.Array, num_slots: int) -> jax.Array:
    """Slot ids with anything outside ``[0, S)`` (padding's -1, bad data) mapped to -1:
    such rows read and write nothing. The api applies it to every call
    (``_validation.check_slot_ids``); kernels apply it again so that they stay in bounds
    when called directly."""
    return jnp.where((slot_ids >= 0) & (slot_ids < num_slots), slot_ids, -1).astype(jnp.int32)


def slot_scatter_index(slot_ids: jax.Array, num_slots: int) -> jax.Array:
    """Slot ids with padding (``-1``) mapped past the cache, so ``mode="drop"`` writes skip it.

    NOTE: negative indices wrap around in ``x.at[i]``; ``-1`` must never reach a scatter.
    """
    return jnp.where(slot_ids >= 0, slot_ids, num_slots)


def slot_gather_index(slot_ids: jax.Array) -> jax.Array:
    """Slot ids with padding mapped to slot 0 for gathers whose result the caller masks."""
    return jnp.maximum(slot_ids, 0)


def matmul_precision(dtype: jnp.dtype) -> jax.lax.Precision:
    """Matmul precision that follows the inputs' dtype.

    fp32 inputs get IEEE fp32 products (GPUs would otherwise use tf32, ~3e-4 relative
    error); bf16/fp16 inputs, already rounded, keep the fast default.
    """
    if jnp.dtype(dtype) == jnp.float32:
        return jax.lax.Precision.HIGHEST
    return jax.lax.Precision.DEFAULT
