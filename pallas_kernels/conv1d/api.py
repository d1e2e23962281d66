"""``causal_conv1d`` and ``causal_conv1d_update``: validation and dispatch."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from pallas_kernels import _validation as checks
from pallas_kernels.backend import Backend, Call, Implementation, Op
from pallas_kernels.conv1d import reference, triton, triton_config

Activation = Literal["silu"] | None

CAUSAL_CONV1D = Op(
    "causal_conv1d",
    (
        Backend(
            "triton",
            triton.causal_conv1d,
            config_type=triton_config.BlockSizes,
            default_config=lambda x, weight, *_, **__: triton_config.default_block_sizes(
                x.shape[1], weight.shape[1]
            ),
            check_config=lambda config, x, weight, *_, **__: triton_config.check_block_sizes(
                config, weight.shape[1]
            ),
        ),
        Backend("xla", reference.causal_conv1d),
    ),
)
CAUSAL_CONV1D_UPDATE = Op(
    "causal_conv1d_update",
    (
        Backend(
            "triton",
            triton.causal_conv1d_update,
            config_type=triton_config.BlockSizes,
            default_config=lambda x, *_, **__: triton_config.default_update_block_sizes(
                x.shape[-1]
            ),
        ),
        Backend("xla", reference.causal_conv1d_update),
    ),
)


def check_weights_and_cache(
    weight: jax.Array, bias: jax.Array | None, conv_state_cache: jax.Array, dim: int
) -> int:
    """Checks ``weight[dim, K]``, ``bias[dim]`` and ``conv_state_cache[S, K-1, dim]``;
    returns S."""
    checks.check_floating("weight", weight)
    if weight.ndim != 2 or weight.shape[0] != dim or weight.shape[1] < 2:
        raise ValueError(f"weight must have shape [dim, K] = ({dim}, K>=2), got {weight.shape}")
    if bias is not None:
        checks.check_floating("bias", bias)
        checks.check_shape("bias", bias, (dim,), "[dim]")
    K = weight.shape[1]
    checks.check_floating("conv_state_cache", conv_state_cache)
    if conv_state_cache.ndim != 3:
        raise ValueError(
            f"conv_state_cache must have shape [S, K-1, dim], got {conv_state_cache.shape}"
        )
    S = conv_state_cache.shape[0]
    checks.check_shape("conv_state_cache", conv_state_cache, (S, K - 1, dim), "[S, K-1, dim]")
    return S


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    *,
    query_start_loc: jax.Array,
    conv_state_cache: jax.Array,
    slot_ids: jax.Array,
    has_initial_state: jax.Array,
    activation: Activation = "silu",
    validate: bool = False,
    implementation: Implementation = "auto",
    config: triton_config.BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv1d over a packed variable-length batch, with per-slot state.

    Example (K = 4): ``query_start_loc = [0, 5, 6, 6]`` holds a 5-token prefill, a 1-token
    decode row (``has_initial_state = True``: its 3 previous inputs come from its slot) and
    a padding sequence (length 0, ``slot_ids = -1``), in one call.

    Args:
      x: x[T, dim] packed tokens (rows past ``query_start_loc[-1]`` give 0).
      weight: weight[dim, K]; ``weight[:, K-1]`` multiplies the current token.
      bias: bias[dim].
      query_start_loc: int32[B + 1].
      conv_state_cache: conv_state_cache[S, K-1, dim], the last K-1 inputs of each slot,
        oldest first. Each sequence with new tokens writes its new state to its slot.
      slot_ids: int32[B], ``-1`` for padding sequences (zero output, nothing written).
      has_initial_state: bool[B]; False starts from zeros (a fresh prompt).
      activation: None or "silu".
      validate: check ``query_start_loc`` and ``slot_ids`` on the host.
      implementation: "auto" | "xla" | "triton" | "mosaic", or a sequence of backend names
        to take the first that serves the call (see ``pallas_kernels.backend``).
      config: the chosen backend's block sizes (``conv1d.triton_config.BlockSizes``).

    Returns:
      ``(y[T, dim], new_conv_state_cache[S, K-1, dim])``, ``y`` in ``x``'s dtype.
    """
    x, weight, query_start_loc, conv_state_cache, has_initial_state = (
        jnp.asarray(a) for a in (x, weight, query_start_loc, conv_state_cache, has_initial_state)
    )
    slot_ids = checks.slot_ids_array(slot_ids)
    bias = None if bias is None else jnp.asarray(bias)
    checks.check_floating("x", x)
    if x.ndim != 2:
        raise ValueError(f"x must have shape [T, dim], got {x.shape}")
    T, dim = x.shape
    S = check_weights_and_cache(weight, bias, conv_state_cache, dim)
    num_seqs = checks.check_sequences(query_start_loc, has_initial_state)
    checks.check_activation(activation)
    checked_slot_ids = checks.check_slot_ids(slot_ids, num_seqs, S, "[B]")
    if validate:
        checks.validate_query_start_loc(query_start_loc, T)
        checks.validate_slot_ids(slot_ids, S)
    call = Call(
        (x, weight, bias),
        dict(
            query_start_loc=query_start_loc.astype(jnp.int32),
            conv_state_cache=conv_state_cache,
            slot_ids=checked_slot_ids,
            has_initial_state=has_initial_state.astype(bool),
            activation=activation,
        ),
        empty=(lambda: (x, conv_state_cache)) if T == 0 else None,
    )
    return CAUSAL_CONV1D.run(call, implementation, config)


