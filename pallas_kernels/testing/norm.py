"""Float64 oracle of the gated RMSNorm (``gated_rms_norm``), group by group."""

from __future__ import annotations

import numpy as np

from ._common import ArrayLike, _check_shape, _f64, _silu


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
