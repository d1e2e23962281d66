"""Argument checks shared by every op's ``api.py``.

Static checks (shapes, dtypes, static arguments) run at trace time and raise ``ValueError``
naming the argument and the expected shape. Data checks (``validate=True``) need concrete
arrays and run on the host; jitted kernels stay in bounds whatever the data.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import checked_slots


def check_int(name: str, value: object, *, low: int | None = None, what: str | None = None) -> int:
    """``value`` as an int (bools and fractional numbers refused), ``>= low`` when given;
    ``ValueError`` naming ``name`` (and ``what`` the bound is, when given) otherwise."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} must be an int") from None
    if low is not None and number < low:
        bound = low if what is None else f"{what}={low}"
        raise ValueError(f"{name}={number} must be >= {bound}")
    return number


def check_float(name: str, value: object, *, low: float | None = None) -> float:
    """``value`` as a float (not NaN; a bool refused), ``>= low`` when given; ``ValueError``
    naming ``name`` otherwise."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be a number") from None
    if number != number:
        raise ValueError(f"{name}={value!r} must not be NaN")
    if low is not None and number < low:
        raise ValueError(f"{name}={number} must be >= {low}")
    return number


def check_int_fields(config: object) -> None:
    """Every field of a block-size dataclass is an int (a bool where the field is declared
    ``bool``), or None where the type allows it: ``ValueError`` naming the field otherwise
    (before the type's own range checks would compare a string or a float)."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        name = f"{type(config).__name__}.{field.name}"
        if field.type in (bool, "bool"):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be a bool")
        elif value is not None:
            check_int(name, value)


def check_shape(name: str, array: jax.Array, expected: Sequence[int | None], letters: str) -> None:
    """Raises unless ``array.shape`` matches ``expected`` (``None`` matches any size).

    ``letters`` spells the expected shape, e.g. ``"[T, H, P]"``.
    """
    shape = tuple(array.shape)
    if len(shape) != len(expected) or any(
        e is not None and e != s for e, s in zip(expected, shape, strict=False)
    ):
        want = tuple("?" if e is None else e for e in expected)
        raise ValueError(f"{name} must have shape {letters} = {want}, got {shape}")


def check_floating(name: str, array: jax.Array) -> None:
    if not jnp.issubdtype(array.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating-point array, got dtype {array.dtype}")


def check_integer(name: str, array: jax.Array) -> None:
    if not jnp.issubdtype(array.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array, got dtype {array.dtype}")


def check_activation(activation: str | None) -> None:
    if activation not in (None, "silu"):
        raise ValueError(f"activation={activation!r} must be None or 'silu'")


def check_sequences(query_start_loc: jax.Array, has_initial_state: jax.Array) -> int:
    """Checks ``query_start_loc`` (integer ``[B + 1]``, B >= 1) and ``has_initial_state[B]``;
    returns B."""
    check_integer("query_start_loc", query_start_loc)
    if query_start_loc.ndim != 1 or query_start_loc.shape[0] < 2:
        raise ValueError(
            f"query_start_loc must have shape [B + 1] with B >= 1, got {query_start_loc.shape}"
        )
    num_seqs = query_start_loc.shape[0] - 1
    check_shape("has_initial_state", has_initial_state, (num_seqs,), "[B]")
    return num_seqs


def host_values(name: str, array: jax.Array) -> np.ndarray:
    """The values of ``array`` on the host, for ``validate=True`` data checks."""
    if isinstance(array, jax.core.Tracer):
        raise ValueError(
            f"validate=True needs concrete arrays, but {name} is traced; "
            "call with validate=True outside jax.jit (or check in the batch builder)"
        )
    return np.asarray(jax.device_get(array))


def validate_query_start_loc(query_start_loc: jax.Array, num_tokens: int) -> np.ndarray:
    """Data check: starts at 0, non-decreasing, ends within the ``num_tokens`` packed rows."""
    qsl = host_values("query_start_loc", query_start_loc)
    if qsl[0] != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {qsl[0]}")
    if np.any(np.diff(qsl) < 0):
        raise ValueError(f"query_start_loc must be non-decreasing, got {qsl.tolist()}")
    if qsl[-1] > num_tokens:
        raise ValueError(f"query_start_loc[-1]={qsl[-1]} exceeds the {num_tokens} packed tokens")
    return qsl


def validate_slot_ids(slot_ids: jax.Array, num_slots: int) -> np.ndarray:
    """Data check: each slot id is -1 (padding) or in ``[0, num_slots)``, named at most once."""
    slots = host_values("slot_ids", slot_ids)
    bad = (slots < -1) | (slots >= num_slots)
    if np.any(bad):
        raise ValueError(
            f"slot_ids must be -1 or in [0, {num_slots}), got {slots[bad].tolist()} "
            f"at rows {np.flatnonzero(bad).tolist()}"
        )
    named = slots[slots >= 0]
    if len(np.unique(named)) != len(named):
        raise ValueError(f"slot_ids must name each cache slot at most once, got {slots.tolist()}")
    return slots


def check_ssm_inputs(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    *,
    D: jax.Array | None,
    z: jax.Array | None,
    dt_bias: jax.Array | None,
    dt_limit: tuple[float, float],
    rows: str,
    A_name: str = "A",
) -> tuple[float, float]:
    """Checks of the Mamba2 SSM arguments shared by ``ssd_scan`` and
    ``selective_state_update``: ``x[R, H, P]``, ``dt[R, H]``, ``A[H]``, ``B``/``C[R, G, N]``
    with ``G`` dividing ``H``, ``D[H]`` or ``[H, P]``, ``z[R, H, P]``, ``dt_bias[H]``.

    ``rows`` names the leading axis in messages (``"T"``, ``"Bd"``), ``A_name`` the decay
    rates (``"A_log"`` for the fused Mamba2 ops, which take them as the mixer holds them).
    Returns ``dt_limit`` as floats with ``lo <= hi``.
    """
    for name, a in (("x", x), ("dt", dt), (A_name, A), ("B", B), ("C", C)):
        check_floating(name, a)
    for name, a in (("D", D), ("z", z), ("dt_bias", dt_bias)):
        if a is not None:
            check_floating(name, a)
    if x.ndim != 3:
        raise ValueError(f"x must have shape [{rows}, H, P], got {x.shape}")
    R, H, P = x.shape
    if B.ndim != 3:
        raise ValueError(f"B must have shape [{rows}, G, N], got {B.shape}")
    G, N = B.shape[1:]
    if G < 1 or H % G:
        raise ValueError(f"number of groups G={G} (B.shape[1]) must divide H={H}")
    check_shape("dt", dt, (R, H), f"[{rows}, H]")
    check_shape(A_name, A, (H,), "[H]")
    check_shape("B", B, (R, G, N), f"[{rows}, G, N]")
    check_shape("C", C, (R, G, N), f"[{rows}, G, N]")
    if D is not None and D.shape not in ((H,), (H, P)):
        raise ValueError(f"D must have shape [H] = ({H},) or [H, P] = ({H}, {P}), got {D.shape}")
    if z is not None:
        check_shape("z", z, (R, H, P), f"[{rows}, H, P]")
    if dt_bias is not None:
        check_shape("dt_bias", dt_bias, (H,), "[H]")
    try:
        lo, hi = dt_limit
    except (TypeError, ValueError):
        raise ValueError(f"dt_limit={dt_limit!r} must be a pair (lo, hi)") from None
    lo, hi = check_float("dt_limit[0]", lo), check_float("dt_limit[1]", hi)
    if not lo <= hi:
        raise ValueError(f"dt_limit={dt_limit} must satisfy lo <= hi")
    return lo, hi


def check_state_cache(state_cache: jax.Array, heads: int, head_dim: int, state_dim: int) -> int:
    """Checks a floating ``state_cache[S, H, P, N]`` against the SSM's sizes; returns S."""
    check_floating("state_cache", state_cache)
    if state_cache.ndim != 4 or state_cache.shape[1:] != (heads, head_dim, state_dim):
        raise ValueError(
            f"state_cache must have shape [S, H, P, N] = (S, {heads}, {head_dim}, {state_dim}), "
            f"got {state_cache.shape}"
        )
    return state_cache.shape[0]


_INT32 = np.iinfo(np.int32)


def slot_ids_array(slot_ids: jax.Array | np.ndarray | Sequence[int]) -> jax.Array:
    """``slot_ids`` as a JAX array, its host ids that int32 cannot hold clipped to int32's
    range first: they stay outside every cache (padding to the kernels, rejected by
    ``validate=True``), where ``jnp.asarray`` would wrap them onto real slots (``2**32`` to
    slot 0) under JAX's default 32-bit integers. JAX arrays pass unchanged: a 64-bit one
    (``jax_enable_x64``) is compared in its own dtype by ``checked_slots``."""
    if isinstance(slot_ids, jax.Array):
        return slot_ids
    host = np.asarray(slot_ids)
    if host.dtype == object:  # Python ints beyond 64 bits
        raise ValueError(f"slot_ids must be an integer array, got {slot_ids!r}")
    if np.issubdtype(host.dtype, np.integer) and host.dtype.itemsize >= 4:
        host = np.clip(host, max(_INT32.min, np.iinfo(host.dtype).min), _INT32.max)
    return jnp.asarray(host)


def check_slot_ids(slot_ids: jax.Array, rows: int, num_slots: int, letters: str) -> jax.Array:
    """The one place slot ids are checked: an integer ``slot_ids[rows]``, returned as int32
    with every id outside ``[0, num_slots)`` mapped to -1, so padding (``-1``) and bad data
    (``>= S``, ``< -1``) are the same thing to every backend: nothing read or written, zero
    outputs."""
    check_integer("slot_ids", slot_ids)
    check_shape("slot_ids", slot_ids, (rows,), letters)
    return checked_slots(slot_ids, num_slots)
