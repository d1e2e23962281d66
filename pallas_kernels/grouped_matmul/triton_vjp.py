"""Backward kernel of the grouped (MoE expert) matmul as a Pallas kernel lowered through
Triton: ``dw[e] = x_eᵀ dy_e``, one program per ``[block_k, block_n]`` tile of ``dw[e]``,
looping over the expert's rows (``dx`` is the forward's tile kernel on ``w[e]ᵀ``;
``grouped_matmul/triton.py`` wires both into its ``jax.custom_vjp``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._pallas import (
    compiler_params,
    dot,
    masked_load,
    outer_mask,
    tail_mask,
)
from pallas_kernels.grouped_matmul.triton_config import BlockSizes


def _weight_grad_kernel(
    offset_ref,  # [E + 1] int32: expert e owns rows [offset[e], offset[e + 1])
    x_ref,  # [M, K]
    dy_ref,  # [M, N]
    dw_ref,  # [E, K, N]
    *,
    block_m: int,
    block_k: int,
    block_n: int,
    num_k_blocks: int,
    num_n_blocks: int,
):
    pid = pl.program_id(0)
    blocks_per_expert = num_k_blocks * num_n_blocks
    e = jax.lax.div(pid, blocks_per_expert)
    r = jax.lax.rem(pid, blocks_per_expert)
    k0 = pl.multiple_of(jax.lax.div(r, num_n_blocks) * block_k, block_k)
    n0 = pl.multiple_of(jax.lax.rem(r, num_n_blocks) * block_n, block_n)
    K, N = dw_ref.shape[1:]
    k_live, n_live = tail_mask(k0, block_k, K), tail_mask(n0, block_n, N)
    ks, ns = pl.ds(k0, block_k), pl.ds(n0, block_n)
    start, end = offset_ref[e], offset_ref[e + 1]

    def step(i, acc):
        r0 = start + i * block_m
        live = jnp.arange(block_m) < end - r0
        rows = pl.ds(r0, block_m)
        a = masked_load(x_ref.at[rows, ks], outer_mask(live, k_live, (block_m, block_k)))
        b = masked_load(dy_ref.at[rows, ns], outer_mask(live, n_live, (block_m, block_n)))
        return acc + dot(a, b, trans_a=True)

    # lax.div: the row count is >= 0, and jnp's floor division does not lower through Triton.
    num_steps = jax.lax.div(end - start + block_m - 1, block_m)
    acc = jax.lax.fori_loop(0, num_steps, step, jnp.zeros((block_k, block_n), jnp.float32))
    plgpu.store(
        dw_ref.at[e, ks, ns],
        acc.astype(dw_ref.dtype),
        mask=outer_mask(k_live, n_live, (block_k, block_n)),
    )


def weight_grad(
    x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *, config: BlockSizes, interpret: bool
) -> jax.Array:
    """``dw[e] = x_eᵀ dy_e`` over each expert's rows (0 for an expert without rows)."""
    (_, K), N, E = x.shape, dy.shape[1], group_sizes.shape[0]
    blocks = config
    offsets = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes, dtype=jnp.int32)]
    )
    num_k_blocks, num_n_blocks = pl.cdiv(K, blocks.block_k), pl.cdiv(N, blocks.block_n)
    return pl.pallas_call(
        functools.partial(
            _weight_grad_kernel,
            block_m=blocks.block_m,
            block_k=blocks.block_k,
            block_n=blocks.block_n,
            num_k_blocks=num_k_blocks,
            num_n_blocks=num_n_blocks,
        ),
        grid=(E * num_k_blocks * num_n_blocks,),
        out_shape=jax.ShapeDtypeStruct((E, K, N), x.dtype),
        compiler_params=compiler_params(num_warps=blocks.num_warps, num_stages=blocks.num_stages),
        interpret=interpret,
        name=f"grouped_matmul_dw_bm{blocks.block_m}_bk{blocks.block_k}_bn{blocks.block_n}",
    )(offsets, x, dy)
