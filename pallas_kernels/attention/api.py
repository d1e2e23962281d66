"""``masked_tail_attention``, ``write_kv``, ``kv_lens_from_mask``: validation and dispatch.

How a sequence's queries align with its keys (``kv_lens[b]`` counts this step's tokens;
bottom-right alignment, as FlashAttention's varlen causal mask)::

    kv_lens[b] = 7, q_len[b] = 3 (4 tokens cached, 3 new), causal:

               keys  0 1 2 3 4 5 6 | 7 ... L-1   (never loaded)
    query 0 (pos 4)  x x x x x . . |
    query 1 (pos 5)  x x x x x x . |
    query 2 (pos 6)  x x x x x x x |

Two KV layouts (``block_table`` selects):

* contiguous (``block_table=None``): ``k_cache[S, L, Hkv, D]``, sequence ``b`` in slot
  ``slot_ids[b]``;
* paged (``block_table[B, max_blocks]``): ``k_cache[num_blocks, block_size, Hkv, D]`` is a
  pool of pages, key ``j`` of sequence ``b`` lives at
  ``k_cache[block_table[b, j // block_size], j % block_size]``; the maximum context is
  ``L = max_blocks * block_size``. ``slot_ids`` then only marks padding sequences (an id
  < 0); it indexes the Mamba states, not the pool. Table entries at or past
  ``cdiv(kv_lens[b], block_size)`` are never read; several sequences may share a page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _validation as checks
from pallas_kernels.attention import (
    kv_cache,
    mosaic,
    mosaic_config,
    mosaic_vjp,
    reference,
    triton,
    triton_config,
)
from pallas_kernels.attention._layout import jit_attention
from pallas_kernels.backend import Backend, Call, Implementation, Op


def _page_size(k_cache: jax.Array, block_table: jax.Array | None) -> int | None:
    """Keys per page of a paged cache, None for contiguous slots."""
    return None if block_table is None else k_cache.shape[1]


def _triton_default_config(q, k_cache, *_, block_table=None, **__) -> triton_config.BlockSizes:
    page_size = _page_size(k_cache, block_table)
    return triton_config.default_block_sizes(
        num_tokens=q.shape[0],
        num_q_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2],
        head_dim=q.shape[2],
        cache_len=k_cache.shape[1] * (1 if block_table is None else block_table.shape[1]),
        dtype=q.dtype,
        page_size=page_size,
    )


def _triton_check_config(config: triton_config.BlockSizes, q, k_cache, *_, block_table=None, **__):
    triton_config.check_paged_block_sizes(config, _page_size(k_cache, block_table))


def _mosaic_attention(
    q,
    k_cache,
    v_cache,
    *,
    causal,
    sm_scale,
    sliding_window,
    config: mosaic_config.BlockSizes,
    **batch,
) -> jax.Array:
    """The Mosaic GPU kernel; its gradients run the Mosaic dQ and dK/dV kernels
    (``mosaic_vjp``) from the logsumexp it saves under differentiation."""
    return jit_attention(
        triton.differentiable_attention,
        q,
        k_cache,
        v_cache,
        **batch,
        causal=causal,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        static=dict(
            block_sizes=_triton_default_config(q, k_cache, **batch),
            primal=mosaic.prefill_attention,
            primal_config=config,
            dq_kernel=mosaic_vjp.dq_gradient,
            dkv_kernel=mosaic_vjp.dkv_gradients,
        ),
    )


MASKED_TAIL_ATTENTION = Op(
    "masked_tail_attention",
    (
        Backend(
            "mosaic",
            _mosaic_attention,
            config_type=mosaic_config.BlockSizes,
            default_config=lambda q, k_cache, *_, block_table=None, **__: (
                mosaic_config.default_block_sizes(page_size=_page_size(k_cache, block_table))
            ),
            supports=mosaic_config.supports,
            check_config=lambda config, q, k_cache, *_, block_table=None, **__: (
                mosaic_config.check_block_sizes(
                    config, num_q_heads=q.shape[1], page_size=_page_size(k_cache, block_table)
                )
            ),
        ),
        Backend(
            "triton",
            triton.masked_tail_attention,
            config_type=triton_config.BlockSizes,
            default_config=_triton_default_config,
            supports=triton_config.supports,
            check_config=_triton_check_config,
        ),
        Backend("xla", reference.masked_tail_attention),
    ),
)
WRITE_KV = Op("write_kv", (Backend("triton", triton.write_kv), Backend("xla", kv_cache.write_kv)))


# Paged calls: slot ids only mark padding (< 0); any id >= 0 is live (it indexes the Mamba
# states, not the KV pool), so the bound that maps ids to -1 is the int32 range.
_PAGED_NUM_SLOTS = int(np.iinfo(np.int32).max)


def _check_cache(
    k_cache: jax.Array, v_cache: jax.Array, *, paged: bool
) -> tuple[int, int, int, int]:
    letters = "[num_blocks, block_size, Hkv, D]" if paged else "[S, L, Hkv, D]"
    checks.check_floating("k_cache", k_cache)
    if k_cache.ndim != 4:
        raise ValueError(f"k_cache must have shape {letters}, got {k_cache.shape}")
    checks.check_floating("v_cache", v_cache)
    checks.check_shape("v_cache", v_cache, k_cache.shape, letters)
    return k_cache.shape


def _check_batch(
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    block_table: jax.Array | None,
    num_slots: int,
) -> tuple[jax.Array, jax.Array | None]:
    """Static checks of the batch description; returns the checked slot ids (-1 for
    padding) and the block table as int32 (or None)."""
    for name, a in (("query_start_loc", query_start_loc), ("kv_lens", kv_lens)):
        checks.check_integer(name, a)
    if query_start_loc.ndim != 1 or query_start_loc.shape[0] < 2:
        raise ValueError(
            f"query_start_loc must have shape [B + 1] with B >= 1, got {query_start_loc.shape}"
        )
    num_seqs = query_start_loc.shape[0] - 1
    checks.check_shape("kv_lens", kv_lens, (num_seqs,), "[B]")
    if block_table is None:
        return checks.check_slot_ids(slot_ids, num_seqs, num_slots, "[B]"), None
    checks.check_integer("block_table", block_table)
    if block_table.ndim != 2 or block_table.shape[0] != num_seqs or block_table.shape[1] < 1:
        raise ValueError(
            f"block_table must have shape [B, max_blocks] = ({num_seqs}, >= 1), "
            f"got {block_table.shape}"
        )
    slots = checks.check_slot_ids(slot_ids, num_seqs, _PAGED_NUM_SLOTS, "[B]")
    return slots, block_table.astype(jnp.int32)


def _validate_batch(
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    block_table: jax.Array | None,
    *,
    num_tokens: int,
    num_slots: int,
    cache_len: int,
    writes: bool = False,
) -> None:
    """Host checks of the batch data. Paged (``block_table`` given): ``num_slots`` is the
    pool's ``num_blocks``, ``cache_len`` its ``block_size``; every table entry a live
    sequence needs (``j < cdiv(kv_lens[b], block_size)``) must name a page of the pool.
    ``writes`` (``write_kv``): no two tokens may write the same page row (sequences share
    pages only to read them; two writers would race)."""
    qsl = checks.validate_query_start_loc(query_start_loc, num_tokens)
    lens = checks.host_values("kv_lens", kv_lens)
    q_len = np.diff(qsl)
    if block_table is None:
        slots = checks.validate_slot_ids(slot_ids, num_slots)
        max_len, what = cache_len, f"L={cache_len}"
    else:
        slots = checks.host_values("slot_ids", slot_ids)
        if np.any(slots < -1):
            raise ValueError(f"slot_ids must be -1 (padding) or >= 0, got {slots.tolist()}")
        max_len = block_table.shape[1] * cache_len
        what = f"max_blocks * block_size={max_len}"
    if np.any(lens < q_len) or np.any(lens > max_len):
        raise ValueError(
            f"kv_lens must satisfy q_len <= kv_lens <= {what}; "
            f"got kv_lens={lens.tolist()}, q_len={q_len.tolist()}"
        )
    if block_table is not None:
        table = checks.host_values("block_table", block_table)
        needed = np.arange(table.shape[1])[None, :] < -(-lens[:, None] // cache_len)
        needed &= (slots >= 0)[:, None]
        bad = needed & ((table < 0) | (table >= num_slots))
        if np.any(bad):
            rows, cols = np.nonzero(bad)
            raise ValueError(
                f"block_table entries a sequence reads must be in [0, num_blocks={num_slots}); "
                f"got {table[rows, cols].tolist()} at (sequence, block) "
                f"{list(zip(rows.tolist(), cols.tolist(), strict=True))}"
            )
        if writes:
            seqs = [b for b in range(len(lens)) if slots[b] >= 0]
            positions = [(b, p) for b in seqs for p in range(lens[b] - q_len[b], lens[b])]
            rows_written = [(int(table[b, p // cache_len]), p % cache_len) for b, p in positions]
            if len(set(rows_written)) != len(rows_written):
                seen: dict[tuple[int, int], int] = {}
                for (b, _), row in zip(positions, rows_written, strict=True):
                    if row in seen:
                        raise ValueError(
                            f"block_table: sequences {seen[row]} and {b} both write page "
                            f"{row[0]} row {row[1]}; pages may be shared only to be read"
                        )
                    seen[row] = b


def masked_tail_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    query_start_loc: jax.Array,
    kv_lens: jax.Array,
    slot_ids: jax.Array,
    block_table: jax.Array | None = None,
    causal: bool = True,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    validate: bool = False,
    implementation: Implementation = "auto",
    config: mosaic_config.BlockSizes | triton_config.BlockSizes | None = None,
) -> jax.Array:
    """Attention of packed queries over a slot-indexed or paged KV cache, skipping masked
    KV tails.

    Query row ``i`` of sequence ``b`` sits at absolute position
    ``pos = kv_lens[b] - q_len[b] + i`` and sees keys ``j < kv_lens[b]``, ``j <= pos`` when
    ``causal``, and ``pos - W < j`` with ``sliding_window=W``. Keys at or past ``kv_lens[b]``
    are never read (the kernels never load those blocks). Query head ``h`` uses KV head
    ``h // (Hq // Hkv)``. With ``block_table`` the caches are page pools (see the module
    docstring): key ``j`` of sequence ``b`` is
    ``k_cache[block_table[b, j // block_size], j % block_size]``.

    Args:
      q: q[T, Hq, D] packed queries.
      k_cache: k_cache[S, L, Hkv, D], or the page pool k_cache[num_blocks, block_size, Hkv, D]
        with ``block_table``.
      v_cache: v_cache, the same shape.
      query_start_loc: int32[B + 1].
      kv_lens: int32[B], valid keys per sequence including this step's tokens.
      slot_ids: int32[B], cache slot per sequence; ``-1`` (or any id outside ``[0, S)``)
        marks a padding sequence. With ``block_table`` any id >= 0 is live (the slot
        indexes other caches, not the pool) and an id < 0 marks padding.
      block_table: int32[B, max_blocks] page of each block of ``block_size`` keys of each
        sequence, or None (contiguous slots). Entries a sequence does not need (at or past
        ``cdiv(kv_lens[b], block_size)``) are never read; an entry it needs outside
        ``[0, num_blocks)`` is a caller bug that ``validate`` reports (the kernels clamp it
        and stay in bounds).
      causal: apply the causal mask (bottom-right aligned).
      sm_scale: logit scale, ``D ** -0.5`` by default.
      sliding_window: ``W`` keys visible per query (including itself), or None.
      validate: check ``query_start_loc``, ``kv_lens``, ``slot_ids`` and the needed
        ``block_table`` entries on the host.
      implementation: "auto" | "xla" | "triton" | "mosaic", or a sequence of backend names
        to take the first that serves the call (see ``pallas_kernels.backend``). ``mosaic``
        serves prefill batches in bf16/fp16 with head dim 64 or 128 and T, L multiples of
        8 on Hopper; asked for by name on any other call it raises ``ValueError``.
      config: the chosen backend's block sizes (``attention.mosaic_config.BlockSizes`` or
        ``attention.triton_config.BlockSizes``).

    Returns:
      out[T, Hq, D] in ``q``'s dtype; rows with no visible key, of padding sequences or
      past ``query_start_loc[-1]`` are 0.
    """
    q, k_cache, v_cache, query_start_loc, kv_lens = (
        jnp.asarray(a) for a in (q, k_cache, v_cache, query_start_loc, kv_lens)
    )
    slot_ids = checks.slot_ids_array(slot_ids)
    block_table = None if block_table is None else jnp.asarray(block_table)
    checks.check_floating("q", q)
    S, L, Hkv, D = _check_cache(k_cache, v_cache, paged=block_table is not None)
    if q.ndim != 3 or q.shape[2] != D:
        raise ValueError(f"q must have shape [T, Hq, D] with D={D}, got {q.shape}")
    T, Hq = q.shape[:2]
    if Hq % Hkv:
        raise ValueError(f"num_q_heads={Hq} must be divisible by num_kv_heads={Hkv}")
    checked_slot_ids, block_table = _check_batch(query_start_loc, kv_lens, slot_ids, block_table, S)
    if sliding_window is not None:
        sliding_window = checks.check_int("sliding_window", sliding_window, low=1)
    if validate:
        _validate_batch(
            query_start_loc, kv_lens, slot_ids, block_table, num_tokens=T, num_slots=S, cache_len=L
        )
    call = Call(
        (q, k_cache, v_cache),
        dict(
            query_start_loc=query_start_loc.astype(jnp.int32),
            kv_lens=kv_lens.astype(jnp.int32),
            slot_ids=checked_slot_ids,
            block_table=block_table,
            causal=bool(causal),
            sm_scale=D**-0.5 if sm_scale is None else checks.check_float("sm_scale", sm_scale),
            sliding_window=None if sliding_window is None else int(sliding_window),
        ),
        empty=(lambda: q) if T == 0 else None,
    )
    return MASKED_TAIL_ATTENTION.run(call, implementation, config)


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
    validate: bool = False,
    implementation: Implementation = "auto",
    config: None = None,
) -> tuple[jax.Array, jax.Array]:
    """Writes this step's keys/values into the caches.

    Token ``i`` of sequence ``b`` goes to position ``p = kv_lens[b] - q_len[b] + i`` of slot
    ``slot_ids[b]``, or with ``block_table`` to row ``p % block_size`` of page
    ``block_table[b, p // block_size]``; padding sequences (slot ``-1``), positions outside
    ``[0, L)`` (paged: ``[0, max_blocks * block_size)``) and pages outside
    ``[0, num_blocks)`` write nothing. Functional (in place under buffer donation).

    Args:
      k_cache, v_cache: [S, L, Hkv, D], or page pools [num_blocks, block_size, Hkv, D] with
        ``block_table``.
      k, v: [T, Hkv, D] this step's keys and values (packed like the queries).
      query_start_loc: int32[B + 1].
      kv_lens: int32[B], valid keys per sequence including this step's tokens.
      slot_ids: int32[B]; ids outside ``[0, S)`` write nothing (paged: ids < 0).
      block_table: int32[B, max_blocks] or None; see :func:`masked_tail_attention`. The
        engine guarantees that written pages belong to one sequence alone.
      validate: check the batch on the host.
      implementation: "auto" | "xla" | "triton" | "mosaic", or a sequence of backend names.
      config: no backend of ``write_kv`` takes block sizes; anything but None raises.

    Returns:
      ``(k_cache, v_cache)`` updated.
    """
    k_cache, v_cache, k, v, query_start_loc, kv_lens = (
        jnp.asarray(a) for a in (k_cache, v_cache, k, v, query_start_loc, kv_lens)
    )
    slot_ids = checks.slot_ids_array(slot_ids)
    block_table = None if block_table is None else jnp.asarray(block_table)
    S, L, Hkv, D = _check_cache(k_cache, v_cache, paged=block_table is not None)
    if k.ndim != 3:
        raise ValueError(f"k must have shape [T, Hkv, D], got {k.shape}")
    T = k.shape[0]
    for name, a in (("k", k), ("v", v)):
        checks.check_floating(name, a)
        checks.check_shape(name, a, (T, Hkv, D), "[T, Hkv, D]")
    checked_slot_ids, block_table = _check_batch(query_start_loc, kv_lens, slot_ids, block_table, S)
    if validate:
        _validate_batch(
            query_start_loc,
            kv_lens,
            slot_ids,
            block_table,
            num_tokens=T,
            num_slots=S,
            cache_len=L,
            writes=True,
        )
    call = Call(
        (k_cache, v_cache, k, v),
        dict(
            query_start_loc=query_start_loc.astype(jnp.int32),
            kv_lens=kv_lens.astype(jnp.int32),
            slot_ids=checked_slot_ids,
            block_table=block_table,
        ),
        empty=(lambda: (k_cache, v_cache)) if T == 0 else None,
    )
    return WRITE_KV.run(call, implementation, config)


def kv_lens_from_mask(mask: jax.Array) -> jax.Array:
    """Per-row KV length of an attention mask: end of the last unmasked key.

    For callers that hold a mask rather than lengths (llama.cpp-style). A boolean mask
    marks visible keys True; an integer mask non-zero (Hugging Face ``attention_mask``);
    an additive float mask 0 (or any bias above ``kv_cache.MASKED_BIAS_THRESHOLD``, -1e4)
    for visible keys and −inf / the dtype's lowest value for masked ones.

    Args:
      mask: mask[B, L].

    Returns:
      int32[B]: index of the last visible key + 1, 0 for a row with none.
    """
    mask = jnp.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask must have shape [B, L], got {mask.shape}")
    return kv_cache.kv_lens_from_mask(mask)
