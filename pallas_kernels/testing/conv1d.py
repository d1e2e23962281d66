"""Float64 oracles of the causal depthwise conv1d: prefill over packed sequences
(``causal_conv1d_oracle``) and decode from each row's cached state
(``causal_conv1d_update_oracle``), one token at a time.
"""

from __future__ import annotations

import numpy as np

from ._common import ArrayLike, _check_shape, _f64, _i64, _seq_bounds, _silu


def _check_activation(activation: str | None) -> None:
    if activation not in (None, "silu"):
        raise ValueError(f"activation: expected None or 'silu', got {activation!r}")


def _conv_token(
    window: np.ndarray, weight: np.ndarray, bias: np.ndarray, activation: str | None
) -> np.ndarray:
    """One output column: ``window[K, dim]`` holds inputs t-(K-1)..t, oldest first."""
    K = weight.shape[1]
    out = bias.copy()
    for k in range(K):
        out += weight[:, k] * window[k]
    return _silu(out) if activation == "silu" else out


def _conv_params(
    weight: ArrayLike, bias: ArrayLike | None, conv_state_cache: ArrayLike, dim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The checked ``weight[dim, K]``, ``bias[dim]`` (zeros when None) and
    ``conv_state_cache[S, K-1, dim]`` of both conv1d oracles, as float64."""
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
    return w, b_, cache


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
    x_ = _f64(x)
    if x_.ndim != 2:
        raise ValueError(f"x: expected shape [T, dim], got {x_.shape}")
    T, dim = x_.shape
    w, b_, cache = _conv_params(weight, bias, conv_state_cache, dim)
    K, S = w.shape[1], cache.shape[0]
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
    w, b_, cache = _conv_params(weight, bias, conv_state_cache, dim)
    S = cache.shape[0]
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
