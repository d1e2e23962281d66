"""Pure ``jax.numpy`` attention over a slot-indexed or paged KV cache: the ``xla``
implementation.

Queries are taken in blocks of ``block_q`` packed rows aligned to sequence starts (a block
never holds two sequences, as in the kernels), one block per step of a ``lax.scan``: the
block gathers its sequence's keys and values once, ``[L, Hkv, D]`` (its slot's line, or
with a block table its ``max_blocks`` pages side by side, ``L = max_blocks * block_size``,
page ids clamped into the pool), and masks each row by its
absolute position ``kv_lens[b] − q_len[b] + i``: ``j < kv_len``, ``j <= pos`` (causal) and
``j > pos − W`` (sliding window). Masked keys and values are replaced by zeros before any
arithmetic, so whatever lies in the cache tail (NaN in the tests) never reaches the output.
Memory per step is bounded by one sequence's cache and ``[Hq, block_q, L]`` logits,
whatever T. Under differentiation the gather's transpose adds each sequence's key and value
gradients into its pages (shared pages sum over the sequences that read them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import matmul_precision
from pallas_kernels._pallas import next_power_of_2
from pallas_kernels.metadata import sequence_block_table

_MAX_BLOCK_Q = 128


def default_block_q(num_tokens: int, num_seqs: int) -> int:
    """About the mean query length (1 for decode), at most 128 rows."""
    return min(_MAX_BLOCK_Q, next_power_of_2(max(1, num_tokens // max(num_seqs, 1))))


def masked_tail_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    block_table: jax.Array | None = None,
    causal: bool,
    sm_scale: float,
    sliding_window: int | None,
) -> jax.Array:
    """See :func:`pallas_kernels.masked_tail_attention`; arguments are already validated."""
    f32 = jnp.float32
    num_tokens, num_q_heads, head_dim = q.shape
    num_slots, cache_len, num_kv_heads = k_cache.shape[:3]
    if block_table is not None:
        # Paged: num_slots is the pool's page count, cache_len the longest context.
        cache_len *= block_table.shape[1]
    num_seqs = slot_ids.shape[0]
    group = num_q_heads // num_kv_heads
    precision = matmul_precision(q.dtype)
    block_q = min(default_block_q(num_tokens, num_seqs), num_tokens)
    num_blocks = -(-num_tokens // block_q) + num_seqs
    block_seq, block_row = sequence_block_table(
        query_start_loc, block_size=block_q, num_blocks=num_blocks
    )
    # block_q spare rows at the end keep every block's slice in bounds (no clamping).
    q_padded = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))
    key_pos = jnp.arange(cache_len)
    offsets = jnp.arange(block_q)

    def attend(out, block):
        seq, row0 = block
        b = jnp.maximum(seq, 0)
        slot = slot_ids[b]
        seq_start, seq_end = query_start_loc[b], query_start_loc[b + 1]
        kv_len = kv_lens[b]
        rows = row0 + offsets
        live = (seq >= 0) & (slot >= 0) & (rows < seq_end)  # [bq]
        pos = kv_len - (seq_end - seq_start) + rows - seq_start
        visible = (key_pos[None, :] < kv_len) & live[:, None]  # [bq, L]
        if causal:
            visible &= key_pos[None, :] <= pos[:, None]
        if sliding_window is not None:
            visible &= key_pos[None, :] > pos[:, None] - sliding_window
        # A padding sequence (slot -1) reads line 0 below: its keys are all dead, or its
        # rows' gradient would be 0 · (line 0's tail), NaN where that holds NaN.
        key_live = ((key_pos < kv_len) & (seq >= 0) & (slot >= 0))[:, None, None]
        if block_table is None:
            line = jnp.clip(slot, 0, num_slots - 1)
            k_seq, v_seq = k_cache[line], v_cache[line]  # [L, Hkv, D]
        else:
            pages = jnp.clip(block_table[b], 0, num_slots - 1)  # [max_blocks]
            k_seq = k_cache[pages].reshape(cache_len, num_kv_heads, head_dim)
            v_seq = v_cache[pages].reshape(cache_len, num_kv_heads, head_dim)
        k = jnp.where(key_live, k_seq, 0)
        v = jnp.where(key_live, v_seq, 0).astype(f32)
        q_b = jax.lax.dynamic_slice_in_dim(q_padded, row0, block_q)
        q_g = q_b.reshape(block_q, num_kv_heads, group, head_dim)
        logits = jnp.einsum(
            "thrd,lhd->hrtl", q_g, k, precision=precision, preferred_element_type=f32
        )
        logits = logits * sm_scale
        mask = visible[None, None]
        logits = jnp.where(mask, logits, -jnp.inf)
        row_max = jnp.max(logits, axis=-1, keepdims=True)
        # Rows with no visible key: max is -inf; any finite shift keeps exp() at 0.
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        p = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        # Inside the matmul 0 · NaN is NaN: a value some rows do not see (causally later,
        # outside the window) would reach them through their p = 0. Non-finite values
        # enter it as 0, and the rows that see one (per head dim) get NaN there.
        v_finite = jnp.isfinite(v)
        o = jnp.einsum(
            "hrtl,lhd->thrd",
            p / jnp.maximum(denom, jnp.finfo(f32).tiny),
            jnp.where(v_finite, v, 0.0),
            precision=matmul_precision(f32),
        )
        seen = jnp.einsum("tl,lhd->thd", visible.astype(f32), (~v_finite).astype(f32)) > 0
        o = jnp.where(seen[:, :, None, :], jnp.nan, o)
        o = o.reshape(block_q, num_q_heads, head_dim).astype(q.dtype)
        # Rows past the sequence belong to the next block: keep what is there.
        old = jax.lax.dynamic_slice_in_dim(out, row0, block_q)
        o = jnp.where(live[:, None, None], o, old)
        return jax.lax.dynamic_update_slice_in_dim(out, o, row0, 0), None

    # Rows no sequence owns (bucket padding, slot -1) stay zero.
    out = jnp.zeros((num_tokens + block_q, num_q_heads, head_dim), q.dtype)
    out, _ = jax.lax.scan(attend, out, (block_seq, block_row))
    return out[:num_tokens]
