"""Float64 oracle of the Mamba2 SSD prefill (``ssd_scan``): packed sequences, one token
at a time.
"""

from __future__ import annotations

import numpy as np

from ._common import ArrayLike, _check_shape, _f64, _seq_bounds
from ._ssm import _effective_dt, _head_groups, _skip_term, _ssm_step


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
