"""``selective_state_update``: validation and dispatch for the decode SSM step."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import _validation as checks
from pallas_kernels.backend import Implementation, dispatch
from pallas_kernels.state_update import reference, triton

IMPLEMENTATIONS: dict[str, Callable] = {
    "xla": reference.selective_state_update,
    "triton": triton.selective_state_update,
}


def selective_state_update(
    state_cache: jax.Array,
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    *,
    slot_ids: jax.Array,
    D: jax.Array | None = None,
    z: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    validate: bool = False,
    implementation: Implementation = "auto",
) -> tuple[jax.Array, jax.Array]:
    """One Mamba2 decode step per row, on a slot-indexed state cache.

    For row ``r`` with slot ``s = slot_ids[r]`` (``-1``: padding, nothing read or written,
    ``y[r] = 0``)::

        dt' = clamp(softplus(dt + dt_bias) if dt_softplus else dt + dt_bias, *dt_limit)
        state_cache[s] = exp(dt' A) state_cache[s] + dt' x ⊗ B
        y = C · state_cache[s] + D x,   then y *= silu(z) when z is given

    Args:
      state_cache: state_cache[S, H, P, N], fp32 or bf16; updated functionally (in place
        under buffer donation). Slots not named come back bit-identical.
      x: x[Bd, H, P] this step's token per row.
      dt: dt[Bd, H].
      A: A[H].
      B: B[Bd, G, N].
      C: C[Bd, G, N].
      slot_ids: int32[Bd], cache slot of each row, ``-1`` for padding rows.
      D: D[H] or D[H, P].
      z: z[Bd, H, P] gate.
      dt_bias: dt_bias[H].
      dt_softplus: apply softplus to ``dt + dt_bias``.
      dt_limit: (lo, hi) clamp of the processed dt (the model's ``time_step_limit``).
      validate: check ``slot_ids`` on the host (needs concrete arrays).
      implementation: "auto" | "xla" | "triton" | "mosaic".

    Returns:
      ``(y[Bd, H, P], new_state_cache[S, H, P, N])``, ``y`` in ``x``'s dtype.
    """
    state_cache, x, dt, A, B, C, slot_ids = (
        jnp.asarray(a) for a in (state_cache, x, dt, A, B, C, slot_ids)
    )
    D, z, dt_bias = (None if a is None else jnp.asarray(a) for a in (D, z, dt_bias))
    for name, a in (
        ("state_cache", state_cache),
        ("x", x),
        ("dt", dt),
        ("A", A),
        ("B", B),
        ("C", C),
    ):
        checks.check_floating(name, a)
    checks.check_integer("slot_ids", slot_ids)
    if state_cache.ndim != 4:
        raise ValueError(f"state_cache must have shape [S, H, P, N], got {state_cache.shape}")
    S, H, P, N = state_cache.shape
    if x.ndim != 3:
        raise ValueError(f"x must have shape [Bd, H, P], got {x.shape}")
    Bd = x.shape[0]
    checks.check_shape("x", x, (Bd, H, P), "[Bd, H, P]")
    if B.ndim != 3:
        raise ValueError(f"B must have shape [Bd, G, N], got {B.shape}")
    G = B.shape[1]
    if G < 1 or H % G:
        raise ValueError(f"number of groups G={G} (B.shape[1]) must divide H={H}")
    checks.check_shape("dt", dt, (Bd, H), "[Bd, H]")
    checks.check_shape("A", A, (H,), "[H]")
    checks.check_shape("B", B, (Bd, G, N), "[Bd, G, N]")
    checks.check_shape("C", C, (Bd, G, N), "[Bd, G, N]")
    checks.check_shape("slot_ids", slot_ids, (Bd,), "[Bd]")
    if D is not None and D.shape not in ((H,), (H, P)):
        raise ValueError(f"D must have shape [H] = ({H},) or [H, P] = ({H}, {P}), got {D.shape}")
    if z is not None:
        checks.check_shape("z", z, (Bd, H, P), "[Bd, H, P]")
    if dt_bias is not None:
        checks.check_shape("dt_bias", dt_bias, (H,), "[H]")
    lo, hi = (float(b) for b in dt_limit)
    if not lo <= hi:
        raise ValueError(f"dt_limit={dt_limit} must satisfy lo <= hi")
    if validate:
        checks.validate_slot_ids(slot_ids, S)

    return dispatch(
        IMPLEMENTATIONS,
        implementation,
        state_cache,
        x,
        dt,
        A,
        B,
        C,
        op="selective_state_update",
        slot_ids=slot_ids.astype(jnp.int32),
        D=D,
        z=z,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=(lo, hi),
    )