def causal_conv1d_update(
    x: jax.Array,
    conv_state_cache: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    *,
    slot_ids: jax.Array,
    activation: Activation = "silu",
    validate: bool = False,
    implementation: Implementation = "auto",
    config: triton_config.BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Decode conv step: each row advances its slot's conv state by ``L`` tokens.

    Args:
      x: x[Bd, dim] (one token per row) or x[Bd, L, dim] (``L`` tokens per row, e.g.
        speculative verification), processed in order.
      conv_state_cache: conv_state_cache[S, K-1, dim]; shifted by ``L`` columns per named
        slot, functionally (in place under buffer donation).
      weight: weight[dim, K].
      bias: bias[dim].
      slot_ids: int32[Bd], ``-1`` for padding rows (zero output, nothing written).
      activation: None or "silu".
      validate: check ``slot_ids`` on the host.
      implementation: "auto" | "xla" | "triton" | "mosaic", or a sequence of backend names
        to take the first that serves the call (see ``pallas_kernels.backend``).
      config: the chosen backend's block sizes (``conv1d.triton_config.BlockSizes``).

    Returns:
      ``(y, new_conv_state_cache)``, ``y`` with ``x``'s shape and dtype.
    """
    x, conv_state_cache, weight = (jnp.asarray(a) for a in (x, conv_state_cache, weight))
    slot_ids = checks.slot_ids_array(slot_ids)
    bias = None if bias is None else jnp.asarray(bias)
    checks.check_floating("x", x)
    if x.ndim not in (2, 3):
        raise ValueError(f"x must have shape [Bd, dim] or [Bd, L, dim], got {x.shape}")
    Bd, dim = x.shape[0], x.shape[-1]
    S = check_weights_and_cache(weight, bias, conv_state_cache, dim)
    checks.check_activation(activation)
    checked_slot_ids = checks.check_slot_ids(slot_ids, Bd, S, "[Bd]")
    if validate:
        checks.validate_slot_ids(slot_ids, S)
    steps = x if x.ndim == 3 else x[:, None, :]
    call = Call(
        (steps, conv_state_cache, weight, bias),
        dict(slot_ids=checked_slot_ids, activation=activation),
        # The op's own result (``finish`` does not apply to it): ``x``'s shape, not ``steps``'.
        empty=(lambda: (x, conv_state_cache)) if steps.shape[0] * steps.shape[1] == 0 else None,
        finish=None if x.ndim == 3 else (lambda out: (out[0][:, 0, :], out[1])),
    )
    return CAUSAL_CONV1D_UPDATE.run(call, implementation, config)
