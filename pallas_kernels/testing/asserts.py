"""Relative error and the assert helpers built on it: the whole-array and per-row
relative Frobenius checks, the bit-for-bit check of untouched cache slots, and the
per-dtype tolerances of DESIGN.md section 7.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._common import ArrayLike, _f64


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
