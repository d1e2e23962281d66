"""``ssd_scan``: validation and dispatch for the chunk-aligned SSD scan."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _validation as checks
from pallas_kernels.backend import Implementation, dispatch
from pallas_kernels.metadata import ChunkMetadata
from pallas_kernels.ssd import reference, triton

# Backend name -> implementation; Pallas backends take ``interpret=`` as well.
IMPLEMENTATIONS: dict[str, Callable] = {"xla": reference.ssd_scan, "triton": triton.ssd_scan}


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
    return_intermediate_states: bool = False,
    state_dtype: jnp.dtype = jnp.float32,
    validate: bool = False,
    implementation: Implementation = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Mamba2 SSD prefill over a packed, chunk-aligned variable-length batch.

    Per sequence, token by token (what the chunked implementations compute)::

        dt'_t = clamp(softplus(dt_t + dt_bias) if dt_softplus else dt_t + dt_bias, *dt_limit)
        s_t   = exp(dt'_t A) s_{t-1} + dt'_t x_t ⊗ B_t        s_{-1} = initial_states[b] or 0
        y_t   = C_t · s_t + D x_t,   then y_t *= silu(z_t) when z is given

    Head ``h`` uses group ``h // (H // G)``. Semantics of vLLM's chunk-aligned
    ``mamba_chunk_scan_combined_varlen``.

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
      return_intermediate_states: return the state after every chunk instead of the final
        state of every sequence.
      state_dtype: dtype of the returned states (accumulation is always fp32).
      validate: check the metadata's data on the host (needs concrete arrays).
      implementation: "auto" | "xla" | "triton" | "mosaic".

    Returns:
      ``(y[T, H, P], states)`` with ``states`` of shape ``[B, H, P, N]`` (final; a sequence
      without new tokens keeps its initial state) or ``[max_chunks, H, P, N]`` (after each
      chunk; padding chunks give 0). ``y`` has ``x``'s dtype.
    """
    x, dt, A, B, C = (jnp.asarray(a) for a in (x, dt, A, B, C))
    D, z, dt_bias, initial_states = (
        None if a is None else jnp.asarray(a) for a in (D, z, dt_bias, initial_states)
    )
    for name, a in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)):
        checks.check_floating(name, a)
    if x.ndim != 3:
        raise ValueError(f"x must have shape [T, H, P], got {x.shape}")
    T, H, P = x.shape
    if B.ndim != 3:
        raise ValueError(f"B must have shape [T, G, N], got {B.shape}")
    G, N = B.shape[1:]
    if G < 1 or H % G:
        raise ValueError(f"number of groups G={G} (B.shape[1]) must divide H={H}")
    checks.check_shape("dt", dt, (T, H), "[T, H]")
    checks.check_shape("A", A, (H,), "[H]")
    checks.check_shape("B", B, (T, G, N), "[T, G, N]")
    checks.check_shape("C", C, (T, G, N), "[T, G, N]")
    num_seqs = metadata.last_chunk_indices.shape[0]
    max_chunks = metadata.max_chunks
    checks.check_shape(
        "metadata.cu_chunk_seqlens",
        metadata.cu_chunk_seqlens,
        (max_chunks + 1,),
        "[max_chunks + 1]",
    )
    if chunk_size < 1:
        raise ValueError(f"{chunk_size=} must be >= 1")
    if D is not None and D.shape not in ((H,), (H, P)):
        raise ValueError(f"D must have shape [H] = ({H},) or [H, P] = ({H}, {P}), got {D.shape}")
    if z is not None:
        checks.check_shape("z", z, (T, H, P), "[T, H, P]")
    if dt_bias is not None:
        checks.check_shape("dt_bias", dt_bias, (H,), "[H]")
    if initial_states is not None:
        checks.check_shape("initial_states", initial_states, (num_seqs, H, P, N), "[B, H, P, N]")
    lo, hi = (float(b) for b in dt_limit)
    if not lo <= hi:
        raise ValueError(f"dt_limit={dt_limit} must satisfy lo <= hi")
    if validate:
        _validate_metadata(metadata, num_tokens=T, chunk_size=chunk_size)

    return dispatch(
        IMPLEMENTATIONS,
        implementation,
        x,
        dt,
        A,
        B,
        C,
        op="ssd_scan",
        metadata=metadata,
        chunk_size=chunk_size,
        D=D,
        z=z,
        dt_bias=dt_bias,
        dt_softplus=dt_softplus,
        dt_limit=(lo, hi),
        initial_states=initial_states,
        return_intermediate_states=return_intermediate_states,
        state_dtype=jnp.dtype(state_dtype),
    )


def _validate_metadata(metadata: ChunkMetadata, *, num_tokens: int, chunk_size: int) -> None:
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
