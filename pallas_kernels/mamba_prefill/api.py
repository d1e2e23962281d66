"""``mamba2_prefill``: validation and dispatch for the Mamba2 mixer's prefill step."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import _validation as checks
from pallas_kernels._mamba_mixer import check_packed_mixer
from pallas_kernels.backend import Backend, Call, Implementation, Op
from pallas_kernels.mamba_prefill import reference, triton, triton_config
from pallas_kernels.metadata import ChunkMetadata
from pallas_kernels.ssd.api import check_metadata, validate_metadata

MAMBA2_PREFILL = Op(
    "mamba2_prefill",
    (
        Backend(
            "triton",
            triton.mamba2_prefill,
            config_type=triton_config.BlockSizes,
            default_config=lambda _, __, conv_weight, ___, ssm_state, *____, **options: (
                triton_config.default_block_sizes(
                    conv_weight, ssm_state.shape[1] * ssm_state.shape[2], options["norm_group_size"]
                )
            ),
            check_config=lambda config, _, __, conv_weight, ___, ssm_state, *____, **_____: (
                triton_config.check_block_sizes(
                    config,
                    width=conv_weight.shape[1],
                    d_inner=ssm_state.shape[1] * ssm_state.shape[2],
                )
            ),
        ),
        Backend("xla", reference.mamba2_prefill),
    ),
)


def mamba2_prefill(
    zxbcdt: jax.Array,
    conv_state_cache: jax.Array,
    conv_weight: jax.Array,
    conv_bias: jax.Array | None,
    ssm_state_cache: jax.Array,
    A_log: jax.Array,
    *,
    query_start_loc: jax.Array,
    metadata: ChunkMetadata,
    chunk_size: int,
    slot_ids: jax.Array,
    has_initial_state: jax.Array,
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
    """Packed prefill sequences through a Mamba2 mixer, from in_proj's output to the input
    of out_proj: :func:`causal_conv1d` (SiLU) on the xBC columns, :func:`ssd_scan` on its
    x, B, C and the dt columns continuing from and writing back to the state cache, then
    :func:`gated_rms_norm` of y gated by the z columns. Without ``norm_weight`` the scan
    gates ``y · silu(z)`` itself and there is no norm; with ``gate=False`` as well, y is
    the scan's output ungated. Equal to those three ops on the split rows; the ``triton``
    backend runs their kernels on the packed rows, without copying the column slices
    first (its scan takes whichever backend of ``ssd_scan`` ``implementation`` picks there:
    Mosaic GPU under ``auto`` on a Hopper GPU).

    With ``d_inner = H P`` and ``conv_dim = d_inner + 2 G N``, row ``t`` of ``zxbcdt`` is
    ``z[d_inner] | x[d_inner] | B[G N] | C[G N] | dt[H]``; G comes from the conv width.
    Rows of padding sequences (slot ``-1``, or outside ``[0, S)``) and rows past
    ``query_start_loc[-1]`` give 0 whatever they hold; padding sequences read and write no
    cache line. The decay rates come as the mixer holds them, ``A_log`` (``A =
    -exp(A_log)``), as :func:`mamba2_decode` takes them. Differentiable in the arrays (not
    the layout arguments).

    Args:
      zxbcdt: zxbcdt[T, 2 d_inner + 2 G N + H], in_proj's output.
      conv_state_cache: conv_state_cache[S, K-1, conv_dim], updated functionally.
      conv_weight: conv_weight[conv_dim, K].
      conv_bias: conv_bias[conv_dim] or None.
      ssm_state_cache: ssm_state_cache[S, H, P, N], fp32 or bf16, updated functionally.
      A_log: A_log[H], the state's decay rates as ``A = -exp(A_log)``.
      query_start_loc: int32[B + 1], as :func:`causal_conv1d`.
      metadata, chunk_size: the chunk layout, as :func:`ssd_scan`.
      slot_ids: int32[B], each sequence's slot in both caches (-1: padding).
      has_initial_state: bool[B]; False starts from zero states (a fresh prompt).
      D, dt_bias, dt_softplus, dt_limit: as :func:`ssd_scan`.
      norm_weight: norm_weight[d_inner], or None for no norm (z gates the scan).
      norm_group_size: channels per norm group; ``d_inner / G`` when None.
      norm_eps, norm_before_gate: as :func:`gated_rms_norm`.
      gate: without ``norm_weight``, whether the scan gates y by ``silu(z)`` (ignored with
        a norm, which always reads z). ``False`` serves a norm whose group spans several
        devices: its caller completes gate and norm in one XLA fusion, and z is not
        copied out of the packed rows for the scan.
      validate: check ``query_start_loc``, ``slot_ids`` and the metadata on the host.
      implementation: "auto" | "xla" | "triton", or a sequence of backend names to take the
        first that serves the call (see ``pallas_kernels.backend``); the ``triton``
        backend's scan takes it too, so ``("mosaic", "triton")`` runs the Mosaic scan.
      config: the triton backend's block sizes (``mamba_prefill.triton_config.BlockSizes``: the
        conv's and the norm's); None for their heuristics.

    Returns:
      ``(y[T, d_inner], new_conv_state_cache, new_ssm_state_cache)``, y in zxbcdt's dtype.
    """
    zxbcdt, conv_state_cache, conv_weight, ssm_state_cache, A_log = (
        jnp.asarray(a) for a in (zxbcdt, conv_state_cache, conv_weight, ssm_state_cache, A_log)
    )
    query_start_loc, has_initial_state = (
        jnp.asarray(a) for a in (query_start_loc, has_initial_state)
    )
    slot_ids = checks.slot_ids_array(slot_ids)
    conv_bias, D, dt_bias, norm_weight = (
        None if a is None else jnp.asarray(a) for a in (conv_bias, D, dt_bias, norm_weight)
    )
    mixer = check_packed_mixer(
        zxbcdt, conv_state_cache, conv_weight, conv_bias, ssm_state_cache, A_log,
        D=D, dt_bias=dt_bias, dt_limit=dt_limit, norm_weight=norm_weight,
        norm_group_size=norm_group_size, norm_eps=norm_eps, rows="T",
    )  # fmt: skip
    T, S, d_inner = zxbcdt.shape[0], mixer.num_slots, mixer.d_inner
    num_seqs = checks.check_sequences(query_start_loc, has_initial_state)
    metadata = check_metadata(metadata, num_tokens=T, num_seqs=num_seqs, chunk_size=chunk_size)
    checked_slot_ids = checks.check_slot_ids(slot_ids, num_seqs, S, "[B]")
    if validate:
        checks.validate_query_start_loc(query_start_loc, T)
        checks.validate_slot_ids(slot_ids, S)
        validate_metadata(metadata, num_tokens=T, chunk_size=chunk_size)
    # The backends take A: beside a prefill step's scan, one small XLA kernel for the
    # exponential costs nothing (a decode step's kernels take A_log themselves).
    A = -jnp.exp(A_log.astype(jnp.float32))
    call = Call(
        (zxbcdt, conv_state_cache, conv_weight, conv_bias, ssm_state_cache, A),
        dict(
            query_start_loc=query_start_loc.astype(jnp.int32),
            metadata=metadata,
            chunk_size=int(chunk_size),
            num_groups=mixer.num_groups,
            slot_ids=checked_slot_ids,
            has_initial_state=has_initial_state.astype(bool),
            D=D,
            dt_bias=dt_bias,
            dt_softplus=bool(dt_softplus),
            dt_limit=mixer.dt_limit,
            norm_weight=norm_weight,
            norm_group_size=mixer.norm_group_size,
            norm_eps=float(norm_eps),
            norm_before_gate=bool(norm_before_gate),
            gate=bool(gate),
            ssd_implementation=implementation,
        ),
        empty=(
            (lambda: (zxbcdt[:, :d_inner], conv_state_cache, ssm_state_cache)) if T == 0 else None
        ),
    )
    return MAMBA2_PREFILL.run(call, implementation, config)
