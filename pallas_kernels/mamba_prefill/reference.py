"""Pure ``jax.numpy`` Mamba2 prefill: the ``xla`` implementation of ``mamba2_prefill``, the
three ops' references on the split ``z | xBC | dt`` rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.conv1d import reference as conv
from pallas_kernels.metadata import ChunkMetadata
from pallas_kernels.norm import reference as norm
from pallas_kernels.slots import gather_states, live_rows, write_final_states
from pallas_kernels.ssd import reference as ssd


def scan_with_cache(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    ssm_state_cache: jax.Array,
    *,
    scan,
    metadata: ChunkMetadata,
    slot_ids: jax.Array,
    has_initial_state: jax.Array,
    **options,
) -> tuple[jax.Array, jax.Array]:
    """``scan`` (an ``ssd_scan`` backend's signature) continuing from and writing back to
    ``ssm_state_cache`` as ``ssd_scan(state_cache=...)`` does, but for the padding rows:
    returns ``(y[T, H, P], new_ssm_state_cache)`` with the rows of padding sequences as the
    scan computed them (the caller selects them away)."""
    y, states = scan(
        x,
        dt,
        A,
        B,
        C,
        metadata=metadata,
        initial_states=gather_states(ssm_state_cache, slot_ids, has_initial_state),
        return_intermediate_states=False,
        state_dtype=ssm_state_cache.dtype,
        **options,
    )
    return y, write_final_states(ssm_state_cache, states, metadata, slot_ids)


def mamba2_prefill(
    zxbcdt: jax.Array,
    conv_state_cache: jax.Array,
    conv_weight: jax.Array,
    conv_bias: jax.Array | None,
    ssm_state_cache: jax.Array,
    A: jax.Array,
    *,
    query_start_loc: jax.Array,
    metadata: ChunkMetadata,
    chunk_size: int,
    num_groups: int,
    slot_ids: jax.Array,
    has_initial_state: jax.Array,
    D: jax.Array | None,
    dt_bias: jax.Array | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    norm_weight: jax.Array | None,
    norm_group_size: int,
    norm_eps: float,
    norm_before_gate: bool,
    gate: bool,
    ssd_implementation,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """See :func:`pallas_kernels.mamba2_prefill`; arguments are already validated."""
    del ssd_implementation  # the reference scan
    T = zxbcdt.shape[0]
    H, P, N = ssm_state_cache.shape[1:]
    d_inner, conv_dim, gn = H * P, conv_weight.shape[0], num_groups * N
    z, xbc, dt = jnp.split(zxbcdt, [d_inner, d_inner + conv_dim], axis=-1)
    xbc, conv_state_cache = conv.causal_conv1d(
        xbc,
        conv_weight,
        conv_bias,
        query_start_loc=query_start_loc,
        conv_state_cache=conv_state_cache,
        slot_ids=slot_ids,
        has_initial_state=has_initial_state,
        activation="silu",
    )
    y, ssm_state_cache = scan_with_cache(
        xbc[:, :d_inner].reshape(T, H, P),
        dt,
        A,
        xbc[:, d_inner : d_inner + gn].reshape(T, num_groups, N),
        xbc[:, d_inner + gn :].reshape(T, num_groups, N),
        ssm_state_cache,
        scan=ssd.ssd_scan,
        metadata=metadata,
        slot_ids=slot_ids,
        has_initial_state=has_initial_state,
        chunk_size=chunk_size,
        D=D,
        z=z.reshape(T, H, P) if norm_weight is None and gate else None,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=dt_limit,
    )
    live = live_rows(T, metadata, slot_ids)[:, None]
    y = jnp.where(live, y.reshape(T, d_inner), jnp.zeros((), y.dtype))
    if norm_weight is not None:
        y = norm.gated_rms_norm(
            y,
            z,
            norm_weight,
            group_size=norm_group_size,
            eps=norm_eps,
            norm_before_gate=norm_before_gate,
        )
        # Padding rows give 0 whatever their z holds (a select after the norm as well).
        y = jnp.where(live, y, jnp.zeros((), y.dtype))
    return y, conv_state_cache, ssm_state_cache
