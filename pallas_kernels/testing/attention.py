"""Float64 oracles of the attention op: softmax attention over a slot-indexed or paged KV
cache (``attention_oracle``), writing a step's keys and values into it
(``write_kv_oracle``), and KV lengths from an attention mask
(``kv_lens_from_mask_oracle``); row by row and key by key.
"""

from __future__ import annotations

import numpy as np

from ._common import ArrayLike, _check_shape, _f64, _i64, _seq_bounds


def _check_block_table(block_table: ArrayLike | None, num_seqs: int) -> np.ndarray | None:
    """The checked ``block_table[B, max_blocks]`` as int64, or None (contiguous slots)."""
    if block_table is None:
        return None
    table = _i64(block_table)
    if table.ndim != 2 or table.shape[0] != num_seqs or table.shape[1] < 1:
        raise ValueError(f"block_table: expected shape [{num_seqs}, max_blocks], got {table.shape}")
    return table


def _key_address(
    table: np.ndarray | None, b: int, slot: int, keys: np.ndarray, cache_shape: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """(cache line, row) of keys ``keys`` of sequence ``b``: its slot's rows, or through
    the block table one page per ``block_size`` keys; a page outside the pool raises."""
    if table is None:
        return np.full_like(keys, slot), keys
    num_blocks, block_size = cache_shape[:2]
    pages = table[b, keys // block_size]
    if np.any((pages < 0) | (pages >= num_blocks)):
        raise ValueError(
            f"block_table[{b}] names pages {sorted(set(pages.tolist()))} for keys it reads; "
            f"the pool has {num_blocks}"
        )
    return pages, keys % block_size


def attention_oracle(
    q: ArrayLike,
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    *,
    query_start_loc: ArrayLike,
    kv_lens: ArrayLike,
    slot_ids: ArrayLike,
    block_table: ArrayLike | None = None,
    causal: bool = True,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
) -> np.ndarray:
    """Softmax attention of packed queries over a slot-indexed or paged KV cache, row by row.

    Query row ``i`` of sequence ``b`` (``q_len = qsl[b+1] - qsl[b]``) sits at absolute
    position ``pos = kv_lens[b] - q_len + i`` and sees keys ``j`` with
    ``j < kv_lens[b]``; ``j <= pos`` if ``causal``; ``pos - W < j`` if
    ``sliding_window=W`` (the window is applied even when ``causal=False``). Cache
    entries at ``j >= kv_lens[b]`` are never read (they may hold NaN). ``kv_lens[b]``
    larger than the cache length ``L`` is clipped to ``L``.

    Paged (``block_table`` given): the caches are page pools and key ``j`` of sequence
    ``b`` is read, one key at a time, from page ``block_table[b, j // block_size]``, row
    ``j % block_size``; ``L = max_blocks * block_size``. Only visible keys' entries are
    read (others may hold -1 or anything); a visible key on a page outside the pool
    raises ``ValueError``.

    Args:
      q: ``q[T, Hq, D]`` packed queries.
      k_cache: ``k_cache[S, L, Hkv, D]``; query head ``h`` uses KV head ``h // (Hq // Hkv)``.
        Paged: ``k_cache[num_blocks, block_size, Hkv, D]``.
      v_cache: ``v_cache``, the same shape.
      query_start_loc: ``int[B+1]`` packed sequence boundaries.
      kv_lens: ``int[B]`` valid keys per sequence, this step's tokens included.
      slot_ids: ``int[B]`` cache slot per sequence; ``-1`` (or any
        id outside ``[0, S)``) = padding sequence. Paged: any id ``< 0`` is padding, any
        id ``>= 0`` live.
      block_table: ``int[B, max_blocks]`` page of each block of keys, or None.
      causal: mask keys after the query's position.
      sm_scale: softmax scale; ``D ** -0.5`` when None.
      sliding_window: window size ``W`` or None.

    Returns:
      ``out[T, Hq, D]``. Rows with no visible key, rows of padding sequences and rows
      outside every sequence are 0.
    """
    q_ = _f64(q)
    if q_.ndim != 3:
        raise ValueError(f"q: expected shape [T, Hq, D], got {q_.shape}")
    T, Hq, Dh = q_.shape
    kc, vc = np.asarray(k_cache), np.asarray(v_cache)  # converted per gathered row below
    if kc.ndim != 4 or kc.shape[3] != Dh:
        raise ValueError(f"k_cache: expected shape [S, L, Hkv, {Dh}], got {kc.shape}")
    S, L, Hkv, _ = kc.shape
    _check_shape("v_cache", vc, (S, L, Hkv, Dh))
    if Hkv <= 0 or Hq % Hkv != 0:
        raise ValueError(f"KV heads Hkv={Hkv} must divide query heads Hq={Hq}")
    bounds = _seq_bounds(query_start_loc, T)
    lens = _i64(kv_lens)
    slots = _i64(slot_ids)
    _check_shape("kv_lens", lens, (len(bounds),))
    _check_shape("slot_ids", slots, (len(bounds),))
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window: expected None or >= 1, got {sliding_window}")
    scale = Dh**-0.5 if sm_scale is None else float(sm_scale)
    heads_per_kv = Hq // Hkv
    table = _check_block_table(block_table, len(bounds))
    if table is not None:
        L *= table.shape[1]  # the table's capacity

    out = np.zeros((T, Hq, Dh))
    for b, (start, end) in enumerate(bounds):
        slot = int(slots[b])
        if slot < 0 or (table is None and slot >= S):  # padding
            continue
        kv_len = min(int(lens[b]), L)
        q_len = end - start
        for i in range(q_len):
            pos = int(lens[b]) - q_len + i
            hi = min(kv_len, pos + 1) if causal else kv_len  # visible keys: lo <= j < hi
            lo = max(0, pos - sliding_window + 1) if sliding_window is not None else 0
            if hi <= lo:
                continue
            line, row = _key_address(table, b, slot, np.arange(lo, hi), kc.shape)
            for h in range(Hq):
                kv_h = h // heads_per_kv
                k_rows = _f64(kc[line, row, kv_h])  # [n, D]; only visible entries read
                v_rows = _f64(vc[line, row, kv_h])
                logits = scale * (k_rows @ q_[start + i, h])
                p = np.exp(logits - logits.max())
                out[start + i, h] = (p / p.sum()) @ v_rows
    return out


def write_kv_oracle(
    k_cache: ArrayLike,
    v_cache: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    query_start_loc: ArrayLike,
    kv_lens: ArrayLike,
    slot_ids: ArrayLike,
    block_table: ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Write this step's keys/values into the cache.

    Token ``i`` of sequence ``b`` goes to position ``p = kv_lens[b] - q_len[b] + i`` of slot
    ``slot_ids[b]``. Padding sequences (slot ``-1`` or any id outside ``[0, S)``) write
    nothing; positions outside ``[0, L)`` are dropped. Paged (``block_table`` given): ``p``
    goes to row ``p % block_size`` of page ``block_table[b, p // block_size]``; any slot id
    ``>= 0`` is live; positions outside ``[0, max_blocks * block_size)`` and pages outside
    the pool are dropped.

    Args:
      k_cache: ``k_cache[S, L, Hkv, D]``.
      v_cache: ``v_cache[S, L, Hkv, D]``.
      k: ``k[T, Hkv, D]`` packed new keys.
      v: ``v[T, Hkv, D]`` packed new values.
      query_start_loc: ``int[B+1]`` packed sequence boundaries.
      kv_lens: ``int[B]`` valid keys per sequence after this step.
      slot_ids: ``int[B]`` cache slot per sequence.
      block_table: ``int[B, max_blocks]`` or None; the caches are then page pools
        ``[num_blocks, block_size, Hkv, D]``.

    Returns:
      ``(new_k_cache, new_v_cache)``, float64, same shapes as the caches.
    """
    kc, vc = _f64(k_cache).copy(), _f64(v_cache).copy()
    if kc.ndim != 4:
        raise ValueError(f"k_cache: expected shape [S, L, Hkv, D], got {kc.shape}")
    S, L, Hkv, Dh = kc.shape
    _check_shape("v_cache", vc, (S, L, Hkv, Dh))
    k_, v_ = _f64(k), _f64(v)
    if k_.ndim != 3:
        raise ValueError(f"k: expected shape [T, {Hkv}, {Dh}], got {k_.shape}")
    T = k_.shape[0]
    _check_shape("k", k_, (T, Hkv, Dh))
    _check_shape("v", v_, (T, Hkv, Dh))
    bounds = _seq_bounds(query_start_loc, T)
    lens = _i64(kv_lens)
    slots = _i64(slot_ids)
    _check_shape("kv_lens", lens, (len(bounds),))
    _check_shape("slot_ids", slots, (len(bounds),))
    table = _check_block_table(block_table, len(bounds))

    for b, (start, end) in enumerate(bounds):
        slot = int(slots[b])
        if slot < 0 or (table is None and slot >= S):  # padding
            continue
        q_len = end - start
        for i in range(q_len):
            pos = int(lens[b]) - q_len + i
            if table is None:
                line, row = slot, pos
                if not 0 <= pos < L:
                    continue
            else:
                if not 0 <= pos < table.shape[1] * L:
                    continue  # past the table's capacity
                line, row = int(table[b, pos // L]), pos % L
                if not 0 <= line < S:
                    continue  # a page outside the pool
            kc[line, row] = k_[start + i]
            vc[line, row] = v_[start + i]
    return kc, vc


def kv_lens_from_mask_oracle(mask: ArrayLike) -> np.ndarray:
    """KV length per row of an attention mask: index of the last unmasked key + 1.

    Args:
      mask: ``mask[B, L]``. Boolean (True = may attend), integer (non-zero = may attend,
        the Hugging Face ``attention_mask`` convention) or additive float (a key is
        unmasked when its value is > -1e4: -inf, any dtype's lowest value, -1e9 and -1e4 all mask;
        NaN counts as masked).

    Returns:
      ``int64[B]``; 0 for a row with no unmasked key.
    """
    m = np.asarray(mask)
    if m.ndim != 2:
        raise ValueError(f"mask: expected shape [B, L], got {m.shape}")
    if m.dtype == np.bool_ or np.issubdtype(m.dtype, np.integer):
        unmasked = m != 0
    else:
        # The threshold is rounded to the mask's dtype, as the library compares: -1e4 is
        # -9984 in bfloat16 and must still mask.
        unmasked = m > np.asarray(-1e4, dtype=m.dtype)
    lens = np.zeros(m.shape[0], dtype=np.int64)
    for b in range(m.shape[0]):
        for j in range(m.shape[1] - 1, -1, -1):
            if unmasked[b, j]:
                lens[b] = j + 1
                break
    return lens
