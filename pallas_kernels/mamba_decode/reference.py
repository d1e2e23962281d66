"""Pure ``jax.numpy`` Mamba2 decode step: the ``xla`` implementation of ``mamba2_decode``,
the conv update and the SSM state update of the op's own references, one after the other."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.conv1d import reference as conv_reference
from pallas_kernels.state_update import reference as state_update_reference


def split_zxbcdt(zxbcdt: jax.Array, num_heads: int, head_dim: int, conv_dim: int):
    """in_proj's row ``z | xBC | dt`` → ``(z[Bd, H·P], xBC[Bd, conv_dim], dt[Bd, H])``."""
    d_inner = num_heads * head_dim
    return jnp.split(zxbcdt, [d_inner, d_inner + conv_dim], axis=-1)


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
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """See :func:`pallas_kernels.mamba2_decode`; arguments are already validated."""
    f32 = jnp.float32
    rows = zxbcdt.shape[0]
    H, P, N = ssm_state_cache.shape[1:]
    d_inner = H * P
    G = (conv_weight.shape[0] - d_inner) // (2 * N)
    z, xbc, dt = split_zxbcdt(zxbcdt, H, P, conv_weight.shape[0])
    xbc, conv_state = conv_reference.causal_conv1d_update(
        xbc[:, None, :],
        conv_state_cache,
        conv_weight,
        conv_bias,
        slot_ids=slot_ids,
        activation="silu",
    )
    x, B, C = jnp.split(xbc[:, 0], [d_inner, d_inner + G * N], axis=-1)
    y, ssm_state = state_update_reference.selective_state_update(
        ssm_state_cache,
        x.reshape(rows, H, P),
        dt,
        A,
        B.reshape(rows, G, N),
        C.reshape(rows, G, N),
        slot_ids=slot_ids,
        D=D,
        z=z.reshape(rows, H, P) if gate else None,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
    )
    squares = jnp.sum(jnp.square(y.astype(f32)), axis=-1)  # [Bd, H]; padding rows: 0
    return y.reshape(rows, d_inner), squares, conv_state, ssm_state
