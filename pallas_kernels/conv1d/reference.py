"""Pure ``jax.numpy`` causal depthwise conv1d: the ``xla`` implementation.

Cross-correlation over time, ``weight[:, K-1]`` multiplying the current token::

    y[t, c] = bias[c] + Σ_k weight[c, k] · xin[t - (K-1) + k, c]

where ``xin`` is a sequence's tokens preceded by its ``K-1`` column conv state (the last
``K-1`` *inputs* before it, oldest first) or by zeros. Vectorised over tokens: one shifted
gather per tap, each shifted read coming from the sequence itself or, before its start,
from the state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import silu, slot_gather_index, slot_scatter_index


def _activate(y: jax.Array, activation: str | None) -> jax.Array:
    return silu(y) if activation == "silu" else y


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    *,
    query_start_loc: jax.Array,
    conv_state_cache: jax.Array,
    slot_ids: jax.Array,
    has_initial_state: jax.Array,
    activation: str | None,
) -> tuple[jax.Array, jax.Array]:
    """See :func:`pallas_kernels.causal_conv1d`; arguments are already validated."""
    f32 = jnp.float32
    num_tokens, dim = x.shape
    width = weight.shape[1]
    num_slots = conv_state_cache.shape[0]
    num_seqs = slot_ids.shape[0]
    qsl = query_start_loc
    seq_len = qsl[1:] - qsl[:-1]

    # Each sequence's history: its slot's state, or zeros without an initial state.
    history = conv_state_cache[slot_gather_index(slot_ids)]  # [B, K-1, dim]
    use_state = has_initial_state & (slot_ids >= 0)
    history = jnp.where(use_state[:, None, None], history, 0).astype(f32)

    token = jnp.arange(num_tokens)
    seq = jnp.minimum(jnp.searchsorted(qsl[1:], token, side="right"), num_seqs - 1)
    local = token - qsl[seq]  # position within the sequence
    live = (token < qsl[-1]) & (slot_ids[seq] >= 0)

    w = weight.astype(f32)
    xf = x.astype(f32)
    y = xf * w[:, width - 1]
    for shift in range(1, width):
        from_x = xf[jnp.maximum(token - shift, 0)]
        from_state = history[seq, jnp.clip(width - 1 + local - shift, 0, width - 2)]
        y = y + jnp.where((local >= shift)[:, None], from_x, from_state) * w[:, width - 1 - shift]
    if bias is not None:
        y = y + bias.astype(f32)
    y = jnp.where(live[:, None], _activate(y, activation), 0.0).astype(x.dtype)

    # New state: the last K-1 inputs of history ++ tokens, per sequence.
    col = jnp.arange(width - 1)
    t_local = seq_len[:, None] - (width - 1) + col[None, :]  # [B, K-1]
    from_x = xf[jnp.clip(qsl[:-1, None] + t_local, 0, num_tokens - 1)]
    from_state = jnp.take_along_axis(
        history, jnp.clip(seq_len[:, None] + col[None, :], 0, width - 2)[..., None], axis=1
    )
    new_state = jnp.where((t_local >= 0)[..., None], from_x, from_state)
    writes = (slot_ids >= 0) & (seq_len > 0)
    target = slot_scatter_index(jnp.where(writes, slot_ids, -1), num_slots)
    cache = conv_state_cache.at[target].set(new_state.astype(conv_state_cache.dtype), mode="drop")
    return y, cache


def causal_conv1d_update(
    x: jax.Array,
    conv_state_cache: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    *,
    slot_ids: jax.Array,
    activation: str | None,
) -> tuple[jax.Array, jax.Array]:
    """See :func:`pallas_kernels.causal_conv1d_update`; ``x`` is ``[Bd, L, dim]`` here."""
    f32 = jnp.float32
    num_slots = conv_state_cache.shape[0]
    width = weight.shape[1]
    steps = x.shape[1]
    live = slot_ids >= 0
    state = conv_state_cache[slot_gather_index(slot_ids)]  # [Bd, K-1, dim]
    full = jnp.concatenate([state.astype(f32), x.astype(f32)], axis=1)  # [Bd, K-1+L, dim]
    w = weight.astype(f32)
    y = sum(full[:, k : k + steps] * w[:, k] for k in range(width))
    if bias is not None:
        y = y + bias.astype(f32)
    y = jnp.where(live[:, None, None], _activate(y, activation), 0.0).astype(x.dtype)
    new_state = full[:, steps:].astype(conv_state_cache.dtype)
    cache = conv_state_cache.at[slot_scatter_index(slot_ids, num_slots)].set(new_state, mode="drop")
    return y, cache
