"""Arguments shared by every projection of the models, and static µP multipliers."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels as pk


def linear_kwargs(*, use_bias: bool, dtype: jnp.dtype, rngs: nnx.Rngs) -> dict[str, Any]:
    """``nnx.Linear`` arguments: compute and parameters in ``dtype``; fp32 models take IEEE
    fp32 products (GPUs would otherwise use tf32, about 1e-3 off the fp32 checkpoints'
    logits), bf16/fp16 ones the fast default."""
    return dict(
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=dtype,
        precision=pk.matmul_precision(dtype),
        rngs=rngs,
    )


def scaled(x: jax.Array, factor: float | jax.Array) -> jax.Array:
    """``x · factor`` for a static multiplier (µP, Falcon-H1; a float, or a per-channel
    constant broadcast over the last axis), computed in fp32 so that a bf16 ``x`` is not
    scaled by a bf16-rounded factor, and returned in ``x``'s dtype; ``x`` itself when the
    factor is 1, so families without multipliers trace no extra op."""
    if isinstance(factor, float | int) and factor == 1.0:
        return x
    return (x.astype(jnp.float32) * jnp.asarray(factor, jnp.float32)).astype(x.dtype)
