"""Gradients of ``ssd_scan`` (DESIGN.md §8 "Gradients"): every implementation against
central finite differences of the float64 oracle (``testing.vjp_errors``) in x, dt, A, B, C,
D, z, dt_bias and initial_states, the Triton backend against the ``xla`` path's
``jax.grad``, and the Triton backend's gradient running its own Pallas backward kernels
(``ssd/triton_vjp.py``), never the reference.

Shapes are tiny (every Triton kernel runs in interpret mode on the CPU), but cover the
layout: 32-row chunks in 16-row tiles (full and diagonal column blocks, two state-scan
steps per chunk), P = 8 and N = 16 padded to 16-wide tiles, several sequences with bucket
rows past them, an empty sequence, continued prefixes whose first chunk is short, and
G = 2 groups of H = 4 heads."""

from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import chunk_metadata, max_chunks_for
from pallas_kernels.metadata import ChunkMetadata
from pallas_kernels.ssd import api as ssd_api
from pallas_kernels.ssd import mosaic as ssd_mosaic
from pallas_kernels.ssd import mosaic_config as ssd_mosaic_config
from pallas_kernels.ssd import triton as ssd_triton
from pallas_kernels.ssd import triton_config as ssd_config
from pallas_kernels.ssd import triton_vjp as ssd_vjp
from pallas_kernels.testing import assert_close, relative_error, ssd_oracle, vjp_errors
from tests.helpers import (
    as_f32,
    implementations,
    lower_for_cuda,
    normal,
    pallas_call_names,
    primitives_outside_kernels,
    query_start_loc,
    spec,
    tiled_implementations,
)

IMPLS = tiled_implementations(ssd_api.SSD_SCAN)
NAMES = ("dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias", "dinitial_states")
# Error against the float64 finite differences (Cauchy–Schwarz-normalised, see
# ``vjp_errors``): fp32 rounding of the kernels' sums is ~1e-7; a wrong term is O(1).
FD_TOL = 1e-5
# Triton gradients against the xla path's jax.grad, fp32 (relative Frobenius error).
XLA_TOL = 1e-5
# bf16 inputs: the kernels' dot operands are rounded to bf16 (as the forward's are), the
# xla path computes in fp32: per-element gradients agree to ~5e-3. dA and ddt_bias are sums
# over tokens of terms of both signs that cancel to a few percent of their magnitude with
# random cotangents (to 2-10% of Σ|ddt| on such data), which scales the same absolute
# error up: their summands (ddt) are checked at BF16_TOL, the sums at BF16_SUM_TOL.
BF16_TOL = 2e-2
BF16_SUM_TOL = 2e-1


def _bf16_tol(name: str) -> float:
    return BF16_SUM_TOL if name in ("dA", "ddt_bias") else BF16_TOL


CS, H, G, P, N = 32, 4, 2, 8, 16
# 16-row tiles: two row blocks and two state-scan steps per 32-row chunk.
CONFIG = ssd_config.BlockSizes(block_m=16, block_k=16, block_t=16, num_warps=4)
# A 37-token prompt (two chunks, the second short), an empty sequence, a continued prefix
# of 45 tokens (its 21 new ones start mid-chunk: a 19-row chunk, then 2 rows), a 9-token
# continuation of 3, and 5 bucket rows past them.
LENGTHS, COMPUTED, PAD_ROWS = (37, 0, 21, 9), (0, 4, 45, 3), 5
# dt' = clamp(softplus(dt + dt_bias), 0.2, 1.2): both ends clamp some tokens here.
DT_LIMIT = (0.2, 1.2)


def _inputs(seed: int, dtype=jnp.float32):
    """Primals ``(x, dt, A, B, C, D[H, P], z, dt_bias, initial_states)``, the metadata and
    the packed sequence starts."""
    rng = np.random.default_rng(seed)
    qsl = query_start_loc(LENGTHS)
    T = int(qsl[-1]) + PAD_ROWS
    B_ = len(LENGTHS)
    metadata = chunk_metadata(
        jnp.asarray(qsl),
        jnp.asarray(np.array(COMPUTED, np.int32)),
        chunk_size=CS,
        max_chunks=max_chunks_for(T, B_, CS),
    )
    primals = (
        normal(rng, (T, H, P), dtype),
        normal(rng, (T, H), dtype),
        -jnp.asarray(0.3 * np.exp(rng.normal(size=H)), jnp.float32),
        normal(rng, (T, G, N), dtype),
        normal(rng, (T, G, N), dtype),
        normal(rng, (H, P)),
        normal(rng, (T, H, P), dtype, scale=2.0),
        normal(rng, (H,), scale=0.5),
        normal(rng, (B_, H, P, N)),
    )
    return primals, metadata, qsl


