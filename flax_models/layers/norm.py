"""RMSNorm with fp32 statistics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class RMSNorm(nnx.Module):
    """``y = x / sqrt(mean(x²) + eps) · weight``, statistics in fp32."""

    def __init__(
        self, dim: int, *, eps: float, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs | None = None
    ):
        del rngs  # deterministic init (ones)
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * xf).astype(x.dtype)
