"""Gradient checks by central finite differences of float64 functions (the oracles of
this package, for instance): one directional derivative against a cotangent
(``finite_difference_vjp``) and the errors of computed VJPs (``vjp_errors``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._common import ArrayLike, _f64


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

    ``f(*primals)`` returns an array or a tuple of arrays (an oracle of this package, for
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
