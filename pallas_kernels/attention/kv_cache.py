"""KV-cache writes and mask → length conversion (pure ``jax.numpy``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import slot_scatter_index
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
    block_table: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter of this step's keys/values; see :func:`pallas_kernels.write_kv`."""
    line, row = kv_destination(
        k.shape[0], k_cache.shape, query_start_loc, kv_lens, slot_ids, block_table
    )
    line = slot_scatter_index(line, k_cache.shape[0])  # -1 must not wrap: dropped
    k_cache = k_cache.at[line, row].set(k.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[line, row].set(v.astype(v_cache.dtype), mode="drop")
    return k_cache, v_cache


def kv_destination(
    num_tokens: int,
    cache_shape: tuple[int, ...],
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    block_table: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """Where each packed token's key and value go: ``(line[T], row[T])`` int32, the cache
    line (slot, or page with ``block_table``) and the row in it; ``line`` is ``-1`` for a
    token that writes nothing (padding, outside a sequence, position outside the slot or
    past the table's capacity, or a page outside the pool), ``row`` then 0.

    Shared by the ``xla`` and Triton ``write_kv``: one rule for what is dropped.
    """
    num_lines, line_len = cache_shape[:2]
    layout = token_layout(num_tokens, query_start_loc, kv_lens, slot_ids)
    position = layout.position
    if block_table is None:
        in_range = layout.live & (position >= 0) & (position < line_len)
        line, row = layout.slot, position
    else:
        max_blocks = block_table.shape[1]
        in_range = layout.live & (position >= 0) & (position < max_blocks * line_len)
        block = jnp.clip(position // line_len, 0, max_blocks - 1)
        line = block_table[layout.seq, block]
        row = position % line_len
    in_range &= (line >= 0) & (line < num_lines)
    line = jnp.where(in_range, line, -1).astype(jnp.int32)
    return line, jnp.where(in_range, row, 0).astype(jnp.int32)


def kv_lens_from_mask(mask: jax.Array) -> jax.Array:
    """See :func:`pallas_kernels.kv_lens_from_mask`."""
    if mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer):
        visible = mask != 0
    else:
        visible = mask > MASKED_BIAS_THRESHOLD
    ends = jnp.arange(1, mask.shape[1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(visible, ends, 0), axis=1).astype(jnp.int32)
