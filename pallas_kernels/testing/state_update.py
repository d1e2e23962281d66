"""Float64 oracle of the decode-time SSM step (``selective_state_update``): one token per
row, read from and written back to its cache slot.
"""

from __future__ import annotations

import numpy as np

from ._common import ArrayLike, _check_shape, _f64, _i64
from ._ssm import _effective_dt, _head_groups, _skip_term, _ssm_step


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
      D, z, dt_bias, dt_softplus, dt_limit: as in :func:`.ssd.ssd_oracle` (``z[Bd, H, P]``).

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
