"""Helpers for Pallas kernels shared by every op's backend files."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Triton's tensor-core dot needs every dimension >= 16.
MIN_DOT_DIM = 16


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def block_dim(n: int, minimum: int = 1) -> int:
    """Power-of-two block covering ``n`` (Triton loads only power-of-two shapes)."""
    return max(next_power_of_2(n), minimum)


def dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """``a @ b`` (optionally transposed operands) accumulated in fp32.

    ``Precision.HIGHEST`` makes fp32 operands use IEEE fp32 (Triton would use tf32 by
    default); bf16/fp16 operands run on the tensor cores either way.
    """
    contract_a = 0 if trans_a else 1
    contract_b = 1 if trans_b else 0
    return jax.lax.dot_general(
        a,
        b,
        (((contract_a,), (contract_b,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def static_index(i: int) -> jax.Array:
    """A static ref index as a scalar array (``ref.at[static_index(k)]``): interpret mode
    cannot discharge plain Python ints in a ref indexer (jax 0.11.2)."""
    return jnp.int32(i)
