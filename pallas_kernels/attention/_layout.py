"""Token → sequence bookkeeping shared by the attention reference and the KV-cache writes.

Example: ``query_start_loc = [0, 3, 4]``, ``kv_lens = [5, 9]`` (T = 5, the last row is
bucket padding)::

    token      0  1  2  3  4
    seq        0  0  0  1  -
    q_len      3  3  3  1  -
    position   2  3  4  8  -      kv_lens[seq] - q_len[seq] + (token - query_start_loc[seq])
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """Per packed token: its sequence, absolute position, cache slot and liveness (all [T])."""

    seq: jax.Array
    position: jax.Array
    slot: jax.Array
    kv_len: jax.Array
    live: jax.Array  # inside a sequence whose slot is not -1


def token_layout(
    num_tokens: int, query_start_loc: jax.Array, kv_lens: jax.Array, slot_ids: jax.Array
) -> TokenLayout:
    num_seqs = slot_ids.shape[0]
    token = jnp.arange(num_tokens)
    seq = jnp.minimum(jnp.searchsorted(query_start_loc[1:], token, side="right"), num_seqs - 1)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    position = kv_lens[seq] - q_len + token - query_start_loc[seq]
    slot = slot_ids[seq]
    live = (token < query_start_loc[-1]) & (slot >= 0)
    return TokenLayout(seq=seq, position=position, slot=slot, kv_len=kv_lens[seq], live=live)
