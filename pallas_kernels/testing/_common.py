"""Private helpers every oracle shares: float64/int64 conversion, shape checks, the
token rows of packed sequences, and the softplus and SiLU activations.
"""

from __future__ import annotations

from typing import Any

import numpy as np

ArrayLike = Any
"""Anything ``np.asarray`` accepts: NumPy or JAX arrays, scalars, nested lists."""


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
