"""RMSNorm with fp32 statistics, and the residual add before it in the same pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels as pk

# Rows up to which a preference (``"auto"``, a family such as ``("mosaic", "triton")``) takes
# the Pallas kernel; above, XLA's add and norm. Bamba-9B decode at one row, alternated
# processes on one H100 (2026-11-28): 7.061 / 7.066 ms a step with the kernel against
# 7.101 / 7.136 with XLA's three kernels a norm. An earlier prototype of the same fusion
# was slower at 64 and 256 rows on an H200 (11.20 / 28.17 against 11.09 / 27.98 ms, one
# run, 2026-11-27): there a step is a few programs of the kernel (two rows each) against
# XLA's wider reduction. Up to 8 rows (at most four programs) the kernel is in the one-row
# regime. The shipped kernel at 64 and 256 rows, one H100 each (2026-11-28): 14.437 against
# 14.338 ms and 35.639 against 35.460 ms with XLA's; between 8 and 64 rows nothing was
# measured.
KERNEL_MAX_ROWS = 8


class RMSNorm(nnx.Module):
    """``y = x / sqrt(mean(x²) + eps) · weight``, statistics in fp32 (``pk.rms_norm``).

    ``implementation`` chooses its kernel as for the mixers' ops: a backend's name takes
    that backend at any size (``"triton"``: the Pallas kernel); a preference (``"auto"``, a
    sequence of names) takes the kernel up to ``KERNEL_MAX_ROWS`` rows, XLA above. A model
    on a mesh passes ``"xla"``, whose ops XLA partitions over the mesh like the rest of the
    residual stream (a Pallas call would need a ``shard_map`` of its own)."""

    def __init__(
        self,
        dim: int,
        *,
        eps: float,
        dtype: jnp.dtype = jnp.float32,
        implementation: str | tuple[str, ...] = "xla",
        rngs: nnx.Rngs | None = None,
    ):
        del rngs  # deterministic init (ones)
        self.eps = eps
        self.implementation = implementation
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(
        self, x: jax.Array, residual: jax.Array | None = None
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """x[..., D] → y[..., D]; with ``residual[..., D]`` (x's dtype) → ``(y, s)``, y the
        norm of the new residual stream ``s = x + residual``."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if residual is not None:
            residual = residual.reshape(rows.shape)
        implementation = self.implementation
        # A named backend is a demand, served (or refused) at any size.
        preference = implementation == "auto" or not isinstance(implementation, str)
        if preference and rows.shape[0] > KERNEL_MAX_ROWS:
            implementation = "xla"
        out = pk.rms_norm(
            rows, self.weight[...], residual=residual, eps=self.eps, implementation=implementation
        )
        if residual is None:
            return out.reshape(shape)
        y, total = out
        return y.reshape(shape), total.reshape(shape)