def _scan(impl, metadata, *primals, **options):
    x, dt, A, B, C, D, z, dt_bias, initial_states = primals
    return pk.ssd_scan(
        x,
        dt,
        A,
        B,
        C,
        metadata=metadata,
        chunk_size=CS,
        D=D,
        z=z,
        dt_bias=dt_bias,
        initial_states=initial_states,
        implementation=impl,
        config=CONFIG if impl == "triton" else None,
        **options,
    )


def _grads(impl, metadata, primals, cotangents, live, **options):
    """The cotangents of the primals that are not None (``live`` marks them), jitted: one
    compilation of the interpreted kernels instead of one per eager call."""

    def grads(metadata, args, cotangents):
        def f(*args):
            it = iter(args)
            full = [next(it) if keep else None for keep in live]
            return _scan(impl, metadata, *full, **options)

        return jax.vjp(f, *args)[1](cotangents)

    args = [p for p, keep in zip(primals, live, strict=True) if keep]
    return jax.jit(grads)(metadata, args, cotangents)


def _chunk_ends(metadata: ChunkMetadata) -> np.ndarray:
    """Each real chunk's last packed row."""
    n = int(metadata.num_chunks)
    return np.asarray(metadata.cu_chunk_seqlens)[1 : n + 1] - 1


def _oracle(qsl, metadata, live, *, intermediate, **options):
    """The float64 oracle as a function of the live primals: ``(y, final states)`` or
    ``(y, states after every chunk slot)`` (padding chunks 0)."""

    def f(*args):
        it = iter(args)
        x, dt, A, B, C, D, z, dt_bias, init = (next(it) if keep else None for keep in live)
        y, final, tokens = ssd_oracle(
            x,
            dt,
            A,
            B,
            C,
            query_start_loc=qsl,
            D=D,
            z=z,
            dt_bias=dt_bias,
            initial_states=init,
            return_token_states=True,
            **options,
        )
        if not intermediate:
            return y, final
        chunks = np.zeros((metadata.max_chunks, *final.shape[1:]))
        ends = _chunk_ends(metadata)
        chunks[: len(ends)] = tokens[ends]
        return y, chunks

    return f


