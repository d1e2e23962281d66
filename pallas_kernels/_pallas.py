"""Helpers for Pallas kernels shared by every op's backend files."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Triton's tensor-core dot needs every dimension >= 16.
MIN_DOT_DIM = 16


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def block_dim(n: int, minimum: int = 1) -> int:
    """Power-of-two block covering ``n`` (Triton loads only power-of-two shapes)."""
    return max(next_power_of_2(n), minimum)


def compiler_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    """Launch parameters of a Triton ``pallas_call``: warps per program and the
    software-pipelining depth of its loops. Passing them also selects the Triton lowering
    (jax 0.10's default GPU lowering was Mosaic GPU)."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """``a @ b`` (either operand transposed) accumulated in fp32: every Triton kernel's dot.

    Precision rule: ``Precision.HIGHEST`` for every operand dtype. Lowered through Triton,
    fp32 operands then get IEEE fp32 products (Triton's default is tf32, ~3e-4 relative
    error) and bf16/fp16 operands the tensor cores' native path, which precision does not
    change: the same products ``matmul_precision`` asks XLA for in the references.
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


def masked_load(ref, mask: jax.Array | None) -> jax.Array:
    """``ref[...]`` reading 0 where ``mask`` is False (unmasked when ``mask`` is None)."""
    if mask is None:
        return plgpu.load(ref)
    return plgpu.load(ref, mask=mask, other=0.0)


def outer_mask(
    a: jax.Array | None, b: jax.Array | None, shape: tuple[int, int]
) -> jax.Array | None:
    """The ``shape`` mask ``a[:, None] & b[None, :]``; either may be None (no mask on that
    axis), both None gives None (an unmasked load)."""
    if a is None and b is None:
        return None
    a = jnp.ones((shape[0],), jnp.bool_) if a is None else a
    b = jnp.ones((shape[1],), jnp.bool_) if b is None else b
    return a[:, None] & b[None, :]


def tail_mask(start, block: int, size: int) -> jax.Array | None:
    """``start + arange(block) < size``, or None when every block is full."""
    if size % block == 0:
        return None
    return start + jnp.arange(block) < size


def static_index(i: int) -> jax.Array:
    """A static ref index as a scalar array (``ref.at[static_index(k)]``): interpret mode
    cannot discharge plain Python ints in a ref indexer (jax 0.11.2)."""
    return jnp.int32(i)


def for_each_tail_block(body, *, total, num_rows: int, block: int, program, num_programs: int):
    """Calls ``body(row0)`` for this program's share of the rows ``[total, num_rows)`` that
    no sequence owns: blocks ``[total + k * block, total + (k + 1) * block)`` with
    ``k ≡ program (mod num_programs)``. ``body`` masks rows ``>= num_rows`` itself.

    A few programs loop over the bucket's unowned rows, so a kernel's grid does not carry
    one mostly idle program per block of a tail that is empty in a full bucket.
    """
    num_blocks = pl.cdiv(jnp.maximum(num_rows - total, 0), block)
    count = pl.cdiv(jnp.maximum(num_blocks - program, 0), num_programs)

    def step(i, carry):
        body(total + (program + i * num_programs) * block)
        return carry

    jax.lax.fori_loop(0, count, step, 0)
