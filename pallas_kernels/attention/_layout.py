"""Bookkeeping shared by the attention backends: token → sequence layout (reference,
KV-cache writes, decode), the prefill work table and its launch order, and the mask and
scale operands with the jitted call that every kernel backend runs (:func:`jit_attention`).

Example: ``query_start_loc = [0, 3, 4]``, ``kv_lens = [5, 9]`` (T = 5, the last row is
bucket padding)::

    token      0  1  2  3  4
    seq        0  0  0  1  -
    q_len      3  3  3  1  -
    position   2  3  4  8  -      kv_lens[seq] - q_len[seq] + (token - query_start_loc[seq])
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Final

import jax
import jax.numpy as jnp

from pallas_kernels._common import LOG2E, search_sorted
from pallas_kernels.metadata import sequence_block_table

# The mask reaches the kernels as data, a band of positions: a query at ``pos`` sees keys
# ``pos - left < j <= pos + right`` (and ``j < kv_len``); causal is ``right = 0``, a
# sliding window is ``left = W``, and NO_WINDOW (longer than any position) leaves a side
# open. With the logit scale also an operand, one compiled kernel per shape serves causal,
# windowed and bidirectional layers alike.
NO_WINDOW: Final = 1 << 30


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
    seq = jnp.minimum(search_sorted(query_start_loc[1:], token, side="right"), num_seqs - 1)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    position = kv_lens[seq] - q_len + token - query_start_loc[seq]
    slot = slot_ids[seq]
    live = (token < query_start_loc[-1]) & (slot >= 0)
    return TokenLayout(seq=seq, position=position, slot=slot, kv_len=kv_lens[seq], live=live)


def prefill_table(
    query_start_loc: jax.Array, *, num_tokens: int, block_q: int, max_q_blocks: int
) -> tuple[jax.Array, jax.Array]:
    """Table entry → (sequence, first packed row) of the prefill query blocks (jittable, no
    host sync); :func:`prefill_schedule` then puts the entries in launch order.

    Query blocks start at each sequence's first row and are numbered along the packed
    rows (:func:`~pallas_kernels.metadata.sequence_block_table`); entries take them in
    reverse (a sequence's last blocks, the heaviest under the causal mask, first). Example,
    ``block_q = 4``, ``query_start_loc = [0, 5, 6, 6, 14]``, T = 16 (B = 4,
    ``max_q_blocks = cdiv(16, 4) + 4 = 8``)::

        q_len      5 1 0 8      blocks per sequence  2 1 0 2      block ends  2 3 3 5
        program    0   1  2  3  4   5  6  7
        block      4   3  2  1  0   -  -  -
        seq        3   3  1  0  0  -1 -1 -1
        first row  10  6  5  4  0   0  0  0

    Entries 5-7 are unused (:func:`prefill_schedule` makes them zero rows [14, 16)).

    Returns:
      ``(prog_seq, prog_row)``, int32[max_q_blocks] each; ``prog_seq`` is -1 past the live
      count.
    """
    # The sequence-aligned blocks of every row-block kernel, live entries reversed.
    block_seq, block_row = sequence_block_table(
        jnp.clip(query_start_loc, 0, num_tokens), block_size=block_q, num_blocks=max_q_blocks
    )
    num_live = jnp.sum(block_seq >= 0)
    program = jnp.arange(max_q_blocks, dtype=jnp.int32)
    live = program < num_live
    entry = jnp.where(live, num_live - 1 - program, program)
    return block_seq[entry], jnp.where(live, block_row[entry], 0).astype(jnp.int32)


def prefill_schedule(
    prog_seq: jax.Array,
    prog_row: jax.Array,
    *,
    seq_end: jax.Array,
    seq_offset: jax.Array,
    seq_kv_len: jax.Array,
    seq_slot: jax.Array,
    band: jax.Array,
    block_q: int,
    block_k: int,
) -> tuple[jax.Array, jax.Array]:
    """The prefill table (:func:`prefill_table`) in launch order (jittable, no host sync).

    A live entry costs its number of KV blocks (the kernel's loop bounds), a padding
    sequence's entry 0; entries are sorted by cost, longest first (stable), so the GPU
    starts the longest programs first and ends on short ones (longest-processing-time-first
    scheduling). Unused entries (-1) go last and zero the rows no sequence owns: the k-th
    takes rows ``[total + k * block_q, total + (k + 1) * block_q)``, ``total`` the last
    sequence end; there are always enough of them, since a sequence of ``n > 0`` rows
    uses ``cdiv(n, block_q) < n / block_q + 1`` of the ``cdiv(T, block_q) + B`` entries.
    Example, the :func:`prefill_table` example with ``kv_lens = [5, 1, 0, 8]`` (no cached
    keys), causal, ``block_k = 4``::

        entry        0   1   2   3   4   5   6   7      (prefill_table order)
        seq          3   3   1   0   0  -1  -1  -1
        first row   10   6   5   4   0   0   0   0
        positions  4-7 0-3   0   4 0-3   -   -   -
        KV blocks    2   1   1   2   1   -   -   -

        launch order 0   3   1   2   4   5   6   7
        seq          3   0   3   1   0  -1  -1  -1
        first row   10   4   6   5   0  14  18  22   (rows [14, 16) get zeroed)

    Arguments are the kernel's per-sequence operands (see ``_prefill_kernel``) and
    ``band = (left, right)`` (:func:`band_operand`).

    Returns:
      ``(prog_seq, prog_row)`` reordered, unused entries' rows filled in.
    """
    num_seqs = seq_end.shape[0]
    live = prog_seq >= 0
    seq = jnp.clip(prog_seq, 0, num_seqs - 1)
    # The kernel's bounds (see _prefill_kernel): keys [lo, hi) are visible to some row.
    pos_first = prog_row + seq_offset[seq]
    pos_last = pos_first + jnp.minimum(block_q, seq_end[seq] - prog_row) - 1
    hi = jnp.clip(pos_last + band[1] + 1, 0, seq_kv_len[seq])
    lo = jnp.maximum(pos_first - band[0] + 1, 0)
    num_kv_blocks = jnp.where(hi > lo, (hi + block_k - 1) // block_k - lo // block_k, 0)
    cost = jnp.where(live, jnp.where(seq_slot[seq] >= 0, num_kv_blocks, 0), -1)
    unused_index = jnp.cumsum(~live) - 1
    row = jnp.where(live, prog_row, seq_end[num_seqs - 1] + unused_index * block_q)
    order = jnp.argsort(-cost, stable=True)
    return prog_seq[order], row[order].astype(jnp.int32)


def scale_operand(sm_scale: float | jax.Array) -> jax.Array:
    """fp32[1]: ``sm_scale * log2(e)`` (logits in log2 units for ``exp2``)."""
    return (jnp.asarray(sm_scale, jnp.float32) * LOG2E).reshape(1)


def backward_scale_operand(sm_scale: float | jax.Array) -> jax.Array:
    """fp32[2]: ``(sm_scale * log2(e), sm_scale)``, the backward kernels' scales (the
    probabilities are recomputed in log2 units, the gradients scaled by ``sm_scale``)."""
    return jnp.concatenate([scale_operand(sm_scale), jnp.asarray(sm_scale, jnp.float32).reshape(1)])


def band_operand(causal: bool | jax.Array, sliding_window: int | jax.Array | None) -> jax.Array:
    """int32[2]: ``(left, right)``, keys ``pos - left < j <= pos + right`` are visible."""
    left = NO_WINDOW if sliding_window is None else sliding_window
    right = jnp.where(causal, 0, NO_WINDOW)
    return jnp.stack([jnp.asarray(left, jnp.int32), right.astype(jnp.int32)])


def jit_attention(
    kernel: Callable[..., jax.Array],
    *arrays: jax.Array,
    causal: bool,
    sm_scale: float,
    sliding_window: int | None,
    static: dict[str, Hashable],
    **batch: jax.Array,
) -> jax.Array:
    """What a backend's ``masked_tail_attention`` runs: ``kernel(*arrays, **batch,
    causal=..., sm_scale=..., sliding_window=..., **static)`` under ``jax.jit``.

    ``arrays`` (``q``, the caches) and ``batch`` (``query_start_loc``, ``kv_lens``,
    ``slot_ids``) are operands. ``causal``, ``sm_scale`` and ``sliding_window`` reach
    ``kernel`` as scalar operands too (bool[], fp32[], int32[] with ``NO_WINDOW`` for no
    window), so one compiled program per shape serves every mask and scale: changing them
    does not recompile. ``kernel`` and ``static`` (block sizes, ``interpret``) are
    compile-time constants.
    """
    mask = dict(
        causal=jnp.asarray(causal),
        sm_scale=jnp.asarray(sm_scale, jnp.float32),
        sliding_window=jnp.asarray(
            NO_WINDOW if sliding_window is None else sliding_window, jnp.int32
        ),
    )
    return _jitted(kernel, arrays, batch | mask, static=tuple(sorted(static.items())))


@functools.partial(jax.jit, static_argnames=("kernel", "static"))
def _jitted(kernel, arrays, operands, *, static) -> jax.Array:
    return kernel(*arrays, **operands, **dict(static))


def is_decode_shaped(num_tokens: int, num_seqs: int) -> bool:
    """Static rule for the split-KV path: no more tokens than sequences (every sequence
    has at most one token on average; the kernels stay correct for any layout)."""
    return num_tokens <= num_seqs
