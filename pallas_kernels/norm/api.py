"""``gated_rms_norm``: validation and dispatch."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _validation as checks
from pallas_kernels.backend import Backend, Call, Implementation, Op
from pallas_kernels.norm import reference, triton

GATED_RMS_NORM = Op(
    "gated_rms_norm",
    (
        Backend(
            "triton",
            triton.gated_rms_norm,
            config_type=triton.BlockSizes,
            default_config=lambda *_, group_size, **__: triton.default_block_sizes(group_size),
        ),
        Backend("xla", reference.gated_rms_norm),
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
    config: triton.BlockSizes | None = None,
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
      config: the chosen backend's block sizes (``norm.triton.BlockSizes``).

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
    if not eps >= 0:
        raise ValueError(f"{eps=} must be >= 0")
    call = Call(
        (x, z, weight),
        dict(group_size=int(group_size), eps=float(eps), norm_before_gate=bool(norm_before_gate)),
        empty=(lambda: x) if T == 0 else None,
    )
    return GATED_RMS_NORM.run(call, implementation, config)
