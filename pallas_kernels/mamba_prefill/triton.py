"""The Mamba2 prefill on in_proj's packed ``z | xBC | dt`` rows, its conv and norm Pallas
kernels lowered through Triton and its SSD scan whichever backend of ``ssd_scan`` the
call's ``implementation`` names (Mosaic GPU where it serves, on a Hopper GPU under
``auto``):

- the conv (``conv1d.triton``) reads the xBC columns where they lie and writes its output
  as two arrays, x and ``B | C``, so x reaches the scan as ``[T, H, P]`` by a bitcast;
- the scan continues from and writes back to the state cache as ``ssd_scan`` does;
- the gated norm (``norm.triton``) reads z where it lies and gives 0 on the rows of
  padding sequences (without a norm, as in Falcon-H1's mixer, a select over y does).

Equal to the three ops on the split rows; what it saves are three column copies XLA makes
before Pallas kernels (in_proj's z and xBC, the conv output's x) and the pass that zeroes
the padding sequences' rows of y: each reads and writes about ``T × d_inner`` elements,
about 0.3 ms a layer at 32k tokens of Bamba-9B on an H200.

Differentiable (``jax.custom_vjp``): the backward recomputes the step through the three
ops' own differentiable Pallas kernels on the split rows and takes their VJPs, so the
gradients are those ops' (and only the inputs are kept for the backward pass). Block sizes
and their heuristic are in ``mamba_prefill/triton_config.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.backend import Call, pallas_dtypes
from pallas_kernels.conv1d import triton as conv
from pallas_kernels.mamba_prefill.reference import scan_with_cache
from pallas_kernels.mamba_prefill.triton_config import BlockSizes
from pallas_kernels.metadata import ChunkMetadata
from pallas_kernels.norm import triton as norm
from pallas_kernels.slots import live_rows
from pallas_kernels.ssd.api import SSD_SCAN


@dataclasses.dataclass(frozen=True)
class _Options:
    """The step's static arguments (hashable: one custom_vjp per set)."""

    chunk_size: int
    num_groups: int
    dt_softplus: bool
    dt_limit: tuple[float, float]
    norm_group_size: int
    norm_eps: float
    norm_before_gate: bool
    gate: bool
    ssd_implementation: str | tuple[str, ...]
    config: BlockSizes
    interpret: bool


class _Arrays(NamedTuple):
    """The step's array arguments (one pytree for ``jax.custom_vjp``)."""

    zxbcdt: jax.Array
    conv_state_cache: jax.Array
    conv_weight: jax.Array
    conv_bias: jax.Array | None
    ssm_state_cache: jax.Array
    A: jax.Array
    query_start_loc: jax.Array
    metadata: ChunkMetadata
    slot_ids: jax.Array
    has_initial_state: jax.Array
    D: jax.Array | None
    dt_bias: jax.Array | None
    norm_weight: jax.Array | None


# The layout arguments: integers, no cotangent.
_LAYOUT = ("query_start_loc", "metadata", "slot_ids", "has_initial_state")


