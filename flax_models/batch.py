"""``ForwardBatch``: the per-step description of a packed, variable-length batch.

Built once per step (by the model for a plain forward, by the engine when serving) and
shared by every layer. Tokens are packed ``[T, ...]``; sequence ``b`` owns rows
``query_start_loc[b]:query_start_loc[b + 1]`` and continues ``num_computed_tokens[b]``
tokens already in its cache slot ``slot_ids[b]`` (``-1``: padding).

The first ``num_decode`` sequences are decode rows, one token each (rows ``0..num_decode``
of the packed tokens); Mamba layers run them through the single-step update kernels and
the remaining (prefill) sequences through the chunked scan. Example, ``num_decode = 2``::

    query_start_loc      = [0, 1, 2, 7, 10]       two decode rows, prefills of 5 and 3
    num_computed_tokens  = [40, 9, 0, 16]
    prefill layout       : query_start_loc [0, 5, 8] (rows 2..10), computed [0, 16]

When serving, attention K/V live in a page pool and ``block_table[b]`` lists sequence
``b``'s pages; with prefix caching ``snapshots`` says where the step saves Mamba states at
block boundaries (``StateSnapshots``).

A *grouped* batch (``groups = G > 1``, the engine on a mesh with a ``"dp"`` axis of size G;
``make_grouped_forward_batch``) is G batches of the same shapes stacked on a leading axis,
``query_start_loc[G, B + 1]``, ``positions[G, T]``, …, over packed tokens ``[G · T, ...]``
(group g's are rows ``g·T .. (g+1)·T``). Group g's slot ids, pages and snapshot entries are
local to its share of the caches (``flax_models.sharding``: each dp group of devices holds
its own slots), and ``batch.group(g)`` is its ordinary batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels as pk


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateSnapshots:
    """Where one step saves Mamba2 conv/SSM states into the snapshot pools (prefix caching).

    A snapshot holds the state *after* an absolute position ``p`` that ends a block (``p``
    a multiple of the block size, itself a multiple of the chunk size): the SSM state is
    the chunk-aligned scan's state after the chunk ending at ``p``, the conv state the last
    K−1 conv inputs before ``p``. Entries ``< 0`` save nothing (all int32).

    Attributes:
      decode_rows: [Qd] decode row of each decode save (few per step: a row ends a block
        once every block size tokens, and the saves gather the rows' states).
      decode_ids: [Qd] the entry its state after this step's token goes to.
      prefill_seqs: [Q] prefill sequence (index among the prefill rows) of each save.
      prefill_positions: [Q] its boundary ``p``, with ``num_computed < p <= num_computed
        + new tokens`` of that sequence.
      prefill_ids: [Q] the entry to write.
    """

    decode_rows: jax.Array
    decode_ids: jax.Array
    prefill_seqs: jax.Array
    prefill_positions: jax.Array
    prefill_ids: jax.Array


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
      chunks: chunk-aligned layout of the prefill sequences for the SSD scan.
      num_decode: static number of leading one-token decode sequences.
      block_table: [B, max_blocks] each sequence's KV pages (paged caches), or None
        (contiguous slot caches).
      snapshots: the states this step saves (prefix caching), or None.
      groups: static; > 1 for a grouped batch (every array above has a leading axis
        ``[groups, ...]``, one batch per slot group, with group-local ids).
    """

    query_start_loc: jax.Array
    num_computed_tokens: jax.Array
    positions: jax.Array
    slot_ids: jax.Array
    kv_lens: jax.Array
    chunks: pk.ChunkMetadata
    num_decode: int = dataclasses.field(default=0, metadata=dict(static=True))
    block_table: jax.Array | None = None
    snapshots: StateSnapshots | None = None
    groups: int = dataclasses.field(default=1, metadata=dict(static=True))

    def group(self, g: int) -> ForwardBatch:
        """Group ``g``'s own batch of a grouped batch (``groups = 1``)."""
        if self.groups == 1:
            raise ValueError("group() needs a grouped batch (groups > 1)")
        return dataclasses.replace(jax.tree.map(lambda x: x[g], self), groups=1)

    @property
    def has_initial_state(self) -> jax.Array:
        """bool[B]: the sequence continues cached conv/SSM state."""
        return (self.num_computed_tokens > 0) & (self.slot_ids >= 0)

    @property
    def prefill_query_start_loc(self) -> jax.Array:
        """[B - num_decode + 1]: the prefill sequences' starts within rows num_decode.."""
        return self.query_start_loc[self.num_decode :] - self.num_decode


def make_forward_batch(
    query_start_loc: jax.Array,
    num_computed_tokens: jax.Array,
    slot_ids: jax.Array,
    *,
    num_tokens: int,
    chunk_size: int,
    num_decode: int = 0,
    block_table: jax.Array | None = None,
    snapshots: StateSnapshots | None = None,
) -> ForwardBatch:
    """Derives positions, kv_lens and the prefill chunk layout (jittable, no host sync);
    ``block_table`` and ``snapshots`` pass through (see ``ForwardBatch``)."""
    qsl = query_start_loc.astype(jnp.int32)
    computed = num_computed_tokens.astype(jnp.int32)
    num_seqs = computed.shape[0]
    if not 0 <= num_decode <= min(num_seqs, num_tokens):
        raise ValueError(f"{num_decode=} must be in [0, min(B={num_seqs}, T={num_tokens})]")
    token = jnp.arange(num_tokens)
    seq = jnp.minimum(pk.search_sorted(qsl[1:], token, side="right"), num_seqs - 1)
    live = token < qsl[-1]
    positions = jnp.where(live, computed[seq] + token - qsl[seq], 0).astype(jnp.int32)
    prefill_tokens, prefill_seqs = num_tokens - num_decode, num_seqs - num_decode
    chunks = (
        pk.chunk_metadata(
            qsl[num_decode:] - num_decode,
            computed[num_decode:],
            chunk_size=chunk_size,
            max_chunks=pk.max_chunks_for(prefill_tokens, max(prefill_seqs, 1), chunk_size),
        )
        if prefill_seqs
        else None
    )
    return ForwardBatch(
        query_start_loc=qsl,
        num_computed_tokens=computed,
        positions=positions,
        slot_ids=slot_ids.astype(jnp.int32),
        kv_lens=computed + qsl[1:] - qsl[:-1],
        chunks=chunks,
        num_decode=num_decode,
        block_table=None if block_table is None else block_table.astype(jnp.int32),
        snapshots=snapshots,
    )


def make_grouped_forward_batch(
    query_start_loc: jax.Array,
    num_computed_tokens: jax.Array,
    slot_ids: jax.Array,
    *,
    num_tokens: int,
    chunk_size: int,
    num_decode: int = 0,
    block_table: jax.Array | None = None,
    snapshots: StateSnapshots | None = None,
) -> ForwardBatch:
    """``make_forward_batch`` of each of G slot groups, stacked (``groups = G``):
    ``query_start_loc[G, B + 1]``, ``num_computed_tokens[G, B]``, ``slot_ids[G, B]``
    (group-local), ``block_table[G, B, max_blocks]`` and ``snapshots`` with a leading G axis
    too; ``num_tokens`` and ``num_decode`` are each group's (the packed tokens are
    ``[G · num_tokens]``)."""
    groups = query_start_loc.shape[0]
    if groups < 2:
        raise ValueError(f"a grouped batch needs >= 2 groups, got query_start_loc {groups=}")
    batch = jax.vmap(
        lambda qsl, computed, slots, table, snaps: make_forward_batch(
            qsl,
            computed,
            slots,
            num_tokens=num_tokens,
            chunk_size=chunk_size,
            num_decode=num_decode,
            block_table=table,
            snapshots=snaps,
        )
    )(query_start_loc, num_computed_tokens, slot_ids, block_table, snapshots)
    return dataclasses.replace(batch, groups=groups)
