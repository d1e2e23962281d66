"""The models' projections (``Linear``, ``Einsum``, :func:`matmul`), the arguments they
share, and static µP multipliers."""

from __future__ import annotations

import math
from collections.abc import Callable
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


# XLA's GPU simplifier rewrites the product of a vector and a matrix into a broadcast
# multiply and a reduction (dot strength reduction) when the two operands hold fewer than
# this many elements together, and a one-row activation x[1, K] is such a vector once XLA
# drops its unit dimension. The rewrite materialises x · W in the weight's dtype (bf16
# products, rounded before they are summed) and reads it back: on an H200 a one-row k_proj
# of Bamba-9B (4096 × 1024) and its v_proj took 32 µs for 17 MB that a GEMM reads in 4 µs
# (jax 0.11.2). Two rows are a matrix, and the product stays a GEMM.
STRENGTH_REDUCED_ELEMENTS = 10_000_000


def as_gemm(product: Callable[[jax.Array], jax.Array], x: jax.Array, weight_size: int) -> jax.Array:
    """``product(x)`` for x[..., K] and a weight of ``weight_size`` elements, with a single
    row of x padded to two (and the product's first row kept) where XLA would otherwise
    turn the product into a multiply and a reduction (``STRENGTH_REDUCED_ELEMENTS``). Any
    other x goes straight through: padding costs a small copy kernel, which larger weights
    and several rows do not need."""
    if math.prod(x.shape[:-1]) != 1 or x.shape[-1] + weight_size >= STRENGTH_REDUCED_ELEMENTS:
        return product(x)
    rows = jnp.pad(x.reshape(1, x.shape[-1]), ((0, 1), (0, 0)))
    out = product(rows)[:1]
    return out.reshape(*x.shape[:-1], *out.shape[1:])


def matmul(x: jax.Array, kernel: jax.Array, *, precision: jax.lax.Precision | None) -> jax.Array:
    """``x[..., K] @ kernel[K, N]`` in the kernel's dtype, a single row kept a GEMM
    (:func:`as_gemm`): the tp layers' row-parallel products of their local weights and
    the tied vocabulary head."""
    return as_gemm(
        lambda rows: jnp.dot(rows.astype(kernel.dtype), kernel, precision=precision),
        x,
        kernel.size,
    )


class Linear(nnx.Linear):
    """``nnx.Linear`` whose one-row products stay GEMMs (:func:`as_gemm`)."""

    def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
        call = super().__call__
        return as_gemm(lambda x: call(x, out_sharding), inputs, self.kernel.size)


class Einsum(nnx.Einsum):
    """``nnx.Einsum`` (over the last input axis) whose one-row products stay GEMMs
    (:func:`as_gemm`)."""

    def __call__(self, inputs: jax.Array, einsum_str: str | None = None, out_sharding=None):
        call = super().__call__
        return as_gemm(lambda x: call(x, einsum_str, out_sharding), inputs, self.kernel.size)
