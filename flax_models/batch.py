"""``ForwardBatch``: the per-step description of a packed, variable-length batch.

Built once per step (by the model for a plain forward, by the batch builder when serving)
and shared by every layer. Tokens are packed ``[T, ...]``; sequence ``b`` owns rows
``query_start_loc[b]:query_start_loc[b + 1]`` and continues ``num_computed_tokens[b]``
tokens already in its cache slot ``slot_ids[b]`` (``-1``: padding).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels as pk


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    """Arrays of one step (all int32 unless noted).

    Attributes:
      query_start_loc: [B + 1] packed start of each sequence.
      num_computed_tokens: [B] tokens already processed (state in the cache).
      positions: [T] absolute position of each packed token (0 for bucket padding).
      slot_ids: [B] cache slot per sequence, -1 for padding sequences.
      kv_lens: [B] keys per sequence after this step (num_computed + new tokens).
      chunks: chunk-aligned layout for the SSD scan.
    """

    query_start_loc: jax.Array
    num_computed_tokens: jax.Array
    positions: jax.Array
    slot_ids: jax.Array
    kv_lens: jax.Array
    chunks: pk.ChunkMetadata

    @property
    def has_initial_state(self) -> jax.Array:
        """bool[B]: the sequence continues cached conv/SSM state."""
        return (self.num_computed_tokens > 0) & (self.slot_ids >= 0)


def make_forward_batch(
    query_start_loc: jax.Array,
    num_computed_tokens: jax.Array,
    slot_ids: jax.Array,
    *,
    num_tokens: int,
    chunk_size: int,
    max_chunks: int | None = None,
) -> ForwardBatch:
    """Derives positions, kv_lens and the chunk layout (jittable, no host sync)."""
    qsl = query_start_loc.astype(jnp.int32)
    computed = num_computed_tokens.astype(jnp.int32)
    num_seqs = computed.shape[0]
    token = jnp.arange(num_tokens)
    seq = jnp.minimum(jnp.searchsorted(qsl[1:], token, side="right"), num_seqs - 1)
    live = token < qsl[-1]
    positions = jnp.where(live, computed[seq] + token - qsl[seq], 0).astype(jnp.int32)
    if max_chunks is None:
        max_chunks = pk.max_chunks_for(num_tokens, num_seqs, chunk_size)
    chunks = pk.chunk_metadata(qsl, computed, chunk_size=chunk_size, max_chunks=max_chunks)
    return ForwardBatch(
        query_start_loc=qsl,
        num_computed_tokens=computed,
        positions=positions,
        slot_ids=slot_ids.astype(jnp.int32),
        kv_lens=computed + qsl[1:] - qsl[:-1],
        chunks=chunks,
    )
