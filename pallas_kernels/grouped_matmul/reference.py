"""Pure ``jax.numpy`` grouped matmul: the ``xla`` implementation (``jax.lax.ragged_dot``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import matmul_precision


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """See :func:`pallas_kernels.grouped_matmul`; arguments are already validated (and
    ``group_sizes`` clamped: non-negative, summing to at most M).

    Products accumulate in fp32 (float64 for float64 inputs, possible under x64).
    ``ragged_dot`` leaves rows past ``sum(group_sizes)`` to the implementation; they are
    selected to 0 here, so the op's contract does not depend on XLA's lowering.
    """
    y = jax.lax.ragged_dot(
        x,
        w,
        group_sizes,
        precision=matmul_precision(x.dtype),
        preferred_element_type=jnp.promote_types(x.dtype, jnp.float32),
    )
    owned = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(owned[:, None], y, 0.0).astype(x.dtype)
