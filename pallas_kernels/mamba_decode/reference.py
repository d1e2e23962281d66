"""Pure ``jax.numpy`` Mamba2 decode step: the ``xla`` implementation of ``mamba2_decode``,
the three ops' references on the split ``z | xBC | dt`` row."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.conv1d import reference as conv
from pallas_kernels.norm import reference as norm
from pallas_kernels.state_update import reference as state_update


def composed(
    zxbcdt: jax.Array,
    conv_state_cache: jax.Array,
    conv_weight: jax.Array,
    conv_bias: jax.Array | None,
    ssm_state_cache: jax.Array,
    A_log: jax.Array,
    *,
    conv_update: Callable,
    state_update: Callable,
    gated_norm: Callable,
    num_groups: int,
    slot_ids: jax.Array,
    D: jax.Array | None,
    dt_bias: jax.Array | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    norm_weight: jax.Array | None,
    norm_group_size: int,
    norm_eps: float,
    norm_before_gate: bool,
    gate: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The step as three ops on ``z``, ``xBC`` and ``dt`` sliced from the packed rows:
    ``conv_update``, ``state_update`` and ``gated_norm`` take the arguments of
    ``causal_conv1d_update``, ``selective_state_update`` and ``gated_rms_norm`` (the
    references here; the Triton backend's backward passes its own ops)."""
    rows = zxbcdt.shape[0]
    H, P, N = ssm_state_cache.shape[1:]
    d_inner, conv_dim, gn = H * P, conv_weight.shape[0], num_groups * N
    z = zxbcdt[:, :d_inner]
    xbc = zxbcdt[:, d_inner : d_inner + conv_dim]
    dt = zxbcdt[:, d_inner + conv_dim :]
    xbc, conv_state_cache = conv_update(
        xbc[:, None, :],
        conv_state_cache,
        conv_weight,
        conv_bias,
        slot_ids=slot_ids,
        activation="silu",
    )
    xbc = xbc.reshape(rows, conv_dim)
    y, ssm_state_cache = state_update(
        ssm_state_cache,
        xbc[:, :d_inner].reshape(rows, H, P),
        dt,
        -jnp.exp(A_log.astype(jnp.float32)),
        xbc[:, d_inner : d_inner + gn].reshape(rows, num_groups, N),
        xbc[:, d_inner + gn :].reshape(rows, num_groups, N),
        slot_ids=slot_ids,
        D=D,
        z=z.reshape(rows, H, P) if norm_weight is None and gate else None,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
    )
    y = y.reshape(rows, d_inner)
    if norm_weight is not None:
        y = gated_norm(
            y,
            z,
            norm_weight,
            group_size=norm_group_size,
            eps=norm_eps,
            norm_before_gate=norm_before_gate,
        )
    return y, conv_state_cache, ssm_state_cache


def mamba2_decode(
    zxbcdt: jax.Array,
    conv_state_cache: jax.Array,
    conv_weight: jax.Array,
    conv_bias: jax.Array | None,
    ssm_state_cache: jax.Array,
    A_log: jax.Array,
    **options,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """See :func:`pallas_kernels.mamba2_decode`; arguments are already validated."""
    return composed(
        zxbcdt,
        conv_state_cache,
        conv_weight,
        conv_bias,
        ssm_state_cache,
        A_log,
        conv_update=conv.causal_conv1d_update,
        state_update=state_update.selective_state_update,
        gated_norm=norm.gated_rms_norm,
        **options,
    )