def _check(impl, primals, metadata, qsl, live, *, intermediate, seed, **options):
    """Every live primal's gradient against finite differences of the oracle; the Triton
    backend's also against the xla path's; rows past the sequences get exactly 0."""
    live_primals = [p for p, keep in zip(primals, live, strict=True) if keep]
    names = [n for n, keep in zip(NAMES, live, strict=True) if keep]
    rng = np.random.default_rng(seed)
    T = primals[0].shape[0]
    states_rows = metadata.max_chunks if intermediate else len(LENGTHS)
    cotangents = (
        normal(rng, (T, H, P), primals[0].dtype),
        normal(rng, (states_rows, H, P, N)),
    )
    options = dict(options, return_intermediate_states=intermediate)
    grads = _grads(impl, metadata, primals, cotangents, live, **options)
    for name, g, p in zip(names, grads, live_primals, strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype, name
    total = int(qsl[-1])
    for name in ("dx", "ddt", "dB", "dC", "dz"):
        if name in names:
            np.testing.assert_array_equal(as_f32(grads[names.index(name)])[total:], 0.0, name)

    del options["return_intermediate_states"]
    oracle = _oracle(qsl, metadata, live, intermediate=intermediate, **options)
    cotangent = tuple(as_f32(c) for c in cotangents)
    f32_grads = [as_f32(g) for g in grads]
    errors = vjp_errors(oracle, tuple(as_f32(p) for p in live_primals), cotangent, f32_grads)
    for i, name in enumerate(names):
        assert errors[i] <= FD_TOL, f"{name}: finite-difference error {errors[i]:.2e}"
    if impl != "xla":
        options = dict(options, return_intermediate_states=intermediate)
        xla = _grads("xla", metadata, primals, cotangents, live, **options)
        for name, g, ref in zip(names, grads, xla, strict=True):
            assert_close(as_f32(g), as_f32(ref), rtol=XLA_TOL, name=f"{name} vs xla")
    return grads, cotangents


@pytest.mark.parametrize("impl", IMPLS)
def test_ssd_gradients_every_input(impl):
    """All nine inputs (D[H, P], z, dt_bias, softplus and a clamping dt_limit, initial
    states), final states' cotangent."""
    primals, metadata, qsl = _inputs(0)
    dt = primals[1]
    grads, cotangents = _check(
        impl,
        primals,
        metadata,
        qsl,
        (True,) * 9,
        intermediate=False,
        seed=1,
        dt_softplus=True,
        dt_limit=DT_LIMIT,
    )
    # The limit is active on this data: some tokens of every sequence get ddt = 0.
    v = np.logaddexp(as_f32(dt) + as_f32(primals[7]), 0.0)
    clamped = (v < DT_LIMIT[0]) | (v > DT_LIMIT[1])
    assert clamped[: int(qsl[-1])].any() and (~clamped[: int(qsl[-1])]).any()
    np.testing.assert_array_equal(as_f32(grads[1])[clamped], 0.0)
    # The empty sequence's final state is its initial state: the cotangent passes as is.
    np.testing.assert_array_equal(as_f32(grads[8])[1], as_f32(cotangents[1])[1])


def test_ssd_gradient_at_the_dt_limit_splits_as_xla():
    """dt' exactly at a bound of dt_limit (no softplus): the clamp passes half the gradient
    there, as jax.grad of the xla path's jnp.clip does; beyond it none, inside all."""
    primals, metadata, _ = _inputs(6)
    dt = np.asarray(primals[1]).copy()
    dt[::3] = DT_LIMIT[0]  # a third of the tokens exactly at the lower bound
    dt[1::3] = np.clip(dt[1::3], DT_LIMIT[0] + 0.05, DT_LIMIT[1] - 0.05)
    primals = (primals[0], jnp.asarray(dt), *primals[2:7], None, primals[8])
    live = tuple(p is not None for p in primals)
    dy = normal(np.random.default_rng(7), primals[0].shape)
    cotangents = (dy, jnp.zeros_like(primals[8]))
    options = dict(dt_softplus=False, dt_limit=DT_LIMIT)
    got, want = (
        _grads(impl, metadata, primals, cotangents, live, **options)[1]
        for impl in ("triton", "xla")
    )
    assert relative_error(got, want) <= XLA_TOL
    assert np.any(as_f32(want)[::3] != 0.0)  # the tie passes a gradient (half of it)


@pytest.mark.parametrize("impl", IMPLS)
def test_ssd_gradients_ignore_nan_bucket_rows(impl):
    """NaN in the bucket rows past the sequences (x, dt, B, C, z there) changes no
    gradient: every one equals the clean inputs' bit for bit, the tail rows' are 0."""
    primals, metadata, qsl = _inputs(8)
    total = int(qsl[-1])

    def poisoned(a):
        return a.at[total:].set(jnp.nan)

    dirty = tuple(poisoned(p) if i in (0, 1, 3, 4, 6) else p for i, p in enumerate(primals))
    rng = np.random.default_rng(9)
    cotangents = (normal(rng, primals[0].shape), normal(rng, (len(LENGTHS), H, P, N)))
    options = dict(dt_softplus=True, dt_limit=DT_LIMIT)
    live = (True,) * 9
    clean = _grads(impl, metadata, primals, cotangents, live, **options)
    got = _grads(impl, metadata, dirty, cotangents, live, **options)
    for name, g, ref in zip(NAMES, got, clean, strict=True):
        np.testing.assert_array_equal(as_f32(g), as_f32(ref), err_msg=name)
    for i in (0, 1, 3, 4, 6):
        np.testing.assert_array_equal(as_f32(got[i])[total:], 0.0, err_msg=NAMES[i])


@pytest.mark.parametrize("impl", IMPLS)
def test_ssd_gradients_intermediate_states(impl):
    """Cotangents of the states after every chunk (padding chunks' are ignored); D[H], no
    z, no dt_bias."""
    primals, metadata, qsl = _inputs(2)
    primals = (*primals[:5], primals[5][:, 0], None, None, primals[8])
    live = tuple(p is not None for p in primals)
    grads, _ = _check(
        impl, primals, metadata, qsl, live, intermediate=True, seed=3, dt_softplus=True
    )
    # Nothing depends on the empty sequence's initial state when the chunk states return.
    np.testing.assert_array_equal(as_f32(grads[-1])[1], 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_ssd_gradients_through_the_state_cache(impl):
    """``state_cache=``: the gradient reaches x, dt, A, B, C, D, z, dt_bias of the call
    through the slot machinery (gathered initial states, the new cache's written slots, a
    padding sequence's zeroed rows)."""
    primals, metadata, qsl = _inputs(4)
    x, dt, A, B, C, D, z, dt_bias, _ = primals
    primals = (x, dt, A, B, C, D[:, 0], z, dt_bias)
    rng = np.random.default_rng(5)
    num_slots = 6
    cache = normal(rng, (num_slots, H, P, N))
    slots = np.array([2, 4, -1, 0], np.int32)  # the 21-token sequence is padding
    has_state = np.array([False, True, True, True])
    options = dict(dt_softplus=True, dt_limit=DT_LIMIT)

    def grads(impl):
        def f(*args):
            x, dt, A, B, C, D, z, dt_bias = args
            return pk.ssd_scan(
                x,
                dt,
                A,
                B,
                C,
                metadata=metadata,
                chunk_size=CS,
                D=D,
                z=z,
                dt_bias=dt_bias,
                state_cache=cache,
                slot_ids=slots,
                has_initial_state=has_state,
                implementation=impl,
                config=CONFIG if impl == "triton" else None,
                **options,
            )

        return jax.jit(lambda p, c: jax.vjp(f, *p)[1](c))(primals, cotangents)

    cotangents = (normal(rng, x.shape), normal(rng, cache.shape))
    got = grads(impl)
    # The padding sequence's rows and the bucket rows get exactly 0.
    dead = np.zeros(x.shape[0], bool)
    dead[qsl[2] : qsl[3]] = True
    dead[qsl[-1] :] = True
    for i in (0, 1, 6):
        np.testing.assert_array_equal(as_f32(got[i])[dead], 0.0)

    cache64 = as_f32(cache).astype(np.float64)
    init = np.where(
        (has_state & (slots >= 0))[:, None, None, None], cache64[np.maximum(slots, 0)], 0
    )

    def oracle(x, dt, A, B, C, D, z, dt_bias):
        y, final = ssd_oracle(
            x,
            dt,
            A,
            B,
            C,
            query_start_loc=qsl,
            D=D,
            z=z,
            dt_bias=dt_bias,
            initial_states=init,
            **options,
        )
        y[qsl[2] : qsl[3]] = 0.0
        new = cache64.copy()
        for b, slot in enumerate(slots):
            if slot >= 0 and LENGTHS[b] > 0:
                new[slot] = final[b]
        return y, new

    names = NAMES[:8]
    errors = vjp_errors(
        oracle,
        tuple(as_f32(p) for p in primals),
        tuple(as_f32(c) for c in cotangents),
        [as_f32(g) for g in got],
    )
    for i, name in enumerate(names):
        assert errors[i] <= FD_TOL, f"{name}: finite-difference error {errors[i]:.2e}"
    if impl != "xla":
        for name, g, ref in zip(names, got, grads("xla"), strict=True):
            assert_close(as_f32(g), as_f32(ref), rtol=XLA_TOL, name=f"{name} vs xla")


def test_ssd_triton_bf16_gradients():
    """bf16 inputs give gradients in the inputs' dtypes, within bf16 rounding of the xla
    path's fp32 gradients of the same (rounded) inputs."""
    primals, metadata, qsl = _inputs(6, jnp.bfloat16)
    live = (True,) * 9
    rng = np.random.default_rng(7)
    cotangents = (
        normal(rng, primals[0].shape, jnp.bfloat16),
        normal(rng, (len(LENGTHS), H, P, N)),
    )
    options = dict(dt_softplus=True, dt_limit=DT_LIMIT)
    grads = _grads("triton", metadata, primals, cotangents, live, **options)
    wide = tuple(None if p is None else p.astype(jnp.float32) for p in primals)
    ref = _grads(
        "xla", metadata, wide, (cotangents[0].astype(jnp.float32), cotangents[1]), live, **options
    )
    for name, g, p, r in zip(NAMES, grads, primals, ref, strict=True):
        assert g.dtype == p.dtype, name
        assert_close(as_f32(g), as_f32(r), rtol=_bf16_tol(name), name=name)


def test_internal_ssd_backward_head_splits_and_tiles_give_the_same_gradients():
    """chunk_dbc programs summing one head each (2 splits per group, partial dB and dC
    summed outside), or walking the chunk in 16-column ∂W tiles (the masked diagonal tile,
    the full tiles before it and those after it) instead of the default's one 32-column
    tile, give the sums of programs summing the whole group in one tile."""
    primals, metadata, _ = _inputs(10)
    x, _, _, B, C, _, z, _, _ = primals
    rng = np.random.default_rng(11)
    dy = normal(rng, x.shape)
    dstates = normal(rng, (len(LENGTHS), H, P, N))
    _, _, saved = ssd_triton._forward(
        *primals,
        metadata,
        dt_softplus=True,
        dt_limit=DT_LIMIT,
        return_intermediate_states=False,
        state_dtype=jnp.float32,
        config=CONFIG,
        interpret=True,
        residuals=True,
    )
    res = ssd_config.Residuals(*saved)
    s = ssd_config.ScanShapes.of(x, B, metadata)
    default = ssd_config.default_backward_block_sizes(CONFIG)
    dyg, ds_out, *_ = ssd_vjp.state_pass(
        s, metadata, dy, z, C, res, dstates, intermediate=False, blocks=default, interpret=True
    )
    total = int(metadata.cu_chunk_seqlens[-1])
    assert default.dbc_block_k >= CS  # one ∂W tile per chunk
    sums = []
    for per_program, dbc_block_k in ((H // G, None), (1, None), (H // G, 16)):
        blocks = dataclasses.replace(default, max_heads_per_program=per_program)
        if dbc_block_k is not None:
            blocks = dataclasses.replace(blocks, dbc_block_k=dbc_block_k)
        assert ssd_config.heads_per_program(H // G, blocks) == per_program
        parts = ssd_vjp.chunk_dbc(
            s, metadata.cu_chunk_seqlens, x, B, C, res, ds_out, dyg, blocks=blocks, interpret=True
        )
        assert parts[0].shape[0] == H // G // per_program
        sums.append([np.asarray(p).sum(axis=0)[:total] for p in parts])
    for other in sums[1:]:
        for name, a, b in zip(("dB", "dC"), sums[0], other, strict=True):
            assert_close(a, b, rtol=1e-6, name=name)


def test_internal_ssd_backward_with_mosaic_stages():
    """With a ``chunk_dx_fn`` and a ``row_terms_fn`` (the Mosaic backend's on a GPU) the
    backward needs neither C·Bᵀ nor ``y_ssm`` among the residuals and selects the stages'
    per-row outputs past each chunk's end (and D's partials of chunks without rows) away:
    stand-ins giving the Triton chunk_dx's values or the rows' terms from the Triton
    forward's y_ssm, NaN wherever the Mosaic kernels leave them unwritten, reproduce the
    Triton backward's gradients from NaN-poisoned bucket rows."""
    primals, metadata, qsl = _inputs(12)
    total = int(qsl[-1])
    primals = tuple(
        p.at[total:].set(jnp.nan) if i in (0, 1, 3, 4, 6) else p for i, p in enumerate(primals)
    )
    x, _, _, B, C, D, z, _, _ = primals
    rng = np.random.default_rng(13)
    dy = normal(rng, x.shape)
    dstates = normal(rng, (len(LENGTHS), H, P, N))
    options = dict(
        metadata=metadata,
        dt_softplus=True,
        dt_limit=DT_LIMIT,
        return_intermediate_states=False,
    )
    _, _, saved = ssd_triton._forward(
        *primals,
        metadata,
        state_dtype=jnp.float32,
        config=CONFIG,
        interpret=True,
        residuals=True,
        **{k: v for k, v in options.items() if k != "metadata"},
    )
    res = ssd_config.Residuals(*saved)
    blocks = ssd_config.default_backward_block_sizes(CONFIG)
    cu = metadata.cu_chunk_seqlens
    past_end = jnp.arange(CS)[None, None, :] >= (cu[1:] - cu[:-1])[None, :, None]

    def chunk_dx_fn(s, md, x, B, C, stripped, ds_out, D, dyg):
        assert stripped.cb is None and stripped.y_ssm is None
        dx, _, ddt, _, q, _ = ssd_vjp.chunk_dx(
            s, md.cu_chunk_seqlens, x, B, res, ds_out, D, None, dyg, dyg,
            blocks=blocks, interpret=True,
        )  # fmt: skip
        return dx, jnp.where(past_end, jnp.nan, ddt), jnp.where(past_end, jnp.nan, q)

    def row_terms_fn(s, md, x, B, C, stripped, D, z, dy):
        # From the Triton forward's y_ssm, per token: dy_y = dyg · y_ssm in the chunk
        # layout (NaN where no token lands), D's partial Σ dyg ∘ x per chunk (one row
        # block: NaN in chunks without rows), dz with its bucket rows 0.
        f32 = jnp.float32
        y_ssm, zf, xf = res.y_ssm, z.astype(f32), x.astype(f32)
        dyg = (dy.astype(f32) * jax.nn.silu(zf))[:total]
        t = np.arange(total)
        chunk = np.searchsorted(np.asarray(cu), t, side="right") - 1
        dy_y = jnp.full((H, s.max_chunks, CS), jnp.nan, f32)
        dy_y = dy_y.at[:, chunk, t - np.asarray(cu)[chunk]].set(
            jnp.sum(dyg * y_ssm[:total], axis=2).T
        )
        dD_part = jnp.full((s.max_chunks, H, P), jnp.nan, f32).at[np.unique(chunk)].set(0.0)
        dD_part = dD_part.at[chunk].add(dyg * xf[:total])[None]
        sig = jax.nn.sigmoid(zf)
        dz = dy.astype(f32) * (y_ssm + D[None] * xf) * sig * (1 + zf * (1 - sig))
        dz = jnp.where(jnp.arange(x.shape[0])[:, None, None] < total, dz, 0.0)
        return dz.astype(z.dtype), dy_y, dD_part

    def backward(residuals, **stages):
        return ssd_vjp.ssd_scan_backward(
            *primals,
            residuals,
            dy,
            dstates,
            config=blocks,
            interpret=True,
            **stages,
            **options,
        )

    want = backward(res)
    got = backward(
        res._replace(cb=None, y_ssm=None), chunk_dx_fn=chunk_dx_fn, row_terms_fn=row_terms_fn
    )
    for name, g, w in zip(NAMES, got, want, strict=True):
        assert_close(as_f32(g), as_f32(w), rtol=1e-6, name=name)
    assert D.shape == (H, P) and z is not None  # D's partial and dz ran
    with pytest.raises(ValueError, match="row_terms_fn"):
        backward(res, chunk_dx_fn=chunk_dx_fn)


def test_ssd_triton_backward_runs_its_own_kernels():
    primals, metadata, _ = _inputs(8)

    def loss(*primals):
        y, states = _scan("triton", metadata, *primals, dt_softplus=True)
        return jnp.sum(y * y) + jnp.sum(states)

    jaxpr = jax.make_jaxpr(jax.grad(loss, tuple(range(9))))(*primals).jaxpr
    kernels = " ".join(pallas_call_names(jaxpr))
    for name in ("ssd_bwd_state_pass", "ssd_bwd_chunk_dx", "ssd_bwd_chunk_dbc"):
        assert name in kernels, kernels
    outside = primitives_outside_kernels(jaxpr)
    # The reference's products (einsum) run nowhere but in kernels; outside are the small
    # per-chunk sums (a reverse cumsum), the dt chain rule and the metadata's searches.
    assert "dot_general" not in outside, outside


def test_internal_ssd_backward_kernels_lower_for_cuda():
    """The backward kernels lower for CUDA at real sizes with the heuristics' tiles
    (interpret mode does not enforce Triton's rules): G 1 with chunk 256 and a gate
    (mamba-ssm's problem), G 8 with chunk 128 and intermediate states, and a padded head
    dim with a wide state (P 80, N 256: 8 warps)."""
    for T, num_seqs, heads, groups, cs, gated, intermediate, head_dim, state_dim in (
        (1024, 4, 8, 1, 256, True, False, 64, 128),
        (512, 3, 32, 8, 128, False, True, 64, 128),
        (512, 2, 4, 2, 256, True, False, 80, 256),
    ):
        max_chunks = max_chunks_for(T, num_seqs, cs)
        config = ssd_config.default_block_sizes(cs, head_dim, state_dim)

        def grad(*args, cs=cs, intermediate=intermediate, config=config):
            *primals, cu, seq, last, num, dy, dstates = args
            metadata = ChunkMetadata(cu, seq, last, num, chunk_size=cs)
            f = functools.partial(
                ssd_triton.ssd_scan,
                metadata=metadata,
                chunk_size=cs,
                dt_softplus=True,
                dt_limit=(0.0, math.inf),
                return_intermediate_states=intermediate,
                state_dtype=jnp.float32,
                config=config,
            )

            def scan(x, dt, A, B, C, D, z, dt_bias, initial_states):
                return f(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states)

            return jax.vjp(scan, *primals)[1]((dy, dstates))

        f32, i32 = jnp.float32, jnp.int32
        text = lower_for_cuda(
            grad,
            spec((T, heads, head_dim)),
            spec((T, heads)),
            spec((heads,), f32),
            spec((T, groups, state_dim)),
            spec((T, groups, state_dim)),
            spec((heads,), f32),
            spec((T, heads, head_dim)) if gated else None,
            spec((heads,), f32),
            spec((num_seqs, heads, head_dim, state_dim), f32),
            spec((max_chunks + 1,), i32),
            spec((max_chunks,), i32),
            spec((num_seqs,), i32),
            spec((), i32),
            spec((T, heads, head_dim)),
            spec((max_chunks if intermediate else num_seqs, heads, head_dim, state_dim), f32),
        )
        for name in ("ssd_bwd_state_pass", "ssd_bwd_chunk_dx", "ssd_bwd_chunk_dbc"):
            assert name in text, name


def test_internal_mosaic_gradients_lower_for_cuda():
    """Under differentiation the Mosaic backend's forward stays Mosaic and writes the
    backward's residuals: the state scan storing every chunk's carried state, then one
    chunk scan; no Triton forward stage, not even C·Bᵀ, which the backward's Mosaic
    chunk_dx forms itself, and no ``y_ssm`` pass: the backward's rows recompute it. G 8
    with one head per group takes the Triton state scan. The backward's chunk_dx, rows and
    chunk_dbc (a dC and a dB launch) are Mosaic, around the Triton state pass."""
    for T, num_seqs, heads, groups, cs, gated, with_D, mosaic_states in (
        (1024, 3, 8, 1, 256, True, True, True),
        (512, 2, 8, 8, 128, False, False, False),
    ):
        max_chunks = max_chunks_for(T, num_seqs, cs)

        def vjp(*args, cs=cs):
            *primals, cu, seq, last, num, dy, dstates = args
            metadata = ChunkMetadata(cu, seq, last, num, chunk_size=cs)
            f = functools.partial(
                ssd_mosaic.ssd_scan,
                metadata=metadata,
                chunk_size=cs,
                dt_softplus=True,
                dt_limit=(0.0, math.inf),
                return_intermediate_states=False,
                state_dtype=jnp.float32,
                config=ssd_mosaic_config.BlockSizes(),
            )

            def scan(x, dt, A, B, C, D, z, dt_bias):
                return f(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, initial_states=None)

            outputs, pullback = jax.vjp(scan, *primals)
            return outputs, pullback((dy, dstates))

        f32, i32 = jnp.float32, jnp.int32
        text = lower_for_cuda(
            vjp,
            spec((T, heads, 64)),
            spec((T, heads)),
            spec((heads,), f32),
            spec((T, groups, 128)),
            spec((T, groups, 128)),
            spec((heads,), f32) if with_D else None,
            spec((T, heads, 64)) if gated else None,
            spec((heads,), f32),
            spec((max_chunks + 1,), i32),
            spec((max_chunks,), i32),
            spec((num_seqs,), i32),
            spec((), i32),
            spec((T, heads, 64)),
            spec((num_seqs, heads, 64, 128), f32),
        )
        kernels = set(re.findall(r"ssd_[a-z0-9_]+", text))
        # (A kernel's name also appears with a "_mosaic_gpu" or a numbered suffix.)
        chunk_scans = {
            re.sub(r"_(mosaic_gpu|\d+)$", "", k)
            for k in kernels
            if k.startswith("ssd_mosaic_chunk_scan_")
        }
        assert len(chunk_scans) == 1 and chunk_scans.pop().endswith("_zero0"), kernels
        state_scan = "ssd_mosaic_state_scan_cs" if mosaic_states else "ssd_state_scan_cs"
        assert any(k.startswith(state_scan) for k in kernels), kernels
        assert not any(k.startswith("ssd_chunk_scan_cs") for k in kernels), kernels
        assert not any("skip1" in k for k in kernels), kernels
        # The backward: the Mosaic chunk_dx, rows and chunk_dbc around the state pass.
        for name in (
            "ssd_mosaic_bwd_chunk_dx",
            "ssd_mosaic_bwd_rows",
            "ssd_mosaic_bwd_chunk_dc",
            "ssd_mosaic_bwd_chunk_db",
        ):
            assert any(k.startswith(name) for k in kernels), (name, kernels)
        assert not any(k.startswith(("ssd_bwd_chunk_dx", "ssd_bwd_chunk_dbc")) for k in kernels)
        # Its chunk_dx forms B·Cᵀ itself: the forward computes no C·Bᵀ residual.
        assert not any(k.startswith("ssd_chunk_cb") for k in kernels), kernels


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "mosaic"])
@pytest.mark.parametrize("groups, chunk_size", [(1, 256), (8, 128)])
def test_gpu_ssd_gradients_real_size(impl, groups, chunk_size):
    """T 4096 in three sequences (one continued from a state), H 8, P 64, N 128, bf16:
    every gradient against the xla path's jax.grad of the same inputs in fp32; the
    kernels' inputs carry NaN in the 5 bucket rows past the sequences, whose gradients must
    come back 0 (G 8 has one head per group: the Mosaic backend's Triton state scan)."""
    if impl not in implementations(ssd_api.SSD_SCAN):
        pytest.skip(f"{impl} does not run on this machine")
    lengths, heads, head_dim, state_dim = (2000, 1500, 591), 8, 64, 128
    qsl = query_start_loc(lengths)
    T = int(qsl[-1]) + 5
    metadata = chunk_metadata(
        jnp.asarray(qsl),
        jnp.asarray([0, 300, 0], jnp.int32),
        chunk_size=chunk_size,
        max_chunks=max_chunks_for(T, len(lengths), chunk_size),
    )
    keys = iter(jax.random.split(jax.random.key(groups), 12))

    def draw(shape, scale=1.0, dtype=jnp.bfloat16):
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(dtype)

    f32 = jnp.float32
    primals = (
        draw((T, heads, head_dim), 0.5),
        draw((T, heads)),
        -jnp.exp(draw((heads,), dtype=f32)),
        draw((T, groups, state_dim)),
        draw((T, groups, state_dim)),
        draw((heads,), dtype=f32),
        draw((T, heads, head_dim)),
        draw((heads,), 0.5, f32) - 2.0,
        draw((len(lengths), heads, head_dim, state_dim), dtype=f32),
    )
    cotangents = (
        draw((T, heads, head_dim)),
        draw((len(lengths), heads, head_dim, state_dim), dtype=f32),
    )

    def grads(impl, primals, cotangents):
        def f(*args):
            x, dt, A, B, C, D, z, dt_bias, init = args
            return pk.ssd_scan(
                x,
                dt,
                A,
                B,
                C,
                metadata=metadata,
                chunk_size=chunk_size,
                D=D,
                z=z,
                dt_bias=dt_bias,
                dt_softplus=True,
                initial_states=init,
                implementation=impl,
            )

        return jax.vjp(f, *primals)[1](cotangents)

    tail = jnp.arange(T) >= int(qsl[-1])

    def poisoned(a):  # the per-token inputs (x, dt, B, C, z) get NaN bucket rows
        mask = tail.reshape((T,) + (1,) * (a.ndim - 1))
        return jnp.where(mask, jnp.asarray(jnp.nan, a.dtype), a)

    per_token = (0, 1, 3, 4, 6)
    got = grads(
        impl,
        tuple(poisoned(p) if i in per_token else p for i, p in enumerate(primals)),
        cotangents,
    )
    for i in per_token:
        np.testing.assert_array_equal(as_f32(got[i])[np.asarray(tail)], 0.0, err_msg=NAMES[i])
    wide = tuple(p.astype(f32) for p in primals)
    with jax.default_matmul_precision("highest"):
        ref = grads("xla", wide, tuple(c.astype(f32) for c in cotangents))
    errors = {}
    for name, g, p, r in zip(NAMES, got, primals, ref, strict=True):
        assert g.dtype == p.dtype, name
        errors[name] = relative_error(as_f32(g), as_f32(r))
        # dD sums products of 16-bit inputs in fp32: no bf16 rounding of dy · silu(z).
        rtol = 3e-5 if name == "dD" else _bf16_tol(name)
        assert_close(as_f32(g), as_f32(r), rtol=rtol, name=f"{name} vs xla")
    # (-s shows them: the relative error per input, for the notes)
    print(f"{impl} G{groups} chunk {chunk_size}:", {k: f"{v:.2e}" for k, v in errors.items()})
