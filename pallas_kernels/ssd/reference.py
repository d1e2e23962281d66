"""Pure ``jax.numpy`` chunk-aligned SSD scan: the ``xla`` implementation.

The state space duality (SSD) form of Mamba2 (Dao & Gu, arXiv 2405.21060, section 6 and
Listing 1), over the chunk-aligned varlen layout of ``pallas_kernels.metadata``:

1. dt processing and the within-chunk cumulative decay ``dA_cumsum``;
2. the diagonal block: ``y_diag = (C Bᵀ ∘ L) (dt x)``, with ``L[i, j] = exp(cum_i − cum_j)``
   for ``i ≥ j``;
3. each chunk's own state from a zero start: ``Σ_j exp(cum_last − cum_j) dt_j x_j ⊗ B_j``;
4. state passing along each sequence's chunks, starting from ``initial_states``;
5. the off-diagonal part ``y_off = exp(cum_i) C_i · state_before_chunk``, the D skip and the
   z gate.

Chunks are gathered from the packed tokens with masks (a short chunk is padded here, in
registers of the reference only, never in the caller's memory) and scattered back.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import decay_factor, matmul_precision, process_dt, silu
from pallas_kernels.metadata import ChunkMetadata


def ssd_scan(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    *,
    metadata: ChunkMetadata,
    chunk_size: int,
    D: jax.Array | None,
    z: jax.Array | None,
    dt_bias: jax.Array | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    initial_states: jax.Array | None,
    return_intermediate_states: bool,
    state_dtype: jnp.dtype,
) -> tuple[jax.Array, jax.Array]:
    """See :func:`pallas_kernels.ssd_scan`; arguments are already validated."""
    f32 = jnp.float32
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_dim = B.shape[1:]
    heads_per_group = num_heads // num_groups
    num_seqs = metadata.last_chunk_indices.shape[0]
    cs = chunk_size
    precision = matmul_precision(x.dtype)

    # 0) Chunk rows: rows past a chunk's end are masked (dt' = 0 there).
    starts = metadata.cu_chunk_seqlens[:-1]
    ends = metadata.cu_chunk_seqlens[1:]
    pos = starts[:, None] + jnp.arange(cs)[None, :]  # [nc, cs]
    valid = pos < ends[:, None]
    rows = jnp.where(valid, pos, 0)

    # 1) dt' and the within-chunk cumulative decay (small: [nc, cs, H]).
    dtc = process_dt(dt[rows].astype(f32), dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit)
    dtc = jnp.where(valid[..., None], dtc, 0.0)
    cum = jnp.cumsum(dtc * A.astype(f32), axis=1)
    # The chunk total is cum at the chunk's last row, copied to the masked rows after it:
    # a parallel scan may round cum[-1] differently, which large |A dt| turns into a
    # scaled contribution of the last token through exp(cum_last - cum_j).
    last_row = jnp.maximum(ends - starts - 1, 0)[:, None, None]
    cum_last = jnp.take_along_axis(cum, last_row, axis=1)[:, 0, :]  # [nc, H]
    cum = jnp.where(valid[..., None], cum, cum_last[:, None, :])

    # One scan along the chunks does all per-chunk work: memory stays bounded by one
    # chunk's [H, cs, cs] decay tiles whatever the number of chunks in the bucket, and the
    # loop carries only what the caller gets back (XLA gives every loop carry a buffer of
    # its own for the whole program, so a stacked per-chunk output would stay allocated
    # through every later layer of a model).
    def grouped(a):  # [cs, H, ...] -> [cs, G, R, ...]
        return a.reshape(cs, num_groups, heads_per_group, *a.shape[2:])

    causal = jnp.tril(jnp.ones((cs, cs), dtype=bool))

    def own_state(xc, Bc, dt_c, cum_c, cum_last_c):
        """3) The chunk's state from a zero start: Σ_j exp(cum_last − cum_j) dt_j x_j ⊗ B_j."""
        weight = decay_factor(cum_last_c[None, :] - cum_c) * dt_c  # [cs, H]
        xw = grouped(xc * weight[..., None])  # [cs, G, R, P]
        state = jnp.einsum("sgn,sgrp->grpn", Bc, xw, precision=precision)
        return state.reshape(num_heads, head_dim, state_dim)

    def output(rows_c, xc, Bc, Cc, dt_c, cum_c, before):
        """2) + 5) The causal block C·Bᵀ ∘ decay · dt x, the carried state's part
        exp(cum_i) C_i · state, the D skip and the z gate."""
        # Exponents are clamped to <= 0 (no overflow off the causal band).
        segsum = jnp.minimum(cum_c.T[:, :, None] - cum_c.T[:, None, :], 0.0)  # [H, l, s]
        decay = jnp.exp(segsum) * dt_c.T[:, None, :]
        cb = jnp.einsum("lgn,sgn->gls", Cc, Bc, precision=precision)
        decay = decay.reshape(num_groups, heads_per_group, cs, cs)
        # The causal mask selects: 0 · NaN would carry a later row's NaN dt or B back.
        weights = jnp.where(causal, decay * cb[:, None], 0.0)
        # Inside the matmul over columns, 0 · NaN is NaN as well: non-finite x enters it as
        # 0 and marks the rows at or after it in the chunk (the rows that see it) NaN.
        finite = jnp.isfinite(xc)
        y = jnp.einsum(
            "grls,sgrp->lgrp", weights, grouped(jnp.where(finite, xc, 0.0)), precision=precision
        )
        seen = jnp.cumsum(~finite, axis=0, dtype=jnp.int32) > 0  # [cs, H, P]
        y = jnp.where(grouped(seen), jnp.nan, y)
        before_g = before.reshape(num_groups, heads_per_group, head_dim, state_dim)
        carried = jnp.einsum("lgn,grpn->lgrp", Cc, before_g, precision=precision)
        y = y + carried * grouped(decay_factor(cum_c))[..., None]
        y = y.reshape(cs, num_heads, head_dim)
        if D is not None:
            y = y + D.astype(f32).reshape(num_heads, -1) * xc
        if z is not None:
            y = y * silu(z[rows_c].astype(f32))
        return y.astype(x.dtype)

    # 4) State passing along each sequence's chunks (never across sequences).
    seq = metadata.seq_idx
    live = seq >= 0
    is_first = jnp.concatenate([jnp.ones((1,), bool), seq[1:] != seq[:-1]])
    chunk = jnp.arange(seq.shape[0])
    is_last = live & (metadata.last_chunk_indices[jnp.maximum(seq, 0)] == chunk)
    if initial_states is None:
        initial_states = jnp.zeros((num_seqs, num_heads, head_dim, state_dim), f32)
    initial_states = initial_states.astype(f32)
    chunk_decay = decay_factor(cum_last)  # [nc, H]

    def chunk_step(carry, chunk):
        state, y_tokens, finals = carry
        rows_c, valid_c, start_c, dt_c, cum_c, cum_last_c, decay_c, first, seq_c, last = chunk
        b = jnp.maximum(seq_c, 0)
        # Rows past the chunk's end read row 0 (another chunk's token, maybe another
        # sequence's): zeroed, so nothing in it (NaN included) reaches this chunk.
        keep = valid_c[:, None, None]
        xc = jnp.where(keep, x[rows_c], 0).astype(f32)  # [cs, H, P]
        Bc = jnp.where(keep, B[rows_c], 0).astype(f32)  # [cs, G, N]
        Cc = jnp.where(keep, C[rows_c], 0).astype(f32)
        before = jnp.where(first, initial_states[b], state)
        after = decay_c[:, None, None] * before + own_state(xc, Bc, dt_c, cum_c, cum_last_c)
        # The chunk's rows are contiguous: rows past its end keep what is there.
        y_c = output(rows_c, xc, Bc, Cc, dt_c, cum_c, before)
        old = jax.lax.dynamic_slice_in_dim(y_tokens, start_c, cs)
        y_c = jnp.where(valid_c[:, None, None], y_c, old)
        y_tokens = jax.lax.dynamic_update_slice_in_dim(y_tokens, y_c, start_c, 0)
        final_b = jnp.where(last, after, finals[b])
        finals = jax.lax.dynamic_update_index_in_dim(finals, final_b, b, 0)
        out = jnp.where(seq_c >= 0, after, 0.0) if return_intermediate_states else None
        return (after, y_tokens, finals), out

    # cs spare rows at the end keep every chunk's slice in bounds (no clamping).
    y_tokens = jnp.zeros((num_tokens + cs, num_heads, head_dim), x.dtype)
    (_, y_tokens, finals), intermediate = jax.lax.scan(
        chunk_step,
        (jnp.zeros((num_heads, head_dim, state_dim), f32), y_tokens, initial_states),
        (rows, valid, starts, dtc, cum, cum_last, chunk_decay, is_first, seq, is_last),
    )
    states = intermediate if return_intermediate_states else finals
    return y_tokens[:num_tokens], states.astype(state_dtype)
