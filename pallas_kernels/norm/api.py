"""``gated_rms_norm`` and ``rms_norm``: validation and dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _validation as checks
from pallas_kernels.backend import Backend, Call, Implementation, Op
from pallas_kernels.norm import reference, triton, triton_config

GATED_RMS_NORM = Op(
    "gated_rms_norm",
    (
        Backend(
            "triton",
            triton.gated_rms_norm,
            config_type=triton_config.BlockSizes,
            default_config=lambda *_, group_size, **__: triton_config.default_block_sizes(
                group_size
            ),
        ),
        Backend("xla", reference.gated_rms_norm),
    ),
)

RMS_NORM = Op(
    "rms_norm",
    (
        Backend(
            "triton",
            triton.rms_norm,
            config_type=triton_config.BlockSizes,
            default_config=lambda x, *_, **__: triton_config.default_block_sizes(x.shape[1]),
        ),
        Backend("xla", reference.rms_norm),
    ),
)


def gated_rms_norm(
    x: jax.Array,
    z: jax.Array | None,
    weight: jax.Array,
    *,
    group_size: int,
    eps: float = 1e-5,
    norm_before_gate: bool = False,
    implementation: Implementation = "auto",
    config: triton_config.BlockSizes | None = None,
) -> jax.Array:
    """Grouped RMSNorm with a SiLU gate, statistics in fp32.

    ``norm_before_gate=False`` (Mamba2): ``y = rmsnorm_g(x · silu(z)) · weight``;
    ``True``: ``y = rmsnorm_g(x) · weight · silu(z)``. ``rmsnorm_g`` normalises each group
    of ``group_size`` consecutive channels (``d_inner / n_groups`` in Mamba2).

    Args:
      x: x[T, Dm].
      z: z[T, Dm] gate, or None for a plain grouped RMSNorm.
      weight: weight[Dm].
      group_size: channels per group; must divide Dm.
      eps: added to the mean square.
      norm_before_gate: see above.
      implementation: "auto" | "xla" | "triton" | "mosaic", or a sequence of backend names
        to take the first that serves the call (see ``pallas_kernels.backend``).
      config: the chosen backend's block sizes (``norm.triton_config.BlockSizes``).

    Returns:
      y[T, Dm] in ``x``'s dtype.
    """
    x, weight = jnp.asarray(x), jnp.asarray(weight)
    z = None if z is None else jnp.asarray(z)
    checks.check_floating("x", x)
    if x.ndim != 2:
        raise ValueError(f"x must have shape [T, Dm], got {x.shape}")
    T, Dm = x.shape
    if z is not None:
        checks.check_floating("z", z)
        checks.check_shape("z", z, (T, Dm), "[T, Dm]")
    checks.check_floating("weight", weight)
    checks.check_shape("weight", weight, (Dm,), "[Dm]")
    group_size = checks.check_int("group_size", group_size, low=1)
    if Dm % group_size:
        raise ValueError(f"{group_size=} must be >= 1 and divide Dm={Dm}")
    eps = checks.check_float("eps", eps, low=0.0)
    call = Call(
        (x, z, weight),
        dict(group_size=int(group_size), eps=float(eps), norm_before_gate=bool(norm_before_gate)),
        empty=(lambda: x) if T == 0 else None,
    )
    return GATED_RMS_NORM.run(call, implementation, config)


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    *,
    residual: jax.Array | None = None,
    eps: float = 1e-5,
    implementation: Implementation = "auto",
    config: triton_config.BlockSizes | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """RMSNorm over the last axis, statistics in fp32: ``y = x / sqrt(mean(x²) + eps) ·
    weight``; with ``residual``, the pre-norm block's residual add and norm in one pass.

    With ``residual`` it normalises ``s = x + residual`` (added in x's dtype, as
    ``x + residual`` is) and returns ``(y, s)``: a pre-norm model adds a block's output
    ``x`` to its residual stream and normalises the new stream for the next block; the
    Triton kernel reads x and the residual once and writes s and y once, one launch where
    XLA takes three (an add, the mean square, the scaling).

    Args:
      x: x[T, D].
      weight: weight[D].
      residual: residual[T, D] in x's dtype, or None.
      eps: added to the mean square.
      implementation: "auto" | "xla" | "triton" | "mosaic", or a sequence of backend names
        to take the first that serves the call (see ``pallas_kernels.backend``).
      config: the chosen backend's block sizes (``norm.triton_config.BlockSizes``).

    Returns:
      y[T, D] in x's dtype; ``(y[T, D], s[T, D])`` with a residual.
    """
    x, weight = jnp.asarray(x), jnp.asarray(weight)
    checks.check_floating("x", x)
    if x.ndim != 2:
        raise ValueError(f"x must have shape [T, D], got {x.shape}")
    T, D = x.shape
    checks.check_floating("weight", weight)
    checks.check_shape("weight", weight, (D,), "[D]")
    if residual is not None:
        residual = jnp.asarray(residual)
        checks.check_shape("residual", residual, (T, D), "[T, D]")
        if residual.dtype != x.dtype:
            raise ValueError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
    eps = checks.check_float("eps", eps, low=0.0)
    call = Call(
        (x, weight),
        dict(residual=residual, eps=float(eps)),
        empty=(lambda: x if residual is None else (x, x)) if T == 0 else None,
    )
    return RMS_NORM.run(call, implementation, config)
