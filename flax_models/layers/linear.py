"""Arguments shared by every projection of the models."""

from __future__ import annotations

from typing import Any

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
