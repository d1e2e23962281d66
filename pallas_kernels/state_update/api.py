"""``selective_state_update``: validation and dispatch for the decode SSM step."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import _validation as checks
from pallas_kernels.backend import Backend, Call, Implementation, Op
from pallas_kernels.state_update import reference, triton, triton_config

SELECTIVE_STATE_UPDATE = Op(
    "selective_state_update",
    (
        Backend(
            "triton",
            triton.selective_state_update,
            config_type=triton_config.BlockSizes,
            default_config=lambda state_cache, x, *_, z=None, **__: (
                triton_config.default_block_sizes(
                    state_cache.shape[2],
                    state_cache.shape[3],
                    rows=x.shape[0],
                    num_heads=state_cache.shape[1],
                    gated=z is not None,
                )
            ),
        ),
        Backend("xla", reference.selective_state_update),
    ),
)


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
    config: triton_config.BlockSizes | None = None,
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
      slot_ids: int32[Bd], cache slot of each row; ``-1`` (or any id outside ``[0, S)``)
        marks a padding row.
      D: D[H] or D[H, P].
      z: z[Bd, H, P] gate.
      dt_bias: dt_bias[H].
      dt_softplus: apply softplus to ``dt + dt_bias``.
      dt_limit: (lo, hi) clamp of the processed dt (the model's ``time_step_limit``).
      validate: check ``slot_ids`` on the host (needs concrete arrays).
      implementation: "auto" | "xla" | "triton" | "mosaic", or a sequence of backend names
        to take the first that serves the call (see ``pallas_kernels.backend``).
      config: the chosen backend's block sizes (``state_update.triton_config.BlockSizes``).

    Returns:
      ``(y[Bd, H, P], new_state_cache[S, H, P, N])``, ``y`` in ``x``'s dtype.
    """
    state_cache, x, dt, A, B, C = (jnp.asarray(a) for a in (state_cache, x, dt, A, B, C))
    slot_ids = checks.slot_ids_array(slot_ids)
    D, z, dt_bias = (None if a is None else jnp.asarray(a) for a in (D, z, dt_bias))
    dt_limit = checks.check_ssm_inputs(
        x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_limit=dt_limit, rows="Bd"
    )
    Bd, H, P = x.shape
    N = B.shape[2]
    S = checks.check_state_cache(state_cache, H, P, N)
    checked_slot_ids = checks.check_slot_ids(slot_ids, Bd, S, "[Bd]")
    if validate:
        checks.validate_slot_ids(slot_ids, S)
    call = Call(
        (state_cache, x, dt, A, B, C),
        dict(
            slot_ids=checked_slot_ids,
            D=D,
            z=z,
            dt_bias=dt_bias,
            dt_softplus=bool(dt_softplus),
            dt_limit=dt_limit,
        ),
        empty=(lambda: (x, state_cache)) if Bd == 0 else None,
    )
    return SELECTIVE_STATE_UPDATE.run(call, implementation, config)
