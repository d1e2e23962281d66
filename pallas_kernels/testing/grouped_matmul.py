"""Float64 oracle of the MoE grouped matmul (``jax.lax.ragged_dot`` semantics), expert by
expert.
"""

from __future__ import annotations

import numpy as np

from ._common import ArrayLike, _check_shape, _f64, _i64


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
