"""Grouped (ragged) matmul: the MoE expert matmul, ``jax.lax.ragged_dot`` semantics."""

from pallas_kernels.grouped_matmul.api import grouped_matmul

__all__ = ["grouped_matmul"]
