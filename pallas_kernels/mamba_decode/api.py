"""``mamba2_decode``: validation and dispatch for the fused Mamba2 decode step."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import _validation as checks
from pallas_kernels.backend import Backend, Call, Implementation, Op
from pallas_kernels.mamba_decode import reference, triton

MAMBA2_DECODE = Op(
    "mamba2_decode",
    (
        Backend(
            "triton",
            triton.mamba2_decode,
            config_type=triton.BlockSizes,
            default_config=lambda zxbcdt, conv, ssm_state_cache, *_, **__: (
                triton.default_block_sizes(
                    ssm_state_cache.shape[2],
                    ssm_state_cache.shape[3],
                    rows=zxbcdt.shape[0],
                    num_heads=ssm_state_cache.shape[1],
                )
            ),
            check_config=lambda config, zxbcdt, conv, ssm_state_cache, *_, **__: (
                triton.check_block_sizes(config, ssm_state_cache.shape[1])
            ),
        ),
        Backend("xla", reference.mamba2_decode),
    ),
)


def mamba2_decode(
    zxbcdt: jax.Array,
    conv_state_cache: jax.Array,
    ssm_state_cache: jax.Array,
    conv_weight: jax.Array,
    A: jax.Array,
    *,
    slot_ids: jax.Array,
    conv_bias: jax.Array | None = None,
    D: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    gate: bool = True,
    validate: bool = False,
    implementation: Implementation = "auto",
    config: triton.BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The Mamba2 mixer's decode step between in_proj and the gated norm, one token per row.

    For row ``r`` with slot ``s = slot_ids[r]`` (``-1`` or any id outside ``[0, S)``:
    padding, nothing read or written, zero outputs), with ``d_inner = H·P`` and
    ``conv_dim = d_inner + 2·G·N``::

        z, xBC, dt = zxbcdt[r] split at d_inner and d_inner + conv_dim
        xBC, conv_state_cache[s] = causal_conv1d_update(xBC, ..., activation="silu")
        x, B, C = xBC split into [H, P], [G, N], [G, N]
        y, ssm_state_cache[s] = selective_state_update(x, dt, A, B, C, D, dt_bias, ...)
        u = y · silu(z) if gate else y,   squares[r, h] = Σ_p u[h, p]²

    which is ``causal_conv1d_update`` and ``selective_state_update`` on the slices of the
    packed row, in one kernel that reads the row in place (the Triton backend; its conv
    output stays fp32 between the two steps). ``gate=False`` leaves the gate to the caller
    (a norm before the gate). ``squares`` is what a gated RMSNorm of ``u`` needs: a norm
    group of heads ``h0 .. h1`` scales ``u`` by ``rsqrt(Σ squares[:, h0:h1] / size + eps)``.

    Args:
      zxbcdt: zxbcdt[Bd, 2·H·P + 2·G·N + H], in_proj's output row ``z | x | B | C | dt``.
      conv_state_cache: conv_state_cache[S, K-1, conv_dim], updated functionally.
      ssm_state_cache: ssm_state_cache[S, H, P, N], fp32 or bf16, updated functionally.
      conv_weight: conv_weight[conv_dim, K], K >= 2 (``weight[:, K-1]`` multiplies this
        token).
      A: A[H].
      slot_ids: int32[Bd], each row's slot in both caches.
      conv_bias: conv_bias[conv_dim].
      D: D[H] or D[H, P].
      dt_bias: dt_bias[H].
      dt_softplus: apply softplus to ``dt + dt_bias``.
      dt_limit: (lo, hi) clamp of the processed dt.
      gate: multiply y by ``silu(z)``.
      validate: check ``slot_ids`` on the host (needs concrete arrays).
      implementation: "auto" | "xla" | "triton", or a sequence of backend names.
      config: the Triton backend's block sizes (``state_update.triton.BlockSizes``; its
        ``block_h`` must divide H).

    Returns:
      ``(u[Bd, H·P] in zxbcdt's dtype, squares[Bd, H] fp32, conv_state_cache,
      ssm_state_cache)``; slots not named come back bit-identical.
    """
    zxbcdt, conv_state_cache, ssm_state_cache, conv_weight, A, slot_ids = (
        jnp.asarray(a)
        for a in (zxbcdt, conv_state_cache, ssm_state_cache, conv_weight, A, slot_ids)
    )
    conv_bias, D, dt_bias = (None if a is None else jnp.asarray(a) for a in (conv_bias, D, dt_bias))
    for name, a in (("zxbcdt", zxbcdt), ("conv_state_cache", conv_state_cache)):
        checks.check_floating(name, a)
    if ssm_state_cache.ndim != 4:
        raise ValueError(
            f"ssm_state_cache must have shape [S, H, P, N], got {ssm_state_cache.shape}"
        )
    S, H, P, N = ssm_state_cache.shape
    d_inner = H * P
    if conv_weight.ndim != 2 or conv_weight.shape[1] < 2:
        raise ValueError(
            f"conv_weight must have shape [conv_dim, K] with K >= 2, got {conv_weight.shape}"
        )
    conv_dim, width = conv_weight.shape
    groups, rest = divmod(conv_dim - d_inner, 2 * N)
    if rest or groups < 1:
        raise ValueError(
            f"conv_weight.shape[0]={conv_dim} must be H·P + 2·G·N = {d_inner} + 2·G·{N} "
            "for a number of groups G >= 1"
        )
    if zxbcdt.ndim != 2 or zxbcdt.shape[1] != d_inner + conv_dim + H:
        raise ValueError(
            f"zxbcdt must have shape [Bd, 2·H·P + 2·G·N + H] = (Bd, {d_inner + conv_dim + H}), "
            f"got {zxbcdt.shape}"
        )
    Bd = zxbcdt.shape[0]
    checks.check_shape(
        "conv_state_cache", conv_state_cache, (S, width - 1, conv_dim), "[S, K-1, conv_dim]"
    )
    if conv_bias is not None:
        checks.check_shape("conv_bias", conv_bias, (conv_dim,), "[conv_dim]")
    # The SSM's arguments as the slices of the packed row they are.
    part = lambda shape: jax.ShapeDtypeStruct(shape, zxbcdt.dtype)  # noqa: E731
    dt_limit = checks.check_ssm_inputs(
        part((Bd, H, P)),
        part((Bd, H)),
        A,
        part((Bd, groups, N)),
        part((Bd, groups, N)),
        D=D,
        z=None,
        dt_bias=dt_bias,
        dt_limit=dt_limit,
        rows="Bd",
    )
    checked_slot_ids = checks.check_slot_ids(slot_ids, Bd, S, "[Bd]")
    if validate:
        checks.validate_slot_ids(slot_ids, S)
    call = Call(
        (zxbcdt, conv_state_cache, ssm_state_cache, conv_weight, A),
        dict(
            slot_ids=checked_slot_ids,
            conv_bias=conv_bias,
            D=D,
            dt_bias=dt_bias,
            dt_softplus=bool(dt_softplus),
            dt_limit=dt_limit,
            gate=bool(gate),
        ),
        empty=(
            (
                lambda: (
                    jnp.zeros((0, d_inner), zxbcdt.dtype),
                    jnp.zeros((0, H), jnp.float32),
                    conv_state_cache,
                    ssm_state_cache,
                )
            )
            if Bd == 0
            else None
        ),
    )
    return MAMBA2_DECODE.run(call, implementation, config)
