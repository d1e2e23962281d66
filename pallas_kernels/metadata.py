"""Chunk-aligned metadata for variable-length Mamba2 batches, and bucket helpers.

Tokens of a batch are packed, ``x[T, ...]``, sequence ``b`` owning packed rows
``query_start_loc[b]:query_start_loc[b + 1]``; ``num_computed_tokens[b]`` tokens of it were
processed in earlier steps (their state sits in the cache).

Chunk alignment (as vLLM's chunk-aligned Mamba2): a chunk never holds tokens of two
sequences, and every chunk ends at an *absolute* position of its sequence that is a multiple
of ``chunk_size``, or at the sequence's last new token. States therefore land exactly on
chunk boundaries, and a prefix computed in an earlier step continues seamlessly. Worked
example, ``chunk_size = 8``::

    seq  nc   n   chunks (packed positions)
    0     0  20   [0,8) [8,16) [16,20)
    1    13  10   [20,23) [23,30)        13 % 8 = 5: first chunk takes 8 - 5 = 3 tokens
    2    16   5   [30,35)
    3     5   2   [35,37)

    cu_chunk_seqlens   = [0, 8, 16, 20, 23, 30, 35, 37]
    seq_idx            = [0, 0, 0, 1, 1, 2, 3]
    last_chunk_indices = [2, 4, 5, 6]

Nothing is padded in memory: a short chunk is masked ("virtual padding"). A sequence with
``nc`` computed and ``n > 0`` new tokens has ``cdiv(nc + n, cs) - nc // cs <= n // cs + 2``
chunks, so a batch has at most ``T // cs + 2 * B`` (and at most ``T``). ``max_chunks`` is
static (it comes from the bucket); chunks past ``num_chunks`` have length 0 and
``seq_idx = -1``, and kernels skip them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import search_sorted
from pallas_kernels._validation import check_int, check_integer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkMetadata:
    """Per-step chunk layout, built once by :func:`chunk_metadata` and shared by all layers.

    Attributes:
      cu_chunk_seqlens: int32[max_chunks + 1], packed start of each chunk; entries past
        ``num_chunks`` repeat the end of the last real token.
      seq_idx: int32[max_chunks], the sequence each chunk belongs to, ``-1`` for padding.
      last_chunk_indices: int32[B], each sequence's last chunk, ``-1`` without new tokens.
      num_chunks: int32[], number of real chunks.
      chunk_size: the (static) chunk size the layout was built for (:func:`chunk_metadata`
        sets it); ``ssd_scan`` refuses metadata built for another one. Metadata built by
        hand from the four arrays (``ChunkMetadata(cu_chunk_seqlens, seq_idx,
        last_chunk_indices, num_chunks)``) leaves it None: the scan takes its own
        ``chunk_size`` as the layout's.
    """

    cu_chunk_seqlens: jax.Array
    seq_idx: jax.Array
    last_chunk_indices: jax.Array
    num_chunks: jax.Array
    chunk_size: int | None = dataclasses.field(
        default=None, metadata=dict(static=True), kw_only=True
    )

    @property
    def max_chunks(self) -> int:
        """The static number of chunk slots (real chunks plus padding)."""
        return self.seq_idx.shape[0]


def max_chunks_for(num_tokens: int, num_seqs: int, chunk_size: int) -> int:
    """Static upper bound on the number of chunks of a bucket (at least 1).

    Each sequence adds at most two partial chunks to its ``n // chunk_size`` full ones, and
    every chunk holds at least one token.
    """
    if chunk_size < 1:
        raise ValueError(f"{chunk_size=} must be >= 1")
    bound = min(num_tokens // chunk_size + 2 * num_seqs, num_tokens)
    return max(int(bound), 1)


def chunk_metadata(
    query_start_loc: jax.Array,
    num_computed_tokens: jax.Array,
    *,
    chunk_size: int,
    max_chunks: int,
) -> ChunkMetadata:
    """Builds the chunk-aligned layout (see the module docstring). Jittable, no host sync.

    Args:
      query_start_loc: int32[B + 1], packed start of each sequence (non-decreasing, from 0).
      num_computed_tokens: int32[B], tokens of each sequence processed in earlier steps.
      chunk_size: static chunk size ``cs``.
      max_chunks: static number of chunk slots, e.g. ``max_chunks_for(T, B, cs)``.

    Returns:
      ChunkMetadata with ``max_chunks`` chunk slots. Chunks past ``max_chunks`` are dropped;
      batch builders size ``max_chunks`` so that never happens.
    """
    chunk_size = check_int("chunk_size", chunk_size, low=1)
    max_chunks = check_int("max_chunks", max_chunks, low=1)
    query_start_loc, num_computed_tokens = map(jnp.asarray, (query_start_loc, num_computed_tokens))
    check_integer("query_start_loc", query_start_loc)
    check_integer("num_computed_tokens", num_computed_tokens)
    if query_start_loc.ndim != 1 or query_start_loc.shape[0] < 2:
        raise ValueError(
            f"query_start_loc must be int32[B + 1] with B >= 1, got {query_start_loc.shape}"
        )
    num_seqs = query_start_loc.shape[0] - 1
    if num_computed_tokens.shape != (num_seqs,):
        raise ValueError(
            f"num_computed_tokens must be int32[B={num_seqs}], got {num_computed_tokens.shape}"
        )
    cs = chunk_size
    qsl = query_start_loc.astype(jnp.int32)
    computed = num_computed_tokens.astype(jnp.int32)
    new_tokens = qsl[1:] - qsl[:-1]

    first_block = computed // cs  # absolute chunk index of each sequence's first chunk
    chunks_per_seq = jnp.where(new_tokens > 0, -(-(computed + new_tokens) // cs) - first_block, 0)
    chunk_end = jnp.cumsum(chunks_per_seq)  # exclusive end in the chunk list, per sequence
    chunk_begin = chunk_end - chunks_per_seq
    num_chunks = chunk_end[-1]

    chunk = jnp.arange(max_chunks, dtype=jnp.int32)
    # Sequence of chunk c: the first b whose chunk range ends after c.
    seq = search_sorted(chunk_end, chunk, side="right").astype(jnp.int32)
    live = chunk < num_chunks
    seq_safe = jnp.minimum(seq, num_seqs - 1)
    block = first_block[seq_safe] + chunk - chunk_begin[seq_safe]
    # Absolute start within the sequence, then packed position.
    abs_start = jnp.maximum(block * cs, computed[seq_safe])
    start = qsl[seq_safe] + abs_start - computed[seq_safe]
    total = qsl[-1]
    starts = jnp.where(live, start, total)
    cu_chunk_seqlens = jnp.concatenate([starts, total[None]]).astype(jnp.int32)
    seq_idx = jnp.where(live, seq, -1).astype(jnp.int32)
    last_chunk_indices = jnp.where(chunks_per_seq > 0, chunk_end - 1, -1).astype(jnp.int32)
    return ChunkMetadata(
        cu_chunk_seqlens,
        seq_idx,
        last_chunk_indices,
        num_chunks.astype(jnp.int32),
        chunk_size=cs,
    )


# --------------------------------------------------------------------------------------
# Static-shape buckets: a bounded set of shapes so ``jax.jit`` compiles a bounded set of
# programs whatever the batch.
# --------------------------------------------------------------------------------------


def sequence_block_table(
    query_start_loc: jax.Array, *, block_size: int, num_blocks: int
) -> tuple[jax.Array, jax.Array]:
    """Blocks of ``block_size`` packed rows aligned to sequence starts, so that no block
    holds two sequences (jittable, no host sync): the layout of every kernel that works
    per (sequence, row block). A batch has at most ``cdiv(T, block_size) + B`` of them.
    Example, ``block_size = 4``, ``query_start_loc = [0, 6, 6, 9]``::

        block_seq = [0, 0, 2, -1, ...]     block_row = [0, 4, 6, 9, ...]

    Returns:
      ``(block_seq, block_row)``, int32[num_blocks] each: the block's sequence (-1 past
      the live blocks) and its first packed row (``query_start_loc[-1]`` past them).
    """
    query_start_loc = jnp.asarray(query_start_loc)
    num_seqs = query_start_loc.shape[0] - 1
    lengths = jnp.maximum(query_start_loc[1:] - query_start_loc[:-1], 0)
    blocks_per_seq = -(-lengths // block_size)
    ends = jnp.cumsum(blocks_per_seq)
    block = jnp.arange(num_blocks)
    seq = jnp.minimum(search_sorted(ends, block, side="right"), num_seqs - 1)
    live = block < ends[-1]
    row = query_start_loc[seq] + (block - (ends - blocks_per_seq)[seq]) * block_size
    return (
        jnp.where(live, seq, -1).astype(jnp.int32),
        jnp.where(live, row, query_start_loc[-1]).astype(jnp.int32),
    )


def power_of_two_buckets(max_size: int, *, min_size: int = 1) -> tuple[int, ...]:
    """Powers of two from ``min_size`` up to the first one ``>= max_size`` (which is kept)."""
    if min_size < 1 or max_size < 1:
        raise ValueError(f"{min_size=} and {max_size=} must be >= 1")
    sizes, size = [], 1
    while size < min_size:
        size *= 2
    while True:
        sizes.append(size)
        if size >= max_size:
            return tuple(sizes)
        size *= 2


# Token bucket policies (``token_buckets``). ``sqrt2`` rounds its sizes up to a multiple of
# ``_SQRT2_ALIGN`` tokens, as every ``pow2`` bucket from 16 up is, so kernels that tile
# packed rows in blocks of 16 see whole blocks; ``linear`` defaults to steps of
# ``_LINEAR_STEP`` tokens (a 22.5k-token step then runs in 24576 rather than 32768).
TokenBucketPolicy = Literal["pow2", "sqrt2", "linear"]
TOKEN_BUCKET_POLICIES: tuple[str, ...] = ("pow2", "sqrt2", "linear")
_SQRT2_ALIGN = 16
_LINEAR_STEP = 4096


def token_buckets(
    max_tokens: int,
    *,
    min_tokens: int = 16,
    policy: TokenBucketPolicy = "pow2",
    step: int | None = None,
) -> tuple[int, ...]:
    """Token-count buckets for packed batches, from ``min_tokens`` up to the first size
    ``>= max_tokens`` (which is kept), spaced by ``policy``:

    - ``"pow2"`` (the default): powers of two. Few programs; a size just past a bucket
      runs in twice its tokens (``bucket_for(s) < 2 s``).
    - ``"sqrt2"``: powers of √2 rounded up to a multiple of 16, about twice as many buckets
      as ``pow2``; ``bucket_for(s) <= ceil16(√2 s)`` (padding up to ~41% of the real
      tokens, against ``pow2``'s 100%).
    - ``"linear"``: powers of two below ``step``, then multiples of ``step`` (4096 by
      default); ``bucket_for(s) < min(2 s, s + step)``, so large steps pad by at most
      ``step - 1`` tokens at the cost of ``max_tokens / step`` large buckets.

    Example, ``max_tokens=8192``::

        pow2              16 32 64 128 256 512 1024 2048 4096 8192
        sqrt2             16 32 48 64 96 128 192 256 368 512 736 1024 1456 2048 2912 4096
                          5808 8192
        linear, step=2048 16 32 64 128 256 512 1024 2048 4096 6144 8192

    Args:
      max_tokens: the most tokens a batch holds (>= 1).
      min_tokens: the smallest bucket's lower bound (>= 1; capped at ``max_tokens``); the
        smallest bucket is the first size of the policy's sequence ``>= min_tokens``.
      policy: the spacing, above.
      step: ``linear``'s step (>= the smallest bucket bound ``min(min_tokens,
        max_tokens)``); None for 4096. Only ``linear`` takes it.
    """
    max_tokens = check_int("max_tokens", max_tokens, low=1)
    min_tokens = check_int("min_tokens", min_tokens, low=1)
    if policy not in TOKEN_BUCKET_POLICIES:
        raise ValueError(f"policy={policy!r} must be one of {TOKEN_BUCKET_POLICIES}")
    if step is not None and policy != "linear":
        raise ValueError(f"step={step!r} is only for policy='linear' (got policy={policy!r})")
    low = min(min_tokens, max_tokens)
    if policy == "pow2":
        return power_of_two_buckets(max_tokens, min_size=low)
    if policy == "sqrt2":
        align = _SQRT2_ALIGN
        sizes: list[int] = []
        k = 0
        while True:
            # 2**(k/2): an exact integer power of two for even k, times √2 for odd k.
            raw = 2 ** (k // 2) * (math.sqrt(2) if k % 2 else 1)
            k += 1
            if raw < low:
                continue
            size = -(-math.ceil(raw) // align) * align
            if not sizes or size > sizes[-1]:
                sizes.append(size)
            if size >= max_tokens:
                return tuple(sizes)
    if step is None:
        step = _LINEAR_STEP
    step = check_int("step", step, low=low, what="min(min_tokens, max_tokens)")
    sizes = [s for s in power_of_two_buckets(max_tokens, min_size=low) if s < step]
    multiple = step
    while not sizes or sizes[-1] < max_tokens:
        sizes.append(multiple)
        multiple += step
    return tuple(sizes)


def sequence_buckets(max_seqs: int, *, min_seqs: int = 1) -> tuple[int, ...]:
    """Sequence-count buckets: powers of two, ``min_seqs`` to ``max_seqs``."""
    return power_of_two_buckets(max_seqs, min_size=min(min_seqs, max_seqs))


def bucket_for(size: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``size``; ``ValueError`` when none does."""
    for bucket in sorted(buckets):
        if size <= bucket:
            return bucket
    raise ValueError(f"{size=} exceeds the largest bucket {max(buckets)}")


def pad_to_bucket(
    array: np.ndarray | jax.Array,
    size: int,
    *,
    axis: int = 0,
    mode: Literal["constant", "edge"] = "constant",
    fill: int | float = 0,
) -> np.ndarray:
    """Pads ``array`` along ``axis`` to ``size`` on the host.

    ``mode="constant"`` appends ``fill`` (e.g. ``-1`` for ``slot_ids``); ``mode="edge"``
    repeats the last entry (e.g. ``query_start_loc``, so padding sequences have length 0).
    """
    array = np.asarray(array)
    current = array.shape[axis]
    if current > size:
        raise ValueError(f"array of length {current} along axis {axis} exceeds bucket {size}")
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, size - current)
    if mode == "edge":
        if current == 0:
            raise ValueError("mode='edge' needs a non-empty array")
        return np.pad(array, widths, mode="edge")
    return np.pad(array, widths, mode="constant", constant_values=fill)
