"""KV-cache writes and mask → length conversion (pure ``jax.numpy``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.attention._layout import token_layout

# Additive masks: a key is masked when its bias is at or below this (−inf, any float
# dtype's lowest value, the −1e9 and −1e4 conventions all are); above it a key is visible.
MASKED_BIAS_THRESHOLD = -1e4


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter of this step's keys/values; see :func:`pallas_kernels.write_kv`."""
    num_slots, cache_len = k_cache.shape[:2]
    layout = token_layout(k.shape[0], query_start_loc, kv_lens, slot_ids)
    in_range = layout.live & (layout.position >= 0) & (layout.position < cache_len)
    slot = jnp.where(in_range, layout.slot, num_slots)  # out of range: dropped
    position = jnp.where(in_range, layout.position, 0)
    k_cache = k_cache.at[slot, position].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[slot, position].set(v.astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache


def kv_lens_from_mask(mask: jax.Array) -> jax.Array:
    """See :func:`pallas_kernels.kv_lens_from_mask`."""
    if mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer):
        visible = mask != 0
    else:
        visible = mask > MASKED_BIAS_THRESHOLD
    ends = jnp.arange(1, mask.shape[1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(visible, ends, 0), axis=1).astype(jnp.int32)
