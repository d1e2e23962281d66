"""Float64 NumPy oracles and assert helpers for numerics tests.

Every function named ``*_oracle`` recomputes one kernel of :mod:`pallas_kernels`
straight from the math in the design contract (DESIGN.md, section 5), in float64,
token by token and loop by loop. The algorithms are deliberately different from the
chunked implementations under test (the ``xla`` reference and the Pallas kernels), so a
bug shared by a kernel and its reference does not hide behind a matching oracle.

They are slow and meant for small shapes. Inputs may be anything ``np.asarray`` accepts
(NumPy arrays, JAX arrays, nested lists); they are converted to float64 (indices to
int64) and never mutated. Caches are returned as new arrays.

Typical use in a pytest numerics check::

    from pallas_kernels import ssd_scan
    from pallas_kernels.testing import assert_close, ssd_oracle, tolerance_for

    y, states = ssd_scan(x, dt, A, B, C, metadata=md, chunk_size=64)
    y_ref, states_ref = ssd_oracle(x, dt, A, B, C, query_start_loc=qsl)
    assert_close(y, y_ref, rtol=tolerance_for(x.dtype), name="y")
    assert_close(states, states_ref, rtol=tolerance_for(x.dtype), name="final_states")

``assert_close`` compares with the relative Frobenius error
``||actual - expected|| / ||expected||``: 1e-5 for float32 inputs, 2e-2 for bfloat16 or
float16 inputs (:func:`tolerance_for`). One norm over a whole array lets a few bad rows
hide among many good ones (a garbage cache slot among hundreds of correct ones), so for
caches and packed tokens compare each row on its own and check untouched slots bit for
bit::

    assert_close_per_row(y, y_ref, rtol=tolerance_for(x.dtype), name="y")  # each token
    touched = slot_ids[slot_ids >= 0]
    assert_close_per_row(new_cache[touched], cache_ref[touched], rtol=1e-5, name="cache")
    assert_slots_untouched(new_cache, old_cache, touched, name="cache")

Conventions shared by all oracles (DESIGN.md, sections 4 and 5):

* Tokens are packed: sequence ``b`` owns rows ``query_start_loc[b]:query_start_loc[b+1]``.
  Rows outside every sequence come back as 0.
* ``slot_ids`` index the first axis of a cache; ``-1`` marks a padding row or sequence,
  and so does any other id outside ``[0, S)`` (DESIGN.md §8): nothing is read or written
  for it and its output rows are 0. Cache lines not named by a slot id come back
  unchanged. If two rows name the same slot, each reads the cache as passed in and the
  later row's write wins (kernels leave this case undefined).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "assert_close",
    "assert_close_per_row",
    "assert_slots_untouched",
    "attention_oracle",
    "causal_conv1d_oracle",
    "causal_conv1d_update_oracle",
    "finite_difference_vjp",
    "gated_rms_norm_oracle",
    "grouped_matmul_oracle",
    "kv_lens_from_mask_oracle",
    "relative_error",
    "selective_state_update_oracle",
    "ssd_oracle",
    "tolerance_for",
    "vjp_errors",
    "write_kv_oracle",
]

ArrayLike = Any
"""Anything ``np.asarray`` accepts: NumPy or JAX arrays, scalars, nested lists."""


# --------------------------------------------------------------------------- helpers


def _f64(a: ArrayLike) -> np.ndarray:
    """A float64 copy-or-view of ``a`` (callers never write into it)."""
    return np.asarray(a, dtype=np.float64)


def _i64(a: ArrayLike) -> np.ndarray:
    return np.asarray(a, dtype=np.int64)


def _softplus(v: np.ndarray) -> np.ndarray:
    """log(1 + exp(v)), without overflow."""
    return np.logaddexp(0.0, v)


def _silu(v: np.ndarray) -> np.ndarray:
    """v * sigmoid(v), without overflow."""
    return v * np.exp(-np.logaddexp(0.0, -v))


def _check_shape(name: str, a: np.ndarray, shape: tuple[int, ...]) -> None:
    if a.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {a.shape}")


def _seq_bounds(query_start_loc: ArrayLike, num_tokens: int) -> list[tuple[int, int]]:
    """[(start, end)] token rows of each sequence, from ``query_start_loc[B+1]``."""
    qsl = _i64(query_start_loc)
    if qsl.ndim != 1 or qsl.shape[0] < 1:
        raise ValueError(f"query_start_loc: expected shape [B+1], got {qsl.shape}")
    if np.any(np.diff(qsl) < 0) or qsl[0] < 0 or qsl[-1] > num_tokens:
        raise ValueError(
            f"query_start_loc must be non-decreasing within [0, {num_tokens}], got {qsl}"
        )
    return [(int(qsl[b]), int(qsl[b + 1])) for b in range(qsl.shape[0] - 1)]


def _effective_dt(
    dt: np.ndarray,
    dt_bias: ArrayLike | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> np.ndarray:
    """dt' = clip(softplus?(dt + dt_bias), *dt_limit), for dt[..., H]."""
    if dt_bias is not None:
        bias = _f64(dt_bias)
        _check_shape("dt_bias", bias, (dt.shape[-1],))
        dt = dt + bias
    if dt_softplus:
        dt = _softplus(dt)
    lo, hi = dt_limit
    return np.clip(dt, lo, hi)


