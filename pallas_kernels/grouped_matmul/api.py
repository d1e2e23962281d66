"""``grouped_matmul``: validation and dispatch for the MoE expert matmul.

Rows of ``x`` are sorted by expert (``jax.lax.ragged_dot`` semantics)::

    group_sizes = [3, 0, 2]          M = 6 rows, E = 3 experts
    rows  0 1 2 | 3 4 | 5
    w     w[0]  | w[2]| (past sum(group_sizes) = 5: y = 0)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _validation as checks
from pallas_kernels.backend import Backend, Call, Implementation, Op
from pallas_kernels.grouped_matmul import mosaic, reference, triton, triton_config


def _triton_default_config(x, w, group_sizes, **_) -> triton_config.BlockSizes:
    (M, K), (E, _, N) = x.shape, w.shape
    return triton_config.default_block_sizes(M, K, N, E, x.dtype)


def _mosaic_default_config(x, w, group_sizes, **_) -> mosaic.BlockSizes:
    (M, K), (E, _, N) = x.shape, w.shape
    return mosaic.default_block_sizes(M, K, N, E, x.dtype)


@functools.cache
def _mosaic_differentiable(config: mosaic.BlockSizes):
    """The Mosaic GPU forward kernel; its gradients run the Triton backward kernels (Pallas
    kernels too; the Mosaic kernel has no backward of its own)."""

    @jax.custom_vjp
    def matmul(x, w, group_sizes):
        return mosaic.grouped_matmul(x, w, group_sizes, config=config)

    def forward(x, w, group_sizes):
        return matmul(x, w, group_sizes), (x, w, group_sizes)

    def backward(residuals, dy):
        x, w, group_sizes = residuals
        blocks = _triton_default_config(x, w, group_sizes)
        return (*triton.backward(x, w, group_sizes, dy, config=blocks), None)

    matmul.defvjp(forward, backward)
    return matmul


def _mosaic_grouped_matmul(x, w, group_sizes, *, config: mosaic.BlockSizes) -> jax.Array:
    return _mosaic_differentiable(config)(x, w, group_sizes)


GROUPED_MATMUL = Op(
    "grouped_matmul",
    (
        Backend(
            "mosaic",
            _mosaic_grouped_matmul,
            config_type=mosaic.BlockSizes,
            default_config=_mosaic_default_config,
            supports=mosaic.supports,
            check_config=mosaic.check_block_sizes,
        ),
        Backend(
            "triton",
            triton.grouped_matmul,
            config_type=triton_config.BlockSizes,
            default_config=_triton_default_config,
        ),
        Backend("xla", reference.grouped_matmul),
    ),
)


def _check_group_size_values(group_sizes: jax.Array, num_rows: int) -> None:
    """Data check on concrete ``group_sizes`` (skipped under ``jax.jit``, where the api
    clamps instead): every size non-negative, the sum at most M."""
    sizes = np.asarray(jax.device_get(group_sizes)).astype(np.int64)
    if np.any(sizes < 0):
        raise ValueError(
            f"group_sizes must be non-negative, got {sizes[sizes < 0].tolist()} "
            f"at experts {np.flatnonzero(sizes < 0).tolist()}"
        )
    if sizes.sum() > num_rows:
        raise ValueError(f"sum(group_sizes)={int(sizes.sum())} exceeds the M={num_rows} rows of x")


def _clamped_group_sizes(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """int32[E] that every backend receives: expert ``e`` owns rows
    ``[min(c[e-1], M), min(c[e], M))`` with ``c = cumsum(max(group_sizes, 0))``, so sizes
    are non-negative and sum to at most M whatever the (traced) data holds."""
    sizes = jnp.clip(group_sizes, 0, num_rows).astype(jnp.int32)
    ends = jnp.minimum(jnp.cumsum(sizes, dtype=jnp.int32), num_rows)
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


def grouped_matmul(
    x: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    *,
    implementation: Implementation = "auto",
    config: mosaic.BlockSizes | triton_config.BlockSizes | None = None,
) -> jax.Array:
    """Grouped matmul of expert-sorted rows: ``y[r] = x[r] @ w[e]`` for the rows ``r`` of
    expert ``e`` (``jax.lax.ragged_dot`` semantics), accumulated in fp32.

    Expert ``e`` owns rows ``[offset_e, offset_e + group_sizes[e])`` with
    ``offset_e = sum(group_sizes[:e])``; rows past ``sum(group_sizes)`` give 0.

    Args:
      x: x[M, K] rows sorted by expert.
      w: w[E, K, N] expert weights, in ``x``'s dtype.
      group_sizes: int[E] rows per expert. Concrete values must be non-negative and sum to
        at most M (``ValueError`` otherwise); traced ones are clamped to that (negative
        sizes count as 0, rows past M are dropped), so kernels stay in bounds.
      implementation: "auto" | "xla" | "triton" | "mosaic", or a sequence of backend names
        to take the first that serves the call (see ``pallas_kernels.backend``).
      config: the chosen backend's block sizes (``grouped_matmul.mosaic.BlockSizes`` or
        ``grouped_matmul.triton_config.BlockSizes``).

    Returns:
      y[M, N] in ``x``'s dtype.
    """
    x, w, group_sizes = (jnp.asarray(a) for a in (x, w, group_sizes))
    checks.check_floating("x", x)
    checks.check_floating("w", w)
    if x.ndim != 2:
        raise ValueError(f"x must have shape [M, K], got {x.shape}")
    M, K = x.shape
    if w.ndim != 3 or w.shape[1] != K:
        raise ValueError(f"w must have shape [E, K, N] with K={K}, got {w.shape}")
    E, _, N = w.shape
    if w.dtype != x.dtype:
        raise ValueError(f"w must have x's dtype {x.dtype}, got {w.dtype}")
    checks.check_integer("group_sizes", group_sizes)
    checks.check_shape("group_sizes", group_sizes, (E,), "[E]")
    if not isinstance(group_sizes, jax.core.Tracer):
        _check_group_size_values(group_sizes, M)
    call = Call(
        (x, w, _clamped_group_sizes(group_sizes, M)),
        {},
        empty=(lambda: jnp.zeros((M, N), x.dtype)) if 0 in (M, K, N, E) else None,
    )
    return GROUPED_MATMUL.run(call, implementation, config)
