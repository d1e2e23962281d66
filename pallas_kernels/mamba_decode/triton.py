"""The Mamba2 decode step as three Pallas kernels lowered through Triton, each reading its
inputs where they lie in in_proj's packed ``z | xBC | dt`` rows and in the conv output
``x | B | C``: the conv update (``conv1d.triton``) reads the xBC columns, the state
update (``state_update.triton``) reads x, B and C from the conv output and dt (and, without
the norm, the gate z) from the packed rows, and the gated norm (``norm.triton``) reads z.
Composed from the ops' own kernels, so the step has their numerics; what it saves is the
five column slices XLA would otherwise copy into arrays of their own before the kernels
(one copy kernel each: about 0.15 ms of a one-row Bamba-9B step, 0.3 ms at 64 rows and
0.45 ms at 256, H200).

Differentiated (``jax.custom_vjp``), the backward is the three ops' own Pallas backward
kernels: the step recomposed from the public Triton ops on the sliced columns
(:func:`_unfused`, each op a ``custom_vjp`` of its own) and pulled back through them. It
recomputes the forward once, and its kernels update copies of both caches (the step's
input caches are residuals): about three SSM caches' worth of memory at the peak. Decode
steps are rarely differentiated, and the fused forward stays as it is. Block sizes and their
heuristic are in ``mamba_decode/triton_config.py``.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.backend import pallas_dtypes
from pallas_kernels.conv1d import triton as conv
from pallas_kernels.mamba_decode import reference
from pallas_kernels.mamba_decode.triton_config import BlockSizes
from pallas_kernels.norm import triton as norm
from pallas_kernels.state_update import triton as state_update


def _unfused(
    zxbcdt,
    conv_state_cache,
    conv_weight,
    conv_bias,
    ssm_state_cache,
    A_log,
    D,
    dt_bias,
    norm_weight,
    slot_ids,
    *,
    config: BlockSizes,
    interpret: bool,
    **options,
):
    """The step as the three public Triton ops on ``z``, ``xBC`` and ``dt`` sliced from the
    packed rows (the ``xla`` implementation's composition): what the backward pulls
    through, each op by its own Pallas backward kernel."""
    return reference.composed(
        zxbcdt,
        conv_state_cache,
        conv_weight,
        conv_bias,
        ssm_state_cache,
        A_log,
        conv_update=functools.partial(
            conv.causal_conv1d_update, config=config.conv, interpret=interpret
        ),
        state_update=functools.partial(
            state_update.selective_state_update, config=config.state_update, interpret=interpret
        ),
        gated_norm=functools.partial(norm.gated_rms_norm, config=config.norm, interpret=interpret),
        slot_ids=slot_ids,
        D=D,
        dt_bias=dt_bias,
        norm_weight=norm_weight,
        **options,
    )


@functools.cache
def _differentiable(**options):
    """The fused step, pulled back through :func:`_unfused`, for one set of static
    options."""

    @jax.custom_vjp
    def step(*args):
        *arrays, slot_ids = args
        return _fused(*arrays, slot_ids=slot_ids, **options)

    def forward(*args):
        return step(*args), args

    def backward_rule(residuals, cotangents):
        *arrays, slot_ids = residuals
        # The ops' kernels are built here, outside the op's dispatch: 32-bit dtypes.
        with pallas_dtypes():
            _, pullback = jax.vjp(lambda *a: _unfused(*a, slot_ids, **options), *arrays)
            return (*pullback(cotangents), None)

    step.defvjp(forward, backward_rule)
    return step


def mamba2_decode(
    zxbcdt: jax.Array,
    conv_state_cache: jax.Array,
    conv_weight: jax.Array,
    conv_bias: jax.Array | None,
    ssm_state_cache: jax.Array,
    A_log: jax.Array,
    *,
    num_groups: int,
    slot_ids: jax.Array,
    D: jax.Array | None,
    dt_bias: jax.Array | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    norm_weight: jax.Array | None,
    norm_group_size: int,
    norm_eps: float,
    norm_before_gate: bool,
    gate: bool,
    config: BlockSizes,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """See :func:`pallas_kernels.mamba2_decode`; arguments are already validated.
    Differentiable in every float input (the module docstring)."""
    step = _differentiable(
        num_groups=num_groups,
        dt_softplus=bool(dt_softplus),
        dt_limit=tuple(dt_limit),
        norm_group_size=norm_group_size,
        norm_eps=norm_eps,
        norm_before_gate=norm_before_gate,
        gate=gate,
        config=config,
        interpret=interpret,
    )
    return step(
        zxbcdt,
        conv_state_cache,
        conv_weight,
        conv_bias,
        ssm_state_cache,
        A_log,
        D,
        dt_bias,
        norm_weight,
        slot_ids,
    )


def _fused(
    zxbcdt: jax.Array,
    conv_state_cache: jax.Array,
    conv_weight: jax.Array,
    conv_bias: jax.Array | None,
    ssm_state_cache: jax.Array,
    A_log: jax.Array,
    D: jax.Array | None,
    dt_bias: jax.Array | None,
    norm_weight: jax.Array | None,
    *,
    num_groups: int,
    slot_ids: jax.Array,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    norm_group_size: int,
    norm_eps: float,
    norm_before_gate: bool,
    gate: bool,
    config: BlockSizes,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The step on the packed rows (the module docstring)."""
    rows = zxbcdt.shape[0]
    H, P, N = ssm_state_cache.shape[1:]
    d_inner, conv_dim = H * P, conv_weight.shape[0]
    xbc, conv_state_cache = conv.update_rows(
        zxbcdt[:, None, :],
        conv_state_cache,
        conv_weight,
        conv_bias,
        slot_ids=slot_ids,
        activation="silu",
        config=config.conv,
        x_col0=d_inner,
        interpret=interpret,
    )
    xbc = xbc.reshape(rows, conv_dim)  # drops the unit token axis: a bitcast
    gate_in_state_update = norm_weight is None and gate
    y, ssm_state_cache = state_update.state_update_rows(
        ssm_state_cache,
        xbc,
        zxbcdt,
        A_log,
        xbc,
        xbc,
        z=zxbcdt if gate_in_state_update else None,
        columns=state_update.Columns(
            x=0, dt=d_inner + conv_dim, B=d_inner, C=d_inner + num_groups * N, z=0
        ),
        num_groups=num_groups,
        slot_ids=slot_ids,
        D=D,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
        config=config.state_update,
        A_is_log=True,
        interpret=interpret,
    )
    y = y.reshape(rows, d_inner)
    if norm_weight is not None:
        y = norm.forward(
            y,
            zxbcdt,
            norm_weight,
            group_size=norm_group_size,
            eps=norm_eps,
            norm_before_gate=norm_before_gate,
            config=config.norm,
            interpret=interpret,
        )
    return y, conv_state_cache, ssm_state_cache
