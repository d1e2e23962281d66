"""``ssd_scan``: validation and dispatch for the chunk-aligned SSD scan."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _validation as checks
from pallas_kernels.backend import Backend, Call, Implementation, Op
from pallas_kernels.metadata import ChunkMetadata, max_chunks_for
from pallas_kernels.slots import gather_states, live_rows, write_final_states
from pallas_kernels.ssd import mosaic, mosaic_config, reference, triton, triton_config

SSD_SCAN = Op(
    "ssd_scan",
    (
        Backend(
            "mosaic",
            mosaic.ssd_scan,
            config_type=mosaic_config.BlockSizes,
            default_config=lambda *_, **__: mosaic_config.BlockSizes(),
            supports=mosaic_config.supports,
            check_config=lambda config, x, dt, A, B, C, *, chunk_size, **__: (
                mosaic_config.check_block_sizes(
                    config,
                    heads_per_group=x.shape[1] // B.shape[1],
                    chunk_size=chunk_size,
                    state_dim=B.shape[2],
                    itemsize=x.dtype.itemsize,
                )
            ),
        ),
        Backend(
            "triton",
            triton.ssd_scan,
            config_type=triton_config.BlockSizes,
            default_config=lambda x, dt, A, B, C, *, chunk_size, **_: (
                triton_config.default_block_sizes(chunk_size, x.shape[2], B.shape[2])
            ),
        ),
        Backend("xla", reference.ssd_scan),
    ),
)


def ssd_scan(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    *,
    metadata: ChunkMetadata,
    chunk_size: int,
    D: jax.Array | None = None,
    z: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    initial_states: jax.Array | None = None,
    state_cache: jax.Array | None = None,
    slot_ids: jax.Array | None = None,
    has_initial_state: jax.Array | None = None,
    return_intermediate_states: bool = False,
    state_dtype: jnp.dtype = jnp.float32,
    validate: bool = False,
    implementation: Implementation = "auto",
    config: triton_config.BlockSizes | mosaic_config.BlockSizes | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Mamba2 SSD prefill over a packed, chunk-aligned variable-length batch.

    Per sequence, token by token (what the chunked implementations compute)::

        dt'_t = clamp(softplus(dt_t + dt_bias) if dt_softplus else dt_t + dt_bias, *dt_limit)
        s_t   = exp(dt'_t A) s_{t-1} + dt'_t x_t ⊗ B_t        s_{-1} = initial_states[b] or 0
        y_t   = C_t · s_t + D x_t,   then y_t *= silu(z_t) when z is given

    Head ``h`` uses group ``h // (H // G)``. Semantics of vLLM's chunk-aligned
    ``mamba_chunk_scan_combined_varlen``. Differentiable (``jax.grad``, ``jax.vjp``) in x,
    dt, A, B, C, D, z, dt_bias and initial_states with every implementation; the Triton
    backend through its own Pallas backward kernels (``ssd/triton_vjp.py``), whose dA
    and ddt assume ``dt' A <= 0`` (A < 0, dt' >= 0: every Mamba2 layer).

    Args:
      x: x[T, H, P] packed tokens (rows past ``query_start_loc[-1]`` give y = 0).
      dt: dt[T, H] time steps before bias/softplus.
      A: A[H] (negative) decay rates.
      B: B[T, G, N] input projections.
      C: C[T, G, N] output projections.
      metadata: chunk layout from ``chunk_metadata(..., chunk_size=chunk_size)``.
      chunk_size: the chunk size the metadata was built with.
      D: D[H] or D[H, P] skip connection.
      z: z[T, H, P] gate.
      dt_bias: dt_bias[H].
      dt_softplus: apply softplus to ``dt + dt_bias``.
      dt_limit: (lo, hi) clamp of the processed dt.
      initial_states: initial_states[B, H, P, N], each sequence's state before its new
        tokens (the cached state when ``num_computed_tokens > 0``); zeros when None.
      state_cache: state_cache[S, H, P, N], a slot-indexed state cache to continue from and
        write to, instead of ``initial_states``: sequence ``b`` starts from
        ``state_cache[slot_ids[b]]`` where ``has_initial_state[b]`` (else from 0), and its
        final state is written back to that slot in the cache's dtype. Slots not named,
        and those of sequences without new tokens, come back bit-identical; ids outside
        ``[0, S)`` are padding (nothing read or written).
      slot_ids: int32[B], each sequence's slot (with ``state_cache`` only).
      has_initial_state: bool[B], whether the slot holds the sequence's state so far (with
        ``state_cache`` only; False: a fresh prompt).
      return_intermediate_states: return the state after every chunk instead of the final
        state of every sequence (not with ``state_cache``).
      state_dtype: dtype of the returned states (accumulation is always fp32).
      validate: check the metadata's data on the host (needs concrete arrays).
      implementation: "auto" | "xla" | "triton" | "mosaic", or a sequence of backend names
        to take the first that serves the call (see ``pallas_kernels.backend``).
      config: the chosen backend's block sizes (``ssd.triton_config.BlockSizes`` or
        ``ssd.mosaic_config.BlockSizes``); default: the backend's heuristic.

    Returns:
      ``(y[T, H, P], states)`` with ``states`` of shape ``[B, H, P, N]`` (final; a sequence
      without new tokens keeps its initial state) or ``[max_chunks, H, P, N]`` (after each
      chunk; padding chunks give 0). ``y`` has ``x``'s dtype. With ``state_cache``:
      ``(y, new_state_cache[S, H, P, N])``.
    """
    x, dt, A, B, C = (jnp.asarray(a) for a in (x, dt, A, B, C))
    D, z, dt_bias, initial_states = (
        None if a is None else jnp.asarray(a) for a in (D, z, dt_bias, initial_states)
    )
    dt_limit = checks.check_ssm_inputs(
        x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_limit=dt_limit, rows="T"
    )
    T, H, P = x.shape
    N = B.shape[2]
    num_seqs = metadata.last_chunk_indices.shape[0]
    metadata = check_metadata(metadata, num_tokens=T, num_seqs=num_seqs, chunk_size=chunk_size)
    if initial_states is not None:
        checks.check_floating("initial_states", initial_states)
        checks.check_shape("initial_states", initial_states, (num_seqs, H, P, N), "[B, H, P, N]")
    state_dtype = jnp.dtype(state_dtype)
    if not jnp.issubdtype(state_dtype, jnp.floating):
        raise ValueError(f"state_dtype={state_dtype} must be a floating-point dtype")
    slots = None
    if state_cache is not None:
        if initial_states is not None or return_intermediate_states:
            raise ValueError(
                "state_cache replaces initial_states and returns the updated cache: pass "
                "neither initial_states nor return_intermediate_states=True with it"
            )
        if slot_ids is None or has_initial_state is None:
            raise ValueError("state_cache needs slot_ids[B] and has_initial_state[B]")
        state_cache, has_initial_state = jnp.asarray(state_cache), jnp.asarray(has_initial_state)
        num_slots = checks.check_state_cache(state_cache, H, P, N)
        checks.check_shape("has_initial_state", has_initial_state, (num_seqs,), "[B]")
        slot_ids = checks.slot_ids_array(slot_ids)
        slots = checks.check_slot_ids(slot_ids, num_seqs, num_slots, "[B]")
        if validate:
            checks.validate_slot_ids(slot_ids, num_slots)
        initial_states = gather_states(state_cache, slots, has_initial_state)
        state_dtype = state_cache.dtype
    elif slot_ids is not None or has_initial_state is not None:
        raise ValueError("slot_ids and has_initial_state go with state_cache")
    if validate:
        validate_metadata(metadata, num_tokens=T, chunk_size=chunk_size)

    def empty() -> tuple[jax.Array, jax.Array]:
        """No tokens: y is empty; final states are the initial ones, chunk states 0."""
        if return_intermediate_states or initial_states is None:
            rows = metadata.max_chunks if return_intermediate_states else num_seqs
            return x, jnp.zeros((rows, H, P, N), state_dtype)
        return x, initial_states.astype(state_dtype)

    call = Call(
        (x, dt, A, B, C),
        dict(
            metadata=metadata,
            chunk_size=chunk_size,
            D=D,
            z=z,
            dt_bias=dt_bias,
            dt_softplus=bool(dt_softplus),
            dt_limit=dt_limit,
            initial_states=initial_states,
            return_intermediate_states=bool(return_intermediate_states),
            state_dtype=state_dtype,
        ),
        empty=empty if T == 0 else None,
    )
    y, states = SSD_SCAN.run(call, implementation, config)
    if slots is None:
        return y, states
    new_cache = write_final_states(state_cache, states, metadata, slots)
    return _zero_padding_rows(y, metadata, slots), new_cache