def _step(arrays: _Arrays, options: _Options, *, fused: bool) -> tuple[jax.Array, ...]:
    """The prefill step: on the packed rows (``fused``), or through the three ops'
    differentiable kernels on the split rows (the backward's recomputation)."""
    zxbcdt, conv_state_cache, conv_weight, conv_bias, ssm_state_cache, A = arrays[:6]
    metadata, slot_ids, norm_weight = arrays.metadata, arrays.slot_ids, arrays.norm_weight
    T = zxbcdt.shape[0]
    H, P, N = ssm_state_cache.shape[1:]
    G = options.num_groups
    d_inner, conv_dim = H * P, conv_weight.shape[0]
    # Column slices are copies: the fused step takes only dt's (and z's for a scan that
    # gates, there being no norm).
    dt = zxbcdt[:, d_inner + conv_dim :]
    scan_gates = norm_weight is None and options.gate
    z = zxbcdt[:, :d_inner] if scan_gates or (norm_weight is not None and not fused) else None
    conv_options = dict(
        query_start_loc=arrays.query_start_loc,
        conv_state_cache=conv_state_cache,
        slot_ids=slot_ids,
        has_initial_state=arrays.has_initial_state,
        activation="silu",
        config=options.config.conv,
        interpret=options.interpret,
    )
    if fused:
        x, bc, conv_state_cache = conv.prefill(
            zxbcdt, conv_weight, conv_bias, x_col0=d_inner, split=d_inner, **conv_options
        )
    else:
        xbc = zxbcdt[:, d_inner : d_inner + conv_dim]
        xbc, conv_state_cache = conv.causal_conv1d(xbc, conv_weight, conv_bias, **conv_options)
        x, bc = xbc[:, :d_inner], xbc[:, d_inner:]

    def scan(*args, **kwargs):
        return SSD_SCAN.run(Call(args, kwargs), options.ssd_implementation)

    y, ssm_state_cache = scan_with_cache(
        x.reshape(T, H, P),
        dt,
        A,
        bc[:, : G * N].reshape(T, G, N),
        bc[:, G * N :].reshape(T, G, N),
        ssm_state_cache,
        scan=scan,
        metadata=metadata,
        slot_ids=slot_ids,
        has_initial_state=arrays.has_initial_state,
        chunk_size=options.chunk_size,
        D=arrays.D,
        z=z.reshape(T, H, P) if scan_gates else None,
        dt_bias=arrays.dt_bias,
        dt_softplus=options.dt_softplus,
        dt_limit=options.dt_limit,
    )
    y = y.reshape(T, d_inner)
    live = live_rows(T, metadata, slot_ids)
    zero = jnp.zeros((), y.dtype)
    if norm_weight is None:
        return jnp.where(live[:, None], y, zero), conv_state_cache, ssm_state_cache
    norm_options = dict(
        group_size=options.norm_group_size,
        eps=options.norm_eps,
        norm_before_gate=options.norm_before_gate,
        config=options.config.norm,
        interpret=options.interpret,
    )
    if fused:
        y = norm.forward(y, zxbcdt, norm_weight, live_rows=live, **norm_options)
    else:
        # Zeros into the norm too: its backward then never sees a padding row's values.
        y = norm.gated_rms_norm(jnp.where(live[:, None], y, zero), z, norm_weight, **norm_options)
        y = jnp.where(live[:, None], y, zero)
    return y, conv_state_cache, ssm_state_cache


@functools.cache
def _differentiable(options: _Options):
    """The step on the packed rows, its VJP that of the split rows' ops."""

    @jax.custom_vjp
    def step(arrays: _Arrays):
        return _step(arrays, options, fused=True)

    def forward_rule(arrays: _Arrays):
        return step(arrays), arrays

    def backward_rule(arrays: _Arrays, cotangents):
        layout = {name: getattr(arrays, name) for name in _LAYOUT}
        inputs = {k: v for k, v in arrays._asdict().items() if k not in layout}

        def split_step(inputs):
            return _step(_Arrays(**inputs, **layout), options, fused=False)

        with pallas_dtypes():
            _, vjp = jax.vjp(split_step, inputs)
            (grads,) = vjp(cotangents)
        return (_Arrays(**grads, **dict.fromkeys(_LAYOUT)),)

    step.defvjp(forward_rule, backward_rule)
    return step


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
    ssd_implementation: str | tuple[str, ...],
    config: BlockSizes,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """See :func:`pallas_kernels.mamba2_prefill`; arguments are already validated.
    ``ssd_implementation``: the call's ``implementation``, which picks the scan's backend."""
    options = _Options(
        chunk_size=chunk_size,
        num_groups=num_groups,
        dt_softplus=dt_softplus,
        dt_limit=tuple(dt_limit),
        norm_group_size=norm_group_size,
        norm_eps=norm_eps,
        norm_before_gate=norm_before_gate,
        gate=gate,
        ssd_implementation=(
            ssd_implementation if isinstance(ssd_implementation, str) else tuple(ssd_implementation)
        ),
        config=config,
        interpret=interpret,
    )
    return _differentiable(options)(
        _Arrays(
            zxbcdt,
            conv_state_cache,
            conv_weight,
            conv_bias,
            ssm_state_cache,
            A,
            query_start_loc,
            metadata,
            slot_ids,
            has_initial_state,
            D,
            dt_bias,
            norm_weight,
        )
    )
