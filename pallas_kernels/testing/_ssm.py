"""Private pieces of the Mamba2 recurrence that the SSD prefill oracle and the decode
state-update oracle both step through: the effective time step, the head-to-group map,
the skip term and one token's update.
"""

from __future__ import annotations

import numpy as np

from ._common import ArrayLike, _check_shape, _f64, _silu, _softplus


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