def _zero_padding_rows(y: jax.Array, metadata: ChunkMetadata, slot_ids: jax.Array) -> jax.Array:
    """``y[T, H, P]`` with the rows of padding sequences (checked slot -1) set to 0: a
    sequence without a slot is padding, whatever its length."""
    live = live_rows(y.shape[0], metadata, slot_ids)
    return jnp.where(live[:, None, None], y, jnp.zeros((), y.dtype))


def check_metadata(
    metadata: ChunkMetadata, *, num_tokens: int, num_seqs: int, chunk_size: int
) -> ChunkMetadata:
    """Static checks: the metadata was built for this chunk size, with enough chunk slots.
    Returns it with ``chunk_size`` recorded (metadata built by hand has none)."""
    chunk_size = checks.check_int("chunk_size", chunk_size, low=1)
    if metadata.chunk_size is None:
        metadata = dataclasses.replace(metadata, chunk_size=chunk_size)
    if metadata.chunk_size != chunk_size:
        raise ValueError(
            f"metadata was built with chunk_size={metadata.chunk_size}, "
            f"but ssd_scan got {chunk_size=}"
        )
    max_chunks = metadata.max_chunks
    checks.check_shape(
        "metadata.cu_chunk_seqlens",
        metadata.cu_chunk_seqlens,
        (max_chunks + 1,),
        "[max_chunks + 1]",
    )
    needed = max_chunks_for(num_tokens, max(num_seqs, 1), chunk_size)
    if max_chunks < needed:
        raise ValueError(
            f"metadata.max_chunks={max_chunks} is below max_chunks_for(T={num_tokens}, "
            f"B={num_seqs}, {chunk_size=}) = {needed}: some layouts of this bucket would lose "
            "chunks"
        )
    return metadata


