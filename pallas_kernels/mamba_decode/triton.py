"""The Mamba2 decode step as one Pallas kernel lowered through Triton.

One program per (row, block of heads, head-dim block), as ``selective_state_update``'s
kernel, reading in_proj's packed row ``z | x | B | C | dt`` in place (no slices of it are
materialised): for each of its heads it runs the causal conv + SiLU over the head's x
channels and its group's B and C channels (from the cached conv window and this token),
moves the x channels' window on, advances the head's SSM state tile one token, and writes
``u = (C · s + D x) · silu(z)`` with ``Σ u²`` over its head-dim block (what the gated norm
needs). B and C channels are shared by the heads of a group, so no program may move their
window while another reads it: their conv state is shifted after the kernel, by one XLA
scatter of the B | C columns.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import (
    checked_slots,
    decay_factor,
    process_dt,
    silu,
    slot_gather_index,
    slot_scatter_index,
)
from pallas_kernels._pallas import block_dim, compiler_params, masked_load, static_index
from pallas_kernels.conv1d.triton import conv_step, load_conv_taps, store_conv_window
from pallas_kernels.state_update.triton import BlockSizes, d_skip, ssm_advance
from pallas_kernels.state_update.triton import default_block_sizes as _state_update_blocks

__all__ = ["BlockSizes", "default_block_sizes", "mamba2_decode"]


def default_block_sizes(head_dim: int, state_dim: int, *, rows: int, num_heads: int) -> BlockSizes:
    """``selective_state_update``'s tiles (the state tiles are this kernel's bytes), with
    heads per program a divisor of H: a program runs whole blocks of heads (a clamped dead
    head would move its conv window twice)."""
    blocks = _state_update_blocks(head_dim, state_dim, rows=rows, num_heads=num_heads)
    block_h = blocks.block_h
    while num_heads % block_h:
        block_h //= 2
    if block_h == 1 < blocks.block_h:  # one head per program: that tiling's warps and stages
        return _state_update_blocks(head_dim, state_dim)
    return dataclasses.replace(blocks, block_h=block_h)


def check_block_sizes(config: BlockSizes, num_heads: int) -> None:
    if num_heads % config.block_h:
        raise ValueError(
            f"block_h={config.block_h} must divide the number of heads H={num_heads} "
            "(mamba2_decode runs whole blocks of heads)"
        )


def _kernel(
    slot_ref,  # [Bd] int32
    zxbcdt_ref,  # [Bd, 2·H·P + 2·G·N + H]: z | x | B | C | dt
    w_ref,  # [conv_dim, K]
    bias_ref,  # [conv_dim] or None
    A_ref,  # [H] fp32
    D_ref,  # [H] or [H, P] fp32, or None
    dt_bias_ref,  # [H] fp32 or None
    conv_in_ref,  # [S, K-1, conv_dim], aliased to conv_ref
    ssm_in_ref,  # [S, H, P, N], aliased to ssm_ref
    u_ref,  # [Bd, H·P]
    squares_ref,  # [Bd, H, num_p_blocks] fp32
    conv_ref,  # [S, K-1, conv_dim]
    ssm_ref,  # [S, H, P, N]
    *,
    num_groups: int,
    width: int,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    gate: bool,
    block_p: int,
    block_h: int,
):
    del conv_in_ref, ssm_in_ref  # the same buffers as conv_ref and ssm_ref
    r, hb, pb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32 = jnp.float32
    H, P, N = ssm_ref.shape[1:]
    G, d_inner = num_groups, H * P
    conv_dim = d_inner + 2 * G * N
    bp, bn = block_p, block_dim(N)
    p0 = pb * bp
    p_live = p0 + jnp.arange(bp) < P
    n_live = jnp.arange(bn) < N
    slot = slot_ref[r]

    def conv(c0, size, live):
        """Conv + SiLU of conv channels ``c0 ..`` of this row: (output, window, input)."""
        weights, bias, window = load_conv_taps(
            w_ref, bias_ref, conv_ref, slot, c0, size, live, width=width
        )
        current = masked_load(zxbcdt_ref.at[r, pl.ds(d_inner + c0, size)], live).astype(f32)
        return silu(conv_step(window, current, weights, bias)), window, current

    def advance(i, carry):
        h = hb * block_h + i
        g = h // (H // G)
        x, window, current = conv(h * P + p0, bp, p_live)
        # The x channels are this program's alone: their window moves on here.
        store_conv_window(conv_ref, slot, h * P + p0, bp, p_live, (*window, current)[1:])
        B = conv(d_inner + g * N, bn, n_live)[0]
        C = conv(d_inner + G * N + g * N, bn, n_live)[0]
        bias = None if dt_bias_ref is None else dt_bias_ref[h]
        dt = process_dt(
            zxbcdt_ref[r, d_inner + conv_dim + h].astype(f32),
            bias,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
        )
        tile_mask = p_live[:, None] & n_live[None, :]
        state_tile = ssm_ref.at[slot, h, pl.ds(p0, bp), pl.ds(static_index(0), bn)]
        state = masked_load(state_tile, tile_mask).astype(f32)
        state, y = ssm_advance(state, x, B, C, dt, decay_factor(dt * A_ref[h]))
        plgpu.store(state_tile, state.astype(ssm_ref.dtype), mask=tile_mask)
        u = y + d_skip(D_ref, h, p0, bp, p_live, x)
        if gate:
            u = u * silu(masked_load(zxbcdt_ref.at[r, pl.ds(h * P + p0, bp)], p_live).astype(f32))
        u = jnp.where(p_live, u, 0.0)
        plgpu.store(u_ref.at[r, pl.ds(h * P + p0, bp)], u.astype(u_ref.dtype), mask=p_live)
        squares_ref[r, h, pb] = jnp.sum(u * u)
        return carry

    def zero(i, carry):
        h = hb * block_h + i
        plgpu.store(u_ref.at[r, pl.ds(h * P + p0, bp)], jnp.zeros((bp,), u_ref.dtype), mask=p_live)
        squares_ref[r, h, pb] = jnp.zeros((), f32)
        return carry

    def heads(body):
        if block_h == 1:
            body(0, None)
        else:
            jax.lax.fori_loop(0, block_h, body, None)

    pl.when(slot >= 0)(lambda: heads(advance))
    pl.when(slot < 0)(lambda: heads(zero))


def mamba2_decode(
    zxbcdt: jax.Array,
    conv_state_cache: jax.Array,
    ssm_state_cache: jax.Array,
    conv_weight: jax.Array,
    A: jax.Array,
    *,
    slot_ids: jax.Array,
    conv_bias: jax.Array | None,
    D: jax.Array | None,
    dt_bias: jax.Array | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    gate: bool,
    config: BlockSizes,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """See :func:`pallas_kernels.mamba2_decode`; arguments are already validated."""
    rows = zxbcdt.shape[0]
    S, H, P, N = ssm_state_cache.shape
    conv_dim, width = conv_weight.shape
    d_inner = H * P
    G = (conv_dim - d_inner) // (2 * N)
    check_block_sizes(config, H)
    f32 = jnp.float32
    slot_ids = checked_slots(slot_ids, S)  # in bounds when called directly
    D = None if D is None else D.astype(f32)
    dt_bias = None if dt_bias is None else dt_bias.astype(f32)
    args = (
        slot_ids,
        zxbcdt,
        conv_weight,
        conv_bias,
        A.astype(f32),
        D,
        dt_bias,
        conv_state_cache,
        ssm_state_cache,
    )
    live = [a for a in args if a is not None]
    p_blocks = pl.cdiv(P, config.block_p)
    u, squares, conv_state, ssm_state = pl.pallas_call(
        functools.partial(
            _kernel,
            num_groups=G,
            width=width,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            gate=gate,
            block_p=config.block_p,
            block_h=config.block_h,
        ),
        grid=(rows, H // config.block_h, p_blocks),
        out_shape=(
            jax.ShapeDtypeStruct((rows, d_inner), zxbcdt.dtype),
            jax.ShapeDtypeStruct((rows, H, p_blocks), f32),
            jax.ShapeDtypeStruct(conv_state_cache.shape, conv_state_cache.dtype),
            jax.ShapeDtypeStruct(ssm_state_cache.shape, ssm_state_cache.dtype),
        ),
        input_output_aliases={len(live) - 2: 2, len(live) - 1: 3},
        compiler_params=compiler_params(num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name=f"mamba2_decode_bp{config.block_p}_bh{config.block_h}",
    )(*args)
    # B and C's conv windows move on once every program has read them.
    bc = slice(d_inner, conv_dim)
    window = conv_state[slot_gather_index(slot_ids), 1:, bc]  # [Bd, K-2, 2·G·N]
    current = zxbcdt[:, d_inner + d_inner : d_inner + conv_dim][:, None, :]
    moved = jnp.concatenate([window, current.astype(conv_state.dtype)], axis=1)
    conv_state = conv_state.at[slot_scatter_index(slot_ids, S), :, bc].set(moved, mode="drop")
    return u, squares.sum(axis=-1), conv_state, ssm_state
