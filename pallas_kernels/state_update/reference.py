"""Pure ``jax.numpy`` decode SSM step: the ``xla`` implementation of
``selective_state_update``. One token per row; each row's state is gathered from the
cache by its slot id, advanced one step, and scattered back (padding rows write nothing).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import (
    decay_factor,
    matmul_precision,
    process_dt,
    silu,
    slot_gather_index,
    slot_scatter_index,
)


def selective_state_update(
    state_cache: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    *,
    slot_ids: jax.Array,
    D: jax.Array | None,
    z: jax.Array | None,
    dt_bias: jax.Array | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> tuple[jax.Array, jax.Array]:
    """See :func:`pallas_kernels.selective_state_update`; arguments are already validated."""
    f32 = jnp.float32
    num_slots = state_cache.shape[0]
    rows, num_heads, head_dim = x.shape
    num_groups, state_dim = B.shape[1:]
    heads_per_group = num_heads // num_groups
    live = slot_ids >= 0
    precision = matmul_precision(x.dtype)

    state = state_cache[slot_gather_index(slot_ids)].astype(f32)  # [Bd, H, P, N]
    state = state.reshape(rows, num_groups, heads_per_group, head_dim, state_dim)
    dtp = process_dt(dt.astype(f32), dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    decay = decay_factor(dtp * A.astype(f32))  # [Bd, H]
    decay = decay.reshape(rows, num_groups, heads_per_group)[..., None, None]
    dt_x = (dtp[..., None] * x.astype(f32)).reshape(rows, num_groups, heads_per_group, head_dim)
    state = decay * state + jnp.einsum("bgrp,bgn->bgrpn", dt_x, B.astype(f32), precision=precision)
    y = jnp.einsum("bgrpn,bgn->bgrp", state, C.astype(f32), precision=precision).reshape(
        rows, num_heads, head_dim
    )
    if D is not None:
        y = y + D.astype(f32).reshape(num_heads, -1) * x.astype(f32)
    if z is not None:
        y = y * silu(z.astype(f32))
    y = jnp.where(live[:, None, None], y, 0.0).astype(x.dtype)
    state = state.reshape(rows, num_heads, head_dim, state_dim).astype(state_cache.dtype)
    new_cache = state_cache.at[slot_scatter_index(slot_ids, num_slots)].set(state, mode="drop")
    return y, new_cache