def validate_metadata(metadata: ChunkMetadata, *, num_tokens: int, chunk_size: int) -> None:
    """Host-side consistency checks of a ``ChunkMetadata``."""
    cu = checks.host_values("metadata.cu_chunk_seqlens", metadata.cu_chunk_seqlens)
    seq = checks.host_values("metadata.seq_idx", metadata.seq_idx)
    num_chunks = int(checks.host_values("metadata.num_chunks", metadata.num_chunks))
    if not 0 <= num_chunks <= metadata.max_chunks:
        raise ValueError(f"metadata.num_chunks={num_chunks} not in [0, {metadata.max_chunks}]")
    lengths = np.diff(cu)
    if cu[0] != 0 or np.any(lengths < 0) or cu[-1] > num_tokens:
        raise ValueError(f"metadata.cu_chunk_seqlens is not a valid layout: {cu.tolist()}")
    if np.any(lengths > chunk_size):
        raise ValueError(f"a chunk is longer than {chunk_size=}: {lengths.tolist()}")
    if np.any(seq[:num_chunks] < 0) or np.any(seq[num_chunks:] != -1):
        raise ValueError(f"metadata.seq_idx must be >= 0 for real chunks, -1 after: {seq.tolist()}")
    if np.any(np.diff(seq[:num_chunks]) < 0):
        raise ValueError(f"metadata.seq_idx must be non-decreasing: {seq.tolist()}")
