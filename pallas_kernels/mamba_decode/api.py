"""``mamba2_decode``: validation and dispatch for the Mamba2 mixer's decode step."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import _validation as checks
from pallas_kernels._mamba_mixer import check_packed_mixer
from pallas_kernels.backend import Backend, Call, Implementation, Op
from pallas_kernels.mamba_decode import reference, triton, triton_config

MAMBA2_DECODE = Op(
    "mamba2_decode",
    (
        Backend(
            "triton",
            triton.mamba2_decode,
            config_type=triton_config.BlockSizes,
            default_config=lambda zxbcdt, _, conv_weight, __, ssm_state, *___, **options: (
                triton_config.default_block_sizes(
                    rows=zxbcdt.shape[0],
                    conv_dim=conv_weight.shape[0],
                    state_shape=ssm_state.shape[1:],
                    norm_group_size=options["norm_group_size"],
                    gated=options["norm_weight"] is None and options["gate"],
                )
            ),
        ),
        Backend("xla", reference.mamba2_decode),
    ),
)


def mamba2_decode(
    zxbcdt: jax.Array,
    conv_state_cache: jax.Array,
    conv_weight: jax.Array,
    conv_bias: jax.Array | None,
    ssm_state_cache: jax.Array,
    A_log: jax.Array,
    *,
    slot_ids: jax.Array,
    D: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    norm_weight: jax.Array | None = None,
    norm_group_size: int | None = None,
    norm_eps: float = 1e-5,
    norm_before_gate: bool = False,
    gate: bool = True,
    validate: bool = False,
    implementation: Implementation = "auto",
    config: triton_config.BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode token per row through a Mamba2 mixer, from in_proj's output to the input
    of out_proj: :func:`causal_conv1d_update` (SiLU) on the xBC columns,
    :func:`selective_state_update` on its x, B, C and the dt columns, then
    :func:`gated_rms_norm` of y gated by the z columns. Without ``norm_weight`` the state
    update gates ``y · silu(z)`` itself and there is no norm; with ``gate=False`` as well,
    y is the state update's output ungated (a caller that gates and norms it itself).
    Equal to those three ops on the split row; the ``triton`` backend runs their kernels
    on the packed rows, without copying the column slices first.

    With ``d_inner = H P`` and ``conv_dim = d_inner + 2 G N``, row ``r`` of ``zxbcdt`` is
    ``z[d_inner] | x[d_inner] | B[G N] | C[G N] | dt[H]``; G comes from the conv width.
    Rows whose slot is ``-1`` (or outside ``[0, S)``) read and write nothing and give 0.
    The SSM's decay rates come as the mixer holds them, ``A_log`` (``A = -exp(A_log)``):
    the triton backend takes the exponential in the state update's kernel rather than
    launching one more kernel for it every step.

    Args:
      zxbcdt: zxbcdt[Bd, 2 d_inner + 2 G N + H], in_proj's output.
      conv_state_cache: conv_state_cache[S, K-1, conv_dim], updated functionally.
      conv_weight: conv_weight[conv_dim, K].
      conv_bias: conv_bias[conv_dim] or None.
      ssm_state_cache: ssm_state_cache[S, H, P, N], fp32 or bf16, updated functionally.
      A_log: A_log[H], the state's decay rates as ``A = -exp(A_log)``.
      slot_ids: int32[Bd], the cache slot of each row (both caches).
      D, dt_bias, dt_softplus, dt_limit: as :func:`selective_state_update`.
      norm_weight: norm_weight[d_inner], or None for no norm (z gates the state update).
      norm_group_size: channels per norm group; ``d_inner / G`` when None.
      norm_eps, norm_before_gate: as :func:`gated_rms_norm`.
      gate: without ``norm_weight``, whether the state update gates y by ``silu(z)``
        (ignored with a norm, which always reads z). ``False`` serves a norm whose group
        spans several devices: its caller completes gate and norm in one XLA fusion, and
        the ungated state update keeps its faster tiling.
      validate: check ``slot_ids`` on the host.
      implementation: "auto" | "xla" | "triton", or a sequence of backend names to take the
        first that serves the call (see ``pallas_kernels.backend``).
      config: the triton backend's block sizes (``mamba_decode.triton_config.BlockSizes``: the
        conv update's, the state update's and the norm's); None for their heuristics.

    Returns:
      ``(y[Bd, d_inner], new_conv_state_cache, new_ssm_state_cache)``, y in zxbcdt's dtype.
    """
    zxbcdt, conv_state_cache, conv_weight, ssm_state_cache, A_log = (
        jnp.asarray(a) for a in (zxbcdt, conv_state_cache, conv_weight, ssm_state_cache, A_log)
    )
    slot_ids = checks.slot_ids_array(slot_ids)
    conv_bias, D, dt_bias, norm_weight = (
        None if a is None else jnp.asarray(a) for a in (conv_bias, D, dt_bias, norm_weight)
    )
    mixer = check_packed_mixer(
        zxbcdt, conv_state_cache, conv_weight, conv_bias, ssm_state_cache, A_log,
        D=D, dt_bias=dt_bias, dt_limit=dt_limit, norm_weight=norm_weight,
        norm_group_size=norm_group_size, norm_eps=norm_eps, rows="Bd",
    )  # fmt: skip
    Bd, S, d_inner = zxbcdt.shape[0], mixer.num_slots, mixer.d_inner
    checked_slot_ids = checks.check_slot_ids(slot_ids, Bd, S, "[Bd]")
    if validate:
        checks.validate_slot_ids(slot_ids, S)
    call = Call(
        (zxbcdt, conv_state_cache, conv_weight, conv_bias, ssm_state_cache, A_log),
        dict(
            num_groups=mixer.num_groups,
            slot_ids=checked_slot_ids,
            D=D,
            dt_bias=dt_bias,
            dt_softplus=bool(dt_softplus),
            dt_limit=mixer.dt_limit,
            norm_weight=norm_weight,
            norm_group_size=mixer.norm_group_size,
            norm_eps=float(norm_eps),
            norm_before_gate=bool(norm_before_gate),
            gate=bool(gate),
        ),
        empty=(
            (lambda: (zxbcdt[:, :d_inner], conv_state_cache, ssm_state_cache)) if Bd == 0 else None
        ),
    )
    return MAMBA2_DECODE.run(call, implementation, config)
