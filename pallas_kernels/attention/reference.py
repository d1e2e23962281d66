"""Pure ``jax.numpy`` attention over a slot-indexed KV cache: the ``xla`` implementation.

Queries are processed in blocks of ``block_q`` packed tokens (``lax.map``), each token
against its own slot's keys with a mask built from its absolute position:
``j < kv_len``, ``j <= pos`` (causal) and ``j > pos - W`` (sliding window). Masked keys and
values are replaced by zeros before any arithmetic, so whatever lies in the cache tail (NaN
in the tests) never reaches the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import matmul_precision, slot_gather_index
from pallas_kernels.attention._layout import token_layout

# Bytes of gathered keys (or values) per query block; bounds the reference's memory.
_GATHER_BYTES = 1 << 27


def masked_tail_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    causal: bool,
    sm_scale: float,
    sliding_window: int | None,
) -> jax.Array:
    """See :func:`pallas_kernels.masked_tail_attention`; arguments are already validated."""
    f32 = jnp.float32
    num_tokens, num_q_heads, head_dim = q.shape
    cache_len, num_kv_heads = k_cache.shape[1:3]
    group = num_q_heads // num_kv_heads
    precision = matmul_precision(q.dtype)
    layout = token_layout(num_tokens, query_start_loc, kv_lens, slot_ids)

    row_bytes = cache_len * num_kv_heads * head_dim * 4
    block_q = max(1, min(num_tokens, _GATHER_BYTES // row_bytes))
    num_blocks = -(-num_tokens // block_q)
    pad = num_blocks * block_q - num_tokens

    def blocks(a, fill=0):
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
        return a.reshape(num_blocks, block_q, *a.shape[1:])

    key_pos = jnp.arange(cache_len)

    def attend(block):
        q_b, pos, kv_len, slot, live = block
        visible = (key_pos[None, :] < kv_len[:, None]) & live[:, None]  # [bq, L]
        if causal:
            visible &= key_pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            visible &= key_pos[None, :] > pos[:, None] - sliding_window
        keep = visible[:, :, None, None]
        k = jnp.where(keep, k_cache[slot_gather_index(slot)], 0).astype(f32)  # [bq, L, Hkv, D]
        v = jnp.where(keep, v_cache[slot_gather_index(slot)], 0).astype(f32)
        q_g = q_b.astype(f32).reshape(block_q, num_kv_heads, group, head_dim)
        logits = jnp.einsum("thrd,tlhd->thrl", q_g, k, precision=precision) * sm_scale
        mask = visible[:, None, None, :]
        logits = jnp.where(mask, logits, -jnp.inf)
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        # Rows with no visible key: max is -inf; any finite shift keeps exp() at 0.
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        p = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        out = jnp.einsum("thrl,tlhd->thrd", p, v, precision=precision) / jnp.maximum(
            denom, jnp.finfo(f32).tiny
        )
        return out.reshape(block_q, num_q_heads, head_dim).astype(q.dtype)

    out = jax.lax.map(
        attend,
        (
            blocks(q),
            blocks(layout.position),
            blocks(layout.kv_len),
            blocks(layout.slot, fill=-1),
            blocks(layout.live, fill=False),
        ),
    )
    return out.reshape(num_blocks * block_q, num_q_heads, head_dim)[:num_tokens]