def _head_groups(num_heads: int, num_groups: int) -> np.ndarray:
    """int64[H]: the B/C group each head reads (head h uses group h // (H // G))."""
    if num_groups <= 0 or num_heads % num_groups != 0:
        raise ValueError(f"B/C groups G={num_groups} must divide heads H={num_heads}")
    return np.arange(num_heads) // (num_heads // num_groups)


def _skip_term(D: ArrayLike | None, num_heads: int, head_dim: int) -> np.ndarray:
    """D as [H, P] (zeros when None); D may be [H] (broadcast over P) or [H, P]."""
    if D is None:
        return np.zeros((num_heads, head_dim))
    d = _f64(D)
    if d.shape == (num_heads,):
        return np.repeat(d[:, None], head_dim, axis=1)
    _check_shape("D", d, (num_heads, head_dim))
    return d


def _ssm_step(
    s: np.ndarray,
    x_t: np.ndarray,
    dt_t: np.ndarray,
    A: np.ndarray,
    B_t: np.ndarray,
    C_t: np.ndarray,
    d_hp: np.ndarray,
    z_t: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """One token of the Mamba2 recurrence; returns (new state[H,P,N], y_t[H,P]).

    ``B_t``/``C_t`` are already expanded to one row per head ([H, N]).
    s_t = exp(dt_t A) s_{t-1} + dt_t x_t (outer) B_t;  y_t = s_t . C_t + D x_t;
    y_t *= silu(z_t) when z is given.
    """
    decay = np.exp(dt_t * A)  # [H]
    s = decay[:, None, None] * s + dt_t[:, None, None] * x_t[:, :, None] * B_t[:, None, :]
    y_t = np.einsum("hpn,hn->hp", s, C_t) + d_hp * x_t
    if z_t is not None:
        y_t = y_t * _silu(z_t)
    return s, y_t


def _check_activation(activation: str | None) -> None:
    if activation not in (None, "silu"):
        raise ValueError(f"activation: expected None or 'silu', got {activation!r}")


# --------------------------------------------------------------------------- SSM


def ssd_oracle(
    x: ArrayLike,
    dt: ArrayLike,
    A: ArrayLike,
    B: ArrayLike,
    C: ArrayLike,
    *,
    query_start_loc: ArrayLike,
    D: ArrayLike | None = None,
    z: ArrayLike | None = None,
    dt_bias: ArrayLike | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_states: ArrayLike | None = None,
    return_token_states: bool = False,
) -> tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mamba2 SSD prefill over packed sequences, one token at a time.

    Args:
      x: ``x[T, H, P]`` inputs.
      dt: ``dt[T, H]`` raw time steps.
      A: ``A[H]`` (negative) decay rates.
      B: ``B[T, G, N]``; head ``h`` uses group ``h // (H // G)``.
      C: ``C[T, G, N]``.
      query_start_loc: ``int[B+1]`` packed sequence boundaries.
      D: skip term, ``D[H]`` (broadcast over P) or ``D[H, P]``.
      z: gate ``z[T, H, P]``; ``y *= silu(z)``.
      dt_bias: ``dt_bias[H]`` added to ``dt``.
      dt_softplus: apply softplus to ``dt + dt_bias``.
      dt_limit: ``(lo, hi)``; ``dt'`` is always clipped to it (the default clips at 0).
      initial_states: ``initial_states[B, H, P, N]``; zeros when None.
      return_token_states: also return the state after every token.

    Returns:
      ``(y[T, H, P], final_states[B, H, P, N])``, plus ``token_states[T, H, P, N]`` when
      ``return_token_states``. ``token_states[t]`` is the state right after token ``t``.
      Rows outside every sequence are 0 in ``y`` and ``token_states``. An empty
      sequence's final state is its initial state (or 0).
    """
    x_, dt_, A_, B_, C_ = _f64(x), _f64(dt), _f64(A), _f64(B), _f64(C)
    if x_.ndim != 3:
        raise ValueError(f"x: expected shape [T, H, P], got {x_.shape}")
    T, H, P = x_.shape
    if B_.ndim != 3:
        raise ValueError(f"B: expected shape [T, G, N], got {B_.shape}")
    G, N = B_.shape[1:]
    _check_shape("dt", dt_, (T, H))
    _check_shape("A", A_, (H,))
    _check_shape("B", B_, (T, G, N))
    _check_shape("C", C_, (T, G, N))
    z_ = None if z is None else _f64(z)
    if z_ is not None:
        _check_shape("z", z_, (T, H, P))
    bounds = _seq_bounds(query_start_loc, T)
    num_seqs = len(bounds)
    if initial_states is None:
        init = np.zeros((num_seqs, H, P, N))
    else:
        init = _f64(initial_states)
        _check_shape("initial_states", init, (num_seqs, H, P, N))

    groups = _head_groups(H, G)
    d_hp = _skip_term(D, H, P)
    dt_eff = _effective_dt(dt_, dt_bias, dt_softplus, dt_limit)

    y = np.zeros((T, H, P))
    final_states = np.zeros((num_seqs, H, P, N))
    token_states = np.zeros((T, H, P, N)) if return_token_states else None
    for b, (start, end) in enumerate(bounds):
        s = init[b].copy()
        for t in range(start, end):
            s, y[t] = _ssm_step(
                s,
                x_[t],
                dt_eff[t],
                A_,
                B_[t][groups],
                C_[t][groups],
                d_hp,
                None if z_ is None else z_[t],
            )
            if token_states is not None:
                token_states[t] = s
        final_states[b] = s

    if token_states is not None:
        return y, final_states, token_states
    return y, final_states


def selective_state_update_oracle(
    state_cache: ArrayLike,
    x: ArrayLike,
    dt: ArrayLike,
    A: ArrayLike,
    B: ArrayLike,
    C: ArrayLike,
    *,
    slot_ids: ArrayLike,
    D: ArrayLike | None = None,
    z: ArrayLike | None = None,
    dt_bias: ArrayLike | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> tuple[np.ndarray, np.ndarray]:
    """Decode-time SSM step: one token per row, from and back to its cache slot.

    Args:
      state_cache: ``state_cache[S, H, P, N]``.
      x: ``x[Bd, H, P]``.
      dt: ``dt[Bd, H]``.
      A: ``A[H]``.
      B: ``B[Bd, G, N]``; head ``h`` uses group ``h // (H // G)``.
      C: ``C[Bd, G, N]``.
      slot_ids: ``int[Bd]`` cache slot of each row; ``-1`` (or any id
        outside ``[0, S)``) = padding row.
      D, z, dt_bias, dt_softplus, dt_limit: as in :func:`ssd_oracle` (``z[Bd, H, P]``).

    Returns:
      ``(y[Bd, H, P], new_state_cache[S, H, P, N])``. Padding rows give ``y = 0``; slots
      not named keep their values.
    """
    cache = _f64(state_cache)
    if cache.ndim != 4:
        raise ValueError(f"state_cache: expected shape [S, H, P, N], got {cache.shape}")
    S, H, P, N = cache.shape
    x_, dt_, A_, B_, C_ = _f64(x), _f64(dt), _f64(A), _f64(B), _f64(C)
    if x_.ndim != 3:
        raise ValueError(f"x: expected shape [Bd, H, P], got {x_.shape}")
    Bd = x_.shape[0]
    _check_shape("x", x_, (Bd, H, P))
    if B_.ndim != 3:
        raise ValueError(f"B: expected shape [Bd, G, N], got {B_.shape}")
    G = B_.shape[1]
    _check_shape("dt", dt_, (Bd, H))
    _check_shape("A", A_, (H,))
    _check_shape("B", B_, (Bd, G, N))
    _check_shape("C", C_, (Bd, G, N))
    slots = _i64(slot_ids)
    _check_shape("slot_ids", slots, (Bd,))
    z_ = None if z is None else _f64(z)
    if z_ is not None:
        _check_shape("z", z_, (Bd, H, P))

    groups = _head_groups(H, G)
    d_hp = _skip_term(D, H, P)
    dt_eff = _effective_dt(dt_, dt_bias, dt_softplus, dt_limit)

    y = np.zeros((Bd, H, P))
    new_cache = cache.copy()
    for r in range(Bd):
        slot = int(slots[r])
        if not 0 <= slot < S:  # padding: -1, or any id outside [0, S)
            continue
        s, y[r] = _ssm_step(
            cache[slot],
            x_[r],
            dt_eff[r],
            A_,
            B_[r][groups],
            C_[r][groups],
            d_hp,
            None if z_ is None else z_[r],
        )
        new_cache[slot] = s
    return y, new_cache


# --------------------------------------------------------------------------- conv1d


def _conv_token(
    window: np.ndarray, weight: np.ndarray, bias: np.ndarray, activation: str | None
) -> np.ndarray:
    """One output column: ``window[K, dim]`` holds inputs t-(K-1)..t, oldest first."""
    K = weight.shape[1]
    out = bias.copy()
    for k in range(K):
        out += weight[:, k] * window[k]
    return _silu(out) if activation == "silu" else out


def causal_conv1d_oracle(
    x: ArrayLike,
    weight: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    query_start_loc: ArrayLike,
    conv_state_cache: ArrayLike,
    slot_ids: ArrayLike,
    has_initial_state: ArrayLike,
    activation: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv1d (prefill) over packed sequences, one token at a time.

    Cross-correlation: ``y_t[c] = bias[c] + sum_k weight[c, k] * xin[t - (K-1) + k][c]``,
    where ``xin`` is the sequence's history (the cached ``K-1`` input columns, oldest
    first, or zeros without an initial state) followed by its new tokens; so
    ``weight[:, K-1]`` multiplies the current token.

    Args:
      x: ``x[T, dim]`` packed tokens.
      weight: ``weight[dim, K]``.
      bias: ``bias[dim]`` or None.
      query_start_loc: ``int[B+1]`` packed sequence boundaries.
      conv_state_cache: ``conv_state_cache[S, K-1, dim]``; ``[s, j]`` is the input at
        time ``-(K-1) + j`` relative to the sequence's first new token.
      slot_ids: ``int[B]`` cache slot per sequence; ``-1`` (or any
        id outside ``[0, S)``) = padding sequence.
      has_initial_state: ``bool[B]``; False reads zeros instead of the slot.
      activation: None or ``"silu"``.

    Returns:
      ``(y[T, dim], new_conv_state_cache[S, K-1, dim])``. A sequence's slot gets the last
      ``K-1`` columns of ``history ++ tokens`` (a short sequence shifts the old state).
      Padding sequences and sequences with no new tokens write nothing; their rows and
      rows outside every sequence give 0.
    """
    _check_activation(activation)
    x_, w = _f64(x), _f64(weight)
    if x_.ndim != 2:
        raise ValueError(f"x: expected shape [T, dim], got {x_.shape}")
    T, dim = x_.shape
    if w.ndim != 2 or w.shape[0] != dim:
        raise ValueError(f"weight: expected shape [{dim}, K], got {w.shape}")
    K = w.shape[1]
    b_ = np.zeros(dim) if bias is None else _f64(bias)
    _check_shape("bias", b_, (dim,))
    cache = _f64(conv_state_cache)
    if cache.ndim != 3:
        raise ValueError(f"conv_state_cache: expected shape [S, {K - 1}, {dim}], got {cache.shape}")
    S = cache.shape[0]
    _check_shape("conv_state_cache", cache, (S, K - 1, dim))
    bounds = _seq_bounds(query_start_loc, T)
    slots = _i64(slot_ids)
    _check_shape("slot_ids", slots, (len(bounds),))
    has_init = np.asarray(has_initial_state, dtype=bool)
    _check_shape("has_initial_state", has_init, (len(bounds),))

    y = np.zeros((T, dim))
    new_cache = cache.copy()
    for b, (start, end) in enumerate(bounds):
        slot = int(slots[b])
        if not 0 <= slot < S:  # padding: -1, or any id outside [0, S)
            continue
        history = cache[slot] if has_init[b] else np.zeros((K - 1, dim))
        xin = np.concatenate([history, x_[start:end]], axis=0)  # xin[K-1+i] = token i
        for i, t in enumerate(range(start, end)):
            y[t] = _conv_token(xin[i : i + K], w, b_, activation)
        if end > start:
            new_cache[slot] = xin[xin.shape[0] - (K - 1) :]
    return y, new_cache


def causal_conv1d_update_oracle(
    x: ArrayLike,
    conv_state_cache: ArrayLike,
    weight: ArrayLike,
    bias: ArrayLike | None = None,
    *,
    slot_ids: ArrayLike,
    activation: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Causal depthwise conv1d (decode): each row continues from its slot's state.

    Args:
      x: ``x[Bd, dim]`` (one token per row) or ``x[Bd, L, dim]`` (L tokens per row).
      conv_state_cache: ``conv_state_cache[S, K-1, dim]``, oldest column first.
      weight: ``weight[dim, K]``.
      bias: ``bias[dim]`` or None.
      slot_ids: ``int[Bd]`` cache slot per row; ``-1`` (or any id
        outside ``[0, S)``) = padding row.
      activation: None or ``"silu"``.

    Returns:
      ``(y, new_conv_state_cache)`` with ``y`` shaped like ``x``. Each token shifts its
      slot's state left by one column and appends itself. Padding rows give 0 and write
      nothing.
    """
    _check_activation(activation)
    x_ = _f64(x)
    if x_.ndim not in (2, 3):
        raise ValueError(f"x: expected shape [Bd, dim] or [Bd, L, dim], got {x_.shape}")
    xs = x_[:, None, :] if x_.ndim == 2 else x_
    Bd, L, dim = xs.shape
    w = _f64(weight)
    if w.ndim != 2 or w.shape[0] != dim:
        raise ValueError(f"weight: expected shape [{dim}, K], got {w.shape}")
    K = w.shape[1]
    b_ = np.zeros(dim) if bias is None else _f64(bias)
    _check_shape("bias", b_, (dim,))
    cache = _f64(conv_state_cache)
    if cache.ndim != 3:
        raise ValueError(f"conv_state_cache: expected shape [S, {K - 1}, {dim}], got {cache.shape}")
    S = cache.shape[0]
    _check_shape("conv_state_cache", cache, (S, K - 1, dim))
    slots = _i64(slot_ids)
    _check_shape("slot_ids", slots, (Bd,))

    y = np.zeros((Bd, L, dim))
    new_cache = cache.copy()
    for r in range(Bd):
        slot = int(slots[r])
        if not 0 <= slot < S:  # padding: -1, or any id outside [0, S)
            continue
        state = cache[slot].copy()  # [K-1, dim]
        for i in range(L):
            window = np.concatenate([state, xs[r, i][None, :]], axis=0)  # [K, dim]
            y[r, i] = _conv_token(window, w, b_, activation)
            state = window[1:]
        new_cache[slot] = state
    return y.reshape(x_.shape), new_cache


# --------------------------------------------------------------------------- attention


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


# --------------------------------------------------------------------------- norm


def gated_rms_norm_oracle(
    x: ArrayLike,
    z: ArrayLike | None,
    weight: ArrayLike,
    *,
    group_size: int,
    eps: float = 1e-5,
    norm_before_gate: bool = False,
) -> np.ndarray:
    """Gated RMSNorm over groups of ``group_size`` consecutive channels.

    ``norm_before_gate=False`` (Mamba2 mixer output):
    ``y = rms(x * silu(z)) * weight``; ``True``: ``y = rms(x) * weight * silu(z)``,
    where ``rms(u) = u / sqrt(mean(u^2 over the group) + eps)``. ``z=None``: no gate.

    Args:
      x: ``x[T, Dm]``.
      z: ``z[T, Dm]`` gate, or None.
      weight: ``weight[Dm]``.
      group_size: channels per normalisation group; must divide ``Dm``.
      eps: added to the mean square.
      norm_before_gate: normalise before (True) or after (False) gating.

    Returns:
      ``y[T, Dm]``.
    """
    x_ = _f64(x)
    if x_.ndim != 2:
        raise ValueError(f"x: expected shape [T, Dm], got {x_.shape}")
    T, Dm = x_.shape
    w = _f64(weight)
    _check_shape("weight", w, (Dm,))
    gate = np.ones((T, Dm)) if z is None else _silu(_f64(z))
    _check_shape("z", gate, (T, Dm))
    if group_size <= 0 or Dm % group_size != 0:
        raise ValueError(f"group_size={group_size} must divide Dm={Dm}")

    u = x_ if norm_before_gate else x_ * gate
    y = np.zeros((T, Dm))
    for t in range(T):
        for g0 in range(0, Dm, group_size):
            grp = slice(g0, g0 + group_size)
            y[t, grp] = u[t, grp] / np.sqrt(np.mean(u[t, grp] ** 2) + eps) * w[grp]
    return y * gate if norm_before_gate else y


# --------------------------------------------------------------------------- asserts


def relative_error(actual: ArrayLike, expected: ArrayLike) -> float:
    """``||actual - expected||_F / max(||expected||_F, tiny)``, in float64.

    Where ``expected`` is finite, a non-finite ``actual`` gives ``inf``. Where
    ``expected`` itself is non-finite, ``actual`` must match it (NaN for NaN, the same
    infinity) or the result is ``inf``; such entries are left out of the norms.
    Raises ``ValueError`` if the shapes differ.
    """
    a, e = _f64(actual), _f64(expected)
    if a.shape != e.shape:
        raise ValueError(f"shape mismatch: actual {a.shape} vs expected {e.shape}")
    finite = np.isfinite(e)
    if not np.all(np.isfinite(a[finite])):
        return float("inf")
    special = ~finite
    if np.any(special):
        same_nan = np.isnan(a[special]) & np.isnan(e[special])
        if not np.all(same_nan | (a[special] == e[special])):
            return float("inf")
    diff = np.linalg.norm((a - e)[finite])
    ref = np.linalg.norm(e[finite])
    return float(diff / max(ref, np.finfo(np.float64).tiny))


def assert_close(
    actual: ArrayLike, expected: ArrayLike, *, rtol: float, name: str = "output"
) -> None:
    """Assert ``relative_error(actual, expected) <= rtol``.

    Fails (``AssertionError``) on a shape mismatch, on a non-finite ``actual`` where
    ``expected`` is finite, or on a relative Frobenius error above ``rtol``. The message
    gives ``name``, the error, ``rtol``, the shape, and the index and values of the worst
    element (the first non-finite one, if any, else the largest absolute difference).
    """
    a, e = _f64(actual), _f64(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape mismatch: actual {a.shape}, expected {e.shape}")
    err = relative_error(a, e)
    if err <= rtol:
        return
    if a.size == 0:
        raise AssertionError(f"{name}: relative error {err:.3e} > rtol {rtol:.1e}")
    bad = np.isfinite(e) & ~np.isfinite(a)
    if np.any(bad):
        flat = int(np.flatnonzero(bad)[0])
        what = "first non-finite element"
    else:
        absdiff = np.abs(a - e)
        absdiff[~np.isfinite(absdiff)] = -1.0  # matching non-finite entries are not worst
        flat = int(np.argmax(absdiff))
        what = "worst |actual - expected|"
    idx = tuple(int(i) for i in np.unravel_index(flat, a.shape))
    raise AssertionError(
        f"{name}: relative error {err:.3e} > rtol {rtol:.1e} (shape {a.shape}); "
        f"{what} at index {idx}: actual {float(a[idx])!r}, expected {float(e[idx])!r}"
    )


def assert_close_per_row(
    actual: ArrayLike,
    expected: ArrayLike,
    *,
    rtol: float,
    axis: int = 0,
    atol: float = 0.0,
    name: str = "output",
) -> None:
    """Assert each entry along ``axis`` (a token row, a cache slot) is close on its own.

    Entry ``i`` passes when ``||actual[i] - expected[i]|| <= rtol * ||expected[i]|| + atol``
    (Frobenius norms over the other axes, non-finite entries as in :func:`relative_error`:
    a non-finite ``actual`` where ``expected`` is finite fails). An all-zero expected entry
    must then come back within ``atol`` (exactly 0 by default), as padding rows do.

    Unlike :func:`assert_close`, one wrong row cannot hide behind the norm of the others.
    The message names ``name``, how many entries fail, and the worst entry with its
    relative error and worst element.
    """
    a, e = _f64(actual), _f64(expected)
    if a.shape != e.shape:
        raise AssertionError(f"{name}: shape mismatch: actual {a.shape}, expected {e.shape}")
    if a.ndim == 0:
        raise ValueError(f"{name}: per-row comparison needs at least one axis")
    a, e = np.moveaxis(a, axis, 0), np.moveaxis(e, axis, 0)
    n = a.shape[0]
    errors = np.zeros(n)  # (diff - atol) / ref: > rtol fails, inf for a non-finite miss
    for i in range(n):
        ai, ei = a[i], e[i]
        err = relative_error(ai, ei)  # checks non-finite entries
        if err != float("inf"):
            finite = np.isfinite(ei)
            diff = float(np.linalg.norm((ai - ei)[finite]))
            ref = float(np.linalg.norm(ei[finite]))
            excess = max(diff - atol, 0.0)
            err = 0.0 if excess == 0.0 else excess / max(ref, np.finfo(np.float64).tiny)
        errors[i] = err
    bad = np.flatnonzero(errors > rtol)
    if bad.size == 0:
        return
    worst = int(bad[np.argmax(errors[bad])])
    try:
        assert_close(a[worst], e[worst], rtol=0.0, name="")
        detail = ""
    except AssertionError as failure:
        detail = str(failure).split("; ", 1)[-1]
    raise AssertionError(
        f"{name}: {bad.size} of {n} entries along axis {axis} exceed rtol {rtol:.1e} "
        f"(atol {atol:.1e}): {bad[:16].tolist()}{' ...' if bad.size > 16 else ''}; "
        f"worst is entry {worst}, relative error {errors[worst]:.3e}; {detail}"
    )


def assert_slots_untouched(
    new_cache: ArrayLike,
    old_cache: ArrayLike,
    touched_slots: ArrayLike,
    *,
    name: str = "cache",
) -> None:
    """Assert every slot (entry of the first axis) not in ``touched_slots`` is bit-identical.

    Compares raw bytes, so NaN payloads, signed zeros and bf16 values count: what a kernel
    must leave alone (slots no row names, slots of padding rows) comes back exactly as it
    went in. ``touched_slots`` may hold -1 and other ids outside ``[0, S)`` (padding); they
    name no slot. Dtypes and shapes must match.
    """
    new, old = np.asarray(new_cache), np.asarray(old_cache)
    if new.dtype != old.dtype or new.shape != old.shape:
        raise AssertionError(
            f"{name}: came back as {new.dtype}{list(new.shape)}, "
            f"went in as {old.dtype}{list(old.shape)}"
        )
    if new.ndim == 0:
        raise ValueError(f"{name}: a slot-indexed cache needs at least one axis")
    num_slots = new.shape[0]
    touched = {int(s) for s in np.asarray(touched_slots).reshape(-1) if 0 <= s < num_slots}
    changed = [
        s for s in range(num_slots) if s not in touched and new[s].tobytes() != old[s].tobytes()
    ]
    if not changed:
        return
    first = changed[0]
    a = np.ascontiguousarray(new[first]).reshape(-1)
    b = np.ascontiguousarray(old[first]).reshape(-1)
    width = new.dtype.itemsize
    element = int(
        np.flatnonzero(
            np.any(a.view(np.uint8).reshape(-1, width) != b.view(np.uint8).reshape(-1, width), 1)
        )[0]
    )
    index = tuple(int(i) for i in np.unravel_index(element, new.shape[1:]))
    raise AssertionError(
        f"{name}: {len(changed)} untouched slot(s) changed: {changed[:16]}"
        f"{' ...' if len(changed) > 16 else ''}; slot {first} at {index}: "
        f"now {float(a[element])!r} (0x{a[element : element + 1].tobytes().hex()}), "
        f"was {float(b[element])!r} (0x{b[element : element + 1].tobytes().hex()})"
    )


_TOLERANCES = {
    "float64": 1e-5,
    "float32": 1e-5,
    "bfloat16": 2e-2,
    "float16": 2e-2,
}


def tolerance_for(dtype: Any) -> float:
    """Relative-error tolerance for inputs of ``dtype`` (DESIGN.md, section 7).

    1e-5 for float32/float64, 2e-2 for bfloat16/float16. Accepts NumPy or JAX dtypes,
    scalar types (``jnp.bfloat16``) or names (``"bfloat16"``); compared by name, so no
    JAX import is needed.
    """
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = getattr(dtype, "__name__", None) or getattr(dtype, "name", str(dtype))
    if name not in _TOLERANCES:
        raise ValueError(f"dtype: expected one of {sorted(_TOLERANCES)}, got {dtype!r}")
    return _TOLERANCES[name]


# --------------------------------------------------------------------------- grouped matmul


def grouped_matmul_oracle(x: ArrayLike, w: ArrayLike, group_sizes: ArrayLike) -> np.ndarray:
    """MoE expert matmul (``jax.lax.ragged_dot`` semantics), expert by expert.

    Expert ``e`` owns rows ``[offset_e, offset_e + group_sizes[e])`` of ``x`` with
    ``offset_e = sum(group_sizes[:e])`` and multiplies them by ``w[e]``; rows past
    ``sum(group_sizes)`` come back as 0.

    Args:
      x: ``x[M, K]`` rows sorted by expert.
      w: ``w[E, K, N]``.
      group_sizes: ``[E]`` non-negative rows per expert, summing to at most ``M``.

    Returns:
      ``y[M, N]``.
    """
    x_, w_, sizes = _f64(x), _f64(w), _i64(group_sizes)
    if x_.ndim != 2 or w_.ndim != 3 or w_.shape[1] != x_.shape[1]:
        raise ValueError(f"x: expected [M, K] and w [E, K, N], got {x_.shape} and {w_.shape}")
    _check_shape("group_sizes", sizes, (w_.shape[0],))
    if np.any(sizes < 0) or sizes.sum() > x_.shape[0]:
        raise ValueError(f"group_sizes={sizes.tolist()} must be >= 0 and sum to <= {x_.shape[0]}")
    y = np.zeros((x_.shape[0], w_.shape[2]))
    offset = 0
    for e, size in enumerate(sizes):
        for r in range(offset, offset + size):
            y[r] = x_[r] @ w_[e]
        offset += size
    return y


# --------------------------------------------------------------------------- gradients


def _as_tuple(a: Any) -> tuple[Any, ...]:
    return tuple(a) if isinstance(a, (tuple, list)) else (a,)


def _inner(a: Any, b: Any) -> float:
    """Sum of elementwise products over matching tuples of arrays (None counts as 0)."""
    return float(
        sum(
            np.sum(_f64(x) * _f64(y))
            for x, y in zip(_as_tuple(a), _as_tuple(b), strict=True)
            if x is not None and y is not None
        )
    )


def finite_difference_vjp(
    f: Any,
    primals: tuple[ArrayLike, ...],
    cotangent: Any,
    direction: tuple[ArrayLike | None, ...],
    *,
    eps: float = 1e-6,
) -> float:
    """``⟨u, J v⟩`` by central finite differences of a float64 function.

    ``f(*primals)`` returns an array or a tuple of arrays (an oracle of this module, for
    instance); ``u = cotangent`` has its structure, ``v = direction`` the primals' (None:
    that input does not move). Returns ``⟨u, (f(p + eps v) − f(p − eps v)) / 2 eps⟩``: the
    number a correct vector-Jacobian product ``g = Jᵀ u`` must reproduce as ``⟨g, v⟩``.
    The truncation error is O(eps²) for smooth ``f``, the rounding error about
    1e-16 / eps relative, both far below float32 gradients' own error.
    """
    return _inner(cotangent, _directional_derivative(f, primals, direction, eps))


def _directional_derivative(
    f: Any, primals: tuple[ArrayLike, ...], direction: tuple[ArrayLike | None, ...], eps: float
) -> tuple[np.ndarray, ...]:
    """``J v`` of ``f`` at ``primals`` by central differences, one array per output."""
    primals = tuple(_f64(p) for p in primals)
    if len(direction) != len(primals):
        raise ValueError(f"direction has {len(direction)} entries, primals {len(primals)}")

    def shifted(sign: float) -> Any:
        moved = tuple(
            p if v is None else p + sign * eps * _f64(v)
            for p, v in zip(primals, direction, strict=True)
        )
        return _as_tuple(f(*moved))

    plus, minus = shifted(1.0), shifted(-1.0)
    return tuple((_f64(a) - _f64(b)) / (2 * eps) for a, b in zip(plus, minus, strict=True))


def vjp_errors(
    f: Any,
    primals: tuple[ArrayLike, ...],
    cotangent: Any,
    grads: tuple[ArrayLike | None, ...],
    *,
    wrt: tuple[int, ...] | None = None,
    num_directions: int = 2,
    eps: float = 1e-6,
    seed: int = 0,
) -> dict[int, float]:
    """Errors of the gradients ``grads = Jᵀ u`` (one per primal, None where not checked)
    against central finite differences of the float64 function ``f``.

    For each input ``i`` in ``wrt`` (default: every one with a gradient), along
    ``num_directions`` random normal directions ``v`` that move only that input, compares
    ``⟨g_i, v⟩`` with :func:`finite_difference_vjp`'s ``⟨u, J v⟩``. The error of one
    direction is ``|⟨g_i, v⟩ − ⟨u, J v⟩| / max(‖g_i‖ ‖v‖, ‖u‖ ‖J v‖)`` (Cauchy–Schwarz
    bounds of either side, so an inner product that cancels does not blow it up; a gradient
    wrongly 0 scores ``|⟨u, J v⟩| / (‖u‖ ‖J v‖)``, far above rounding); the result maps
    ``i`` to the worst over directions. fp32 gradients of well-scaled inputs score ~1e-8.

    Example::

        _, vjp = jax.vjp(lambda x, w: my_op(x, w), x, w)
        grads = vjp(dy)
        errors = vjp_errors(lambda x, w: my_oracle(x, w), (x, w), dy, grads)
        assert max(errors.values()) <= 1e-4
    """
    rng = np.random.default_rng(seed)
    primals = tuple(_f64(p) for p in primals)
    if len(grads) != len(primals):
        raise ValueError(f"grads has {len(grads)} entries, primals {len(primals)}")
    if wrt is None:
        wrt = tuple(i for i, g in enumerate(grads) if g is not None)
    u_norm = np.sqrt(_inner(cotangent, cotangent))
    errors: dict[int, float] = {}
    for i in wrt:
        g = _f64(grads[i])
        if g.shape != primals[i].shape:
            raise ValueError(f"grads[{i}]: shape {g.shape}, primal {primals[i].shape}")
        worst = 0.0
        for _ in range(num_directions):
            v = rng.normal(size=primals[i].shape)
            direction = tuple(v if j == i else None for j in range(len(primals)))
            jv = _directional_derivative(f, primals, direction, eps)
            fd = _inner(cotangent, jv)
            analytic = float(np.sum(g * v))
            jv_norm = np.sqrt(_inner(jv, jv))
            scale = max(np.linalg.norm(g) * np.linalg.norm(v), u_norm * jv_norm)
            err = abs(analytic - fd) / max(scale, np.finfo(np.float64).tiny)
            worst = max(worst, float(err))
        errors[i] = worst
    return errors
