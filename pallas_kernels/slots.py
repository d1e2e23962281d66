"""Slot-state helpers: gather and scatter per-sequence states by cache slot id.

A slot-indexed cache ``[S, ...]`` holds one state per slot; a step's B sequences name
their slots in ``slot_ids[B]`` (checked: ``-1``, or any id outside ``[0, S)``, is padding,
which reads nothing and writes nothing). These are what ``ssd_scan(state_cache=...)``
does around the scan, public so that models can keep states of their own (prefix
snapshots, copies between slots) by the same rules::

    initial = pk.slots.gather_states(state_cache, slot_ids, has_initial_state)
    y, final = pk.ssd_scan(..., metadata=md, initial_states=initial)
    state_cache = pk.slots.write_final_states(state_cache, final, md, slot_ids)

``search_sorted`` (``jnp.searchsorted`` for a step's short sorted arrays) is re-exported
here and at the package top: the slot and row lookups of a step are built from it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import search_sorted, slot_gather_index, slot_scatter_index
from pallas_kernels.metadata import ChunkMetadata

__all__ = ["gather_states", "live_rows", "scatter_states", "search_sorted", "write_final_states"]


def live_rows(num_tokens: int, metadata: ChunkMetadata, slot_ids: jax.Array) -> jax.Array:
    """bool[T]: the rows of sequences with a slot (checked ``slot_ids``, -1 padding); rows
    of padding sequences and bucket rows past the chunks are False."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    chunk = search_sorted(metadata.cu_chunk_seqlens, rows, side="right").astype(jnp.int32) - 1
    seq = metadata.seq_idx[jnp.clip(chunk, 0, metadata.max_chunks - 1)]
    owned = rows < metadata.cu_chunk_seqlens[-1]
    return owned & (seq >= 0) & (slot_ids[jnp.maximum(seq, 0)] >= 0)


def gather_states(
    state_cache: jax.Array, slot_ids: jax.Array, has_initial_state: jax.Array
) -> jax.Array:
    """initial_states[B, H, P, N] in fp32: ``state_cache[slot]`` where the sequence has a
    state, else 0. ``slot_ids`` are checked (-1: padding); the mask selects, so whatever
    an unread line holds (NaN included) never reaches the result."""
    live = has_initial_state.astype(bool) & (slot_ids >= 0)
    gathered = state_cache[slot_gather_index(slot_ids)].astype(jnp.float32)
    return jnp.where(live[:, None, None, None], gathered, 0.0)


def write_final_states(
    state_cache: jax.Array, states: jax.Array, metadata: ChunkMetadata, slot_ids: jax.Array
) -> jax.Array:
    """``state_cache`` with each sequence's final state ``states[b]`` written to its slot
    (checked ``slot_ids``). A sequence without new tokens writes nothing (as in
    ``causal_conv1d``): its slot, and the whole cache of an empty batch, come back
    bit-identical."""
    writes = jnp.where(metadata.last_chunk_indices >= 0, slot_ids, -1)
    return scatter_states(state_cache, states, writes)


def scatter_states(state_cache: jax.Array, states: jax.Array, slot_ids: jax.Array) -> jax.Array:
    """``state_cache`` with ``states[b]`` written to slot ``slot_ids[b]``; padding (-1)
    writes nothing (it is sent past the cache and dropped: a -1 index would wrap)."""
    index = slot_scatter_index(slot_ids, state_cache.shape[0])
    return state_cache.at[index].set(states.astype(state_cache.dtype), mode="drop")
