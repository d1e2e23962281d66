"""Gradients of the ops (DESIGN.md §8 "Gradients"): every implementation against central
finite differences of the float64 oracles (``testing.vjp_errors``), the Pallas backends
against the ``xla`` path's ``jax.grad``, and the Pallas backends' gradients running their
own Pallas backward kernels (``jax.custom_vjp``), never the reference.

Shapes are tiny: every Triton kernel runs in interpret mode on the CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.attention import api as attn_api
from pallas_kernels.attention import mosaic_config as attn_mosaic_config
from pallas_kernels.attention import triton as attn_triton
from pallas_kernels.attention import triton_config as attn_config
from pallas_kernels.attention import triton_vjp as attn_vjp
from pallas_kernels.conv1d import api as conv_api
from pallas_kernels.conv1d import triton as conv_triton
from pallas_kernels.conv1d import triton_config as conv_config
from pallas_kernels.norm import api as norm_api
from pallas_kernels.norm import triton as norm_triton
from pallas_kernels.norm import triton_config as norm_config
from pallas_kernels.norm import triton_vjp as norm_vjp
from pallas_kernels.testing import (
    assert_close,
    attention_oracle,
    causal_conv1d_oracle,
    gated_rms_norm_oracle,
    vjp_errors,
)
from tests.helpers import (
    as_f32,
    dead_rows,
    implementations,
    lower_for_cuda,
    normal,
    pallas_call_names,
    poison_tail,
    primitives_outside_kernels,
    query_start_loc,
    spec,
)

# Gradient error against the float64 finite differences (Cauchy–Schwarz-normalised, see
# ``vjp_errors``): fp32 rounding of the kernels' sums is ~1e-7; a wrong term is O(1).
FD_TOL = 1e-5
# Pallas gradients against the xla path's jax.grad, fp32 (relative Frobenius error).
XLA_TOL = 1e-5


def _check_against_xla(grads, xla_grads, names):
    for name, g, ref in zip(names, grads, xla_grads, strict=True):
        assert g.dtype == ref.dtype, name
        assert_close(as_f32(g), as_f32(ref), rtol=XLA_TOL, name=f"{name} vs xla")


def _check_against_fd(oracle, primals, cotangent, grads, names):
    errors = vjp_errors(oracle, tuple(as_f32(p) for p in primals), cotangent, grads)
    for i, name in enumerate(names):
        assert errors[i] <= FD_TOL, f"{name}: finite-difference error {errors[i]:.2e}"


# --------------------------------------------------------------------------- gated_rms_norm

NORM_IMPLS = implementations(norm_api.GATED_RMS_NORM)
# 18 channels in groups of 6: a group is not a power of two (masked tile columns); 5 rows
# in blocks of 2 (a partial row block).
NORM_T, NORM_DM, NORM_GS = 5, 18, 6
NORM_CONFIG = norm_config.BlockSizes(block_rows=2, num_warps=4)


def _norm_inputs(seed: int):
    rng = np.random.default_rng(seed)
    x = normal(rng, (NORM_T, NORM_DM))
    z = normal(rng, (NORM_T, NORM_DM), scale=2.0)
    weight = jnp.asarray(1.0 + 0.3 * rng.normal(size=NORM_DM), jnp.float32)
    dy = normal(rng, (NORM_T, NORM_DM))
    return x, z, weight, dy


def _norm_grads(impl, x, z, weight, dy, *, norm_before_gate):
    config = NORM_CONFIG if impl == "triton" else None

    def f(x, z, weight):
        return pk.gated_rms_norm(
            x,
            z,
            weight,
            group_size=NORM_GS,
            norm_before_gate=norm_before_gate,
            implementation=impl,
            config=config,
        )

    if z is None:
        _, vjp = jax.vjp(lambda x, w: f(x, None, w), x, weight)
        dx, dw = vjp(dy)
        return dx, dw
    _, vjp = jax.vjp(f, x, z, weight)
    return vjp(dy)


@pytest.mark.parametrize("gated", [True, False], ids=["z", "no_z"])
@pytest.mark.parametrize("norm_before_gate", [False, True], ids=["gate_first", "norm_first"])
@pytest.mark.parametrize("impl", NORM_IMPLS)
def test_gated_rms_norm_gradients(impl, norm_before_gate, gated):
    """dx, dz, dweight against finite differences of the float64 oracle, and the Pallas
    backend against the xla path's jax.grad."""
    x, z, weight, dy = _norm_inputs(0)
    z = z if gated else None
    grads = _norm_grads(impl, x, z, weight, dy, norm_before_gate=norm_before_gate)
    names = ("dx", "dz", "dweight") if gated else ("dx", "dweight")
    for g, p in zip(grads, (x, z, weight) if gated else (x, weight), strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype

    def oracle(*primals):
        x, z, w = primals if gated else (primals[0], None, primals[1])
        return gated_rms_norm_oracle(x, z, w, group_size=NORM_GS, norm_before_gate=norm_before_gate)

    primals = (x, z, weight) if gated else (x, weight)
    _check_against_fd(oracle, primals, as_f32(dy), [as_f32(g) for g in grads], names)
    if impl != "xla":
        xla = _norm_grads("xla", x, z, weight, dy, norm_before_gate=norm_before_gate)
        _check_against_xla(grads, xla, names)


@pytest.mark.parametrize("impl", [i for i in NORM_IMPLS if i != "xla"])
def test_gated_rms_norm_bf16_gradient_dtypes(impl):
    """bf16 inputs give bf16 gradients within the bf16 tolerance of the fp32 ones."""
    x, z, weight, dy = _norm_inputs(1)
    low = [a.astype(jnp.bfloat16) for a in (x, z, weight, dy)]
    grads = _norm_grads(impl, *low, norm_before_gate=False)
    ref = _norm_grads("xla", *(a.astype(jnp.float32) for a in low), norm_before_gate=False)
    for name, g, r in zip(("dx", "dz", "dweight"), grads, ref, strict=True):
        assert g.dtype == jnp.bfloat16
        assert_close(as_f32(g), as_f32(r), rtol=2e-2, name=name)


def test_internal_gated_rms_norm_backward_loops_over_row_blocks(monkeypatch):
    """With fewer backward programs than row blocks (one per group here), each program
    loops over several row blocks and sums their dweight: the same gradients."""
    monkeypatch.setattr(norm_vjp, "device_num_sms", lambda: 1)
    x, z, weight, dy = _norm_inputs(0)
    grads = _norm_grads("triton", x, z, weight, dy, norm_before_gate=False)
    xla = _norm_grads("xla", x, z, weight, dy, norm_before_gate=False)
    _check_against_xla(grads, xla, ("dx", "dz", "dweight"))


def test_gated_rms_norm_triton_backward_runs_its_own_kernel():
    x, z, weight, _ = _norm_inputs(2)

    def loss(x, z, weight):
        y = pk.gated_rms_norm(
            x, z, weight, group_size=NORM_GS, implementation="triton", config=NORM_CONFIG
        )
        return jnp.sum(y * y)

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, z, weight).jaxpr
    kernels = " ".join(pallas_call_names(jaxpr))
    assert "gated_rms_norm_bwd_gs6_rows2" in kernels
    outside = primitives_outside_kernels(jaxpr)
    # The reference's statistics and gate (rsqrt, sigmoid) run nowhere but in kernels.
    assert not outside & {"rsqrt", "logistic", "reduce_max"}, outside


@pytest.mark.parametrize("impl", implementations(norm_api.RMS_NORM))
def test_internal_add_rms_norm_gradients(impl):
    """``rms_norm`` with a residual: (y, s) both carry cotangents (the next block reads the
    norm, the stream goes on), so dx = dresidual = ds + the norm's backward of dy. dx,
    dresidual and dweight against finite differences of the float64 oracle, and the Pallas
    backend against the xla path's jax.grad."""
    x, residual, weight, dy = _norm_inputs(3)
    dtotal = normal(np.random.default_rng(4), (NORM_T, NORM_DM))
    config = NORM_CONFIG if impl == "triton" else None

    def grads_of(impl, config):
        def f(x, residual, weight):
            return pk.rms_norm(x, weight, residual=residual, implementation=impl, config=config)

        _, vjp = jax.vjp(f, x, residual, weight)
        return vjp((dy, dtotal))

    grads = grads_of(impl, config)
    names = ("dx", "dresidual", "dweight")

    def oracle(x, residual, w):
        total = x + residual
        return gated_rms_norm_oracle(total, None, w, group_size=NORM_DM), total

    cotangent = (as_f32(dy), as_f32(dtotal))
    _check_against_fd(oracle, (x, residual, weight), cotangent, [as_f32(g) for g in grads], names)
    if impl != "xla":
        _check_against_xla(grads, grads_of("xla", None), names)


# --------------------------------------------------------------------------- causal_conv1d

CONV_IMPLS = implementations(conv_api.CAUSAL_CONV1D)
CONV_K, CONV_DIM = 4, 12
# 4-row token blocks in 8-channel blocks (a masked channel tail).
CONV_CONFIG = conv_config.BlockSizes(block_t=4, unroll_t=4, block_d=8, num_warps=2)
# A 9-token prompt (three blocks), an empty sequence, a continued prefix shorter than
# K - 1 (the new state mixes old state and tokens), a padding sequence, a continued
# 6-token prefix and bucket rows past the sequences.
CONV_LENGTHS = (9, 0, 2, 3, 6)
CONV_SLOTS = np.array([0, 5, 2, -1, 3], np.int32)
CONV_HAS_STATE = np.array([False, True, True, True, True])
CONV_PAD_ROWS = 3
CONV_SLOTS_TOTAL = 6


def _conv_inputs(seed: int):
    rng = np.random.default_rng(seed)
    qsl = query_start_loc(CONV_LENGTHS)
    num_tokens = int(qsl[-1]) + CONV_PAD_ROWS
    x = normal(rng, (num_tokens, CONV_DIM))
    weight = normal(rng, (CONV_DIM, CONV_K), scale=0.5)
    bias = normal(rng, (CONV_DIM,))
    cache = normal(rng, (CONV_SLOTS_TOTAL, CONV_K - 1, CONV_DIM))
    dy = normal(rng, (num_tokens, CONV_DIM))
    dcache = normal(rng, cache.shape)
    return x, weight, bias, qsl, cache, dy, dcache


def _conv_kwargs(qsl, cache):
    return dict(
        query_start_loc=qsl,
        conv_state_cache=cache,
        slot_ids=CONV_SLOTS,
        has_initial_state=CONV_HAS_STATE,
    )


def _conv_grads(impl, x, weight, bias, qsl, cache, dy, dcache, *, activation):
    config = CONV_CONFIG if impl == "triton" else None

    def f(x, weight, bias, cache):
        return pk.causal_conv1d(
            x,
            weight,
            bias,
            **_conv_kwargs(qsl, cache),
            activation=activation,
            implementation=impl,
            config=config,
        )

    _, vjp = jax.vjp(f, x, weight, bias, cache)
    return vjp((dy, dcache))


@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "linear"])
@pytest.mark.parametrize("impl", CONV_IMPLS)
def test_causal_conv1d_gradients(impl, activation):
    """dx, dweight, dbias and the conv state cache's (cotangents of y and of the new conv
    state) against finite differences of the float64 oracle, and the Pallas backend against
    the xla path's jax.grad; rows of padding sequences and past the sequences get exactly
    0, cache lines no sequence names pass their cotangent through, lines written without
    being read get 0. (The Pallas backward returned no cache cotangent before: zeros.)"""
    x, weight, bias, qsl, cache, dy, dcache = _conv_inputs(3)
    grads = _conv_grads(impl, x, weight, bias, qsl, cache, dy, dcache, activation=activation)
    names = ("dx", "dweight", "dbias", "dcache")
    for g, p in zip(grads, (x, weight, bias, cache), strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype
    dead = dead_rows(x.shape[0], qsl, CONV_SLOTS)
    np.testing.assert_array_equal(as_f32(grads[0])[dead], 0.0)
    unnamed = [s for s in range(CONV_SLOTS_TOTAL) if s not in CONV_SLOTS]
    np.testing.assert_array_equal(as_f32(grads[3])[unnamed], as_f32(dcache)[unnamed])
    np.testing.assert_array_equal(as_f32(grads[3])[CONV_SLOTS[0]], 0.0)  # no initial state

    def oracle(x, weight, bias, cache):
        return causal_conv1d_oracle(
            x, weight, bias, **_conv_kwargs(qsl, cache), activation=activation
        )

    cotangent = (as_f32(dy), as_f32(dcache))
    inputs = (x, weight, bias, as_f32(cache))
    _check_against_fd(oracle, inputs, cotangent, [as_f32(g) for g in grads], names)
    if impl != "xla":
        xla = _conv_grads("xla", x, weight, bias, qsl, cache, dy, dcache, activation=activation)
        _check_against_xla(grads, xla, names)


def test_causal_conv1d_triton_backward_runs_its_own_kernel():
    x, weight, bias, qsl, cache, _, _ = _conv_inputs(4)

    def loss(x, weight, bias):
        y, new_cache = pk.causal_conv1d(
            x, weight, bias, **_conv_kwargs(qsl, cache), implementation="triton", config=CONV_CONFIG
        )
        return jnp.sum(y * y) + jnp.sum(new_cache)

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, weight, bias).jaxpr
    kernels = " ".join(pallas_call_names(jaxpr))
    assert "causal_conv1d_bwd_k4_bt4_bd8" in kernels
    outside = primitives_outside_kernels(jaxpr)
    # The reference's SiLU (logistic) runs nowhere but in kernels (the kernels' own is an
    # exp2); what runs outside is the block table, the sums of the partial gradients and
    # the conv state's cotangent from each sequence's first K - 1 rows ([B, K-1, dim]).
    assert "logistic" not in outside, outside


# --------------------------------------------------------------------------- attention

ATTN_IMPLS = [i for i in implementations(attn_api.MASKED_TAIL_ATTENTION) if i != "mosaic"]
ATTN_HQ, ATTN_HKV, ATTN_D, ATTN_S, ATTN_L = 4, 2, 16, 6, 24
# 8-row Q tiles of 2 query heads (16 rows), 16-key KV blocks.
ATTN_CONFIG = attn_config.BlockSizes(block_q=8, block_k=16, split_k=16, decode_block_k=16)
# A prompt, an empty sequence, a continued prefix (4 cached keys), a padding sequence and
# a long continuation over two KV blocks, plus 2 bucket rows; GQA (2 query heads per KV
# head). Decode: one token per sequence (T <= B: the split-KV forward).
ATTN_CASES = {
    "prefill": ((7, 0, 3, 1, 5), (7, 4, 7, 6, 20), (0, 3, 2, -1, 4), 2),
    "decode": ((1, 1, 0, 1), (5, 17, 0, 1), (1, 4, 0, 2), 0),
}


def _attn_inputs(seed: int, case: str):
    lengths, kv_lens, slots, pad_rows = ATTN_CASES[case]
    rng = np.random.default_rng(seed)
    qsl = query_start_loc(lengths)
    num_tokens = int(qsl[-1]) + pad_rows
    q = normal(rng, (num_tokens, ATTN_HQ, ATTN_D))
    shape = (ATTN_S, ATTN_L, ATTN_HKV, ATTN_D)
    slots = np.array(slots, np.int32)
    kv_lens = np.array(kv_lens, np.int32)
    # Cache tails and unnamed slots hold NaN: nothing may read them, forward or backward.
    k = jnp.asarray(poison_tail(rng.normal(size=shape), slots, kv_lens))
    v = jnp.asarray(poison_tail(rng.normal(size=shape), slots, kv_lens))
    dout = normal(rng, q.shape)
    return q, k, v, dict(query_start_loc=qsl, kv_lens=kv_lens, slot_ids=slots), dout


def _attn_grads(impl, q, k, v, batch, dout, **mask):
    config = ATTN_CONFIG if impl == "triton" else None

    def f(q, k, v):
        return pk.masked_tail_attention(
            q, k, v, **batch, **mask, implementation=impl, config=config
        )

    _, vjp = jax.vjp(f, q, k, v)
    return vjp(dout)


def _read_lines(batch) -> np.ndarray:
    """bool[S, L]: the cache lines the forward reads (keys before kv_len of named slots)."""
    read = np.zeros((ATTN_S, ATTN_L), bool)
    for slot, kv_len in zip(batch["slot_ids"], batch["kv_lens"], strict=True):
        if slot >= 0:
            read[slot, :kv_len] = True
    return read


# Masks per case: causal, bidirectional, sliding window (operands of one compiled kernel).
ATTN_MASKS = {
    "prefill": ((True, None), (False, None), (True, 5)),
    "decode": ((True, None),),
}


@pytest.mark.parametrize("case", list(ATTN_CASES))
@pytest.mark.parametrize("impl", ATTN_IMPLS)
def test_masked_tail_attention_gradients(impl, case):
    """dq, dk_cache, dv_cache against finite differences of the float64 oracle and the
    Pallas backend against the xla path's jax.grad, for each mask; NaN cache tails and
    unnamed slots stay out, the lines the forward does not read get exactly 0, dead rows
    dq = 0."""
    for causal, window in ATTN_MASKS[case]:
        _check_attention_gradients(impl, case, causal, window)


def _check_attention_gradients(impl, case, causal, window):
    q, k, v, batch, dout = _attn_inputs(5, case)
    mask = dict(causal=causal, sliding_window=window)
    grads = _attn_grads(impl, q, k, v, batch, dout, **mask)
    names = tuple(f"{n} ({causal=}, {window=})" for n in ("dq", "dk_cache", "dv_cache"))
    for g, p in zip(grads, (q, k, v), strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype
    read = _read_lines(batch)
    for name, g in zip(names[1:], grads[1:], strict=True):
        np.testing.assert_array_equal(as_f32(g)[~read], 0.0, err_msg=name)
    dead = dead_rows(q.shape[0], batch["query_start_loc"], batch["slot_ids"])
    np.testing.assert_array_equal(as_f32(grads[0])[dead], 0.0, err_msg=names[0])

    def oracle(q, k, v):
        return attention_oracle(q, k, v, **batch, **mask)

    _check_against_fd(oracle, (q, k, v), as_f32(dout), [as_f32(g) for g in grads], names)
    if impl != "xla":
        xla = _attn_grads("xla", q, k, v, batch, dout, **mask)
        _check_against_xla(grads, xla, names)


@pytest.mark.parametrize("impl", ATTN_IMPLS)
def test_masked_tail_attention_padding_rows_get_zero_gradients(impl):
    """A padding sequence (slot -1) longer than what cache line 0 holds: its rows' dq is 0
    and every gradient is finite (the xla path gave NaN: 0 times line 0's NaN tail)."""
    rng = np.random.default_rng(13)
    lengths, kv_lens, slots = (3, 4), np.array([3, 20], np.int32), np.array([0, -1], np.int32)
    qsl = query_start_loc(lengths)
    shape = (2, ATTN_L, ATTN_HKV, ATTN_D)
    q = normal(rng, (8, ATTN_HQ, ATTN_D))
    k = jnp.asarray(poison_tail(rng.normal(size=shape), slots, kv_lens))
    v = jnp.asarray(poison_tail(rng.normal(size=shape), slots, kv_lens))
    batch = dict(query_start_loc=qsl, kv_lens=kv_lens, slot_ids=slots)
    dq, dk, dv = _attn_grads(impl, q, k, v, batch, normal(rng, q.shape))
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.all(np.isfinite(as_f32(g))), name
    np.testing.assert_array_equal(as_f32(dq)[3:], 0.0)


@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, 9)])
def test_internal_masked_tail_attention_backward_tiles(causal, window):
    """The dK/dV kernel's row loop masks only the tiles on the band's edges and at kv_len:
    with 16-key blocks and 8-token steps over 40- and 33-row sequences most tiles are
    interior (unmasked) ones. Every tiling gives the xla path's gradients."""
    rng = np.random.default_rng(11)
    lengths, kv_lens, slots = (40, 0, 33), np.array([40, 0, 45], np.int32), (2, 0, 1)
    qsl = query_start_loc(lengths)
    num_tokens, cache_len = int(qsl[-1]) + 3, 48
    slots = np.array(slots, np.int32)
    q = normal(rng, (num_tokens, ATTN_HQ, ATTN_D))
    shape = (ATTN_S, cache_len, ATTN_HKV, ATTN_D)
    k = jnp.asarray(poison_tail(rng.normal(size=shape), slots, kv_lens))
    v = jnp.asarray(poison_tail(rng.normal(size=shape), slots, kv_lens))
    dout = normal(rng, q.shape)
    batch = dict(query_start_loc=qsl, kv_lens=kv_lens, slot_ids=slots)
    mask = dict(causal=causal, sliding_window=window, sm_scale=ATTN_D**-0.5)
    out, lse = attn_triton.prefill_attention(
        q, k, v, **batch, **mask, block_sizes=ATTN_CONFIG, interpret=True, with_lse=True
    )
    xla = _attn_grads("xla", q, k, v, batch, dout, causal=causal, sliding_window=window)
    names = tuple(f"{n} ({causal=}, {window=})" for n in ("dq", "dk_cache", "dv_cache"))
    for tiles in (
        attn_config.BackwardBlockSizes(
            dq_block_q=8, dq_block_k=16, dkv_block_q=8, dkv_block_k=16, dkv_num_stages=1
        ),
        attn_config.BackwardBlockSizes(dq_block_q=16, dq_block_k=32, dkv_block_q=16),
    ):
        grads = attn_vjp.attention_backward(
            q, k, v, out, lse, dout, **batch, **mask, block_sizes=tiles, interpret=True
        )
        _check_against_xla(grads, xla, tuple(f"{n} {tiles}" for n in names))


def test_internal_attention_backward_tiles_fit_shared_memory():
    """The dK/dV estimate reproduces the 321 KiB (328,704 bytes) an fp32 train step of the
    shipped model's shape (Hq 4, Hkv 2, D 64) asked for on an H200 with 128 keys, 128 rows
    and two stages, less its 1 KiB of row statistics; the heuristic now keeps fp32 under the
    budget and leaves the measured bf16 tiles (128 keys, two stages at D 128) as they were."""
    old = attn_config.BackwardBlockSizes(dkv_block_k=128, dkv_block_q=64, dkv_num_stages=2)
    assert attn_config.dkv_smem_bytes(old, group=2, head_dim=64, dtype=jnp.float32) == 328704 - 1024
    for group, head_dim, dtype in (
        (2, 64, jnp.float32),
        (4, 128, jnp.float32),
        (4, 128, jnp.bfloat16),
    ):
        forward = attn_config.default_block_sizes(
            num_tokens=2048,
            num_q_heads=2 * group,
            num_kv_heads=2,
            head_dim=head_dim,
            cache_len=2048,
            dtype=dtype,
        )
        tiles = attn_config.default_backward_block_sizes(
            forward, group=group, head_dim=head_dim, dtype=dtype
        )
        smem = attn_config.dkv_smem_bytes(tiles, group=group, head_dim=head_dim, dtype=dtype)
        assert smem <= 200 * 1024, (tiles, smem)
        if dtype == jnp.bfloat16:
            assert (tiles.dkv_block_k, tiles.dkv_num_stages) == (128, 2), tiles


@pytest.mark.gpu
@pytest.mark.parametrize(
    "impl", [i for i in implementations(attn_api.MASKED_TAIL_ATTENTION) if i != "xla"]
)
@pytest.mark.parametrize("window", [None, 100])
def test_internal_masked_tail_attention_gradients_real_size(impl, window):
    """bf16 at a real head layout (Hq 32, Hkv 8, D 128) with the default tiles, against the
    xla path's fp32 gradient: long prompts, a continued prefix, a decode row, an empty
    and a padding sequence, NaN cache tails."""
    rng = np.random.default_rng(12)
    lengths, kv_lens = (300, 1, 0, 129, 5, 64), np.array([300, 200, 0, 400, 9, 64], np.int32)
    slots = np.array([4, 0, 2, -1, 5, 1], np.int32)
    qsl = query_start_loc(lengths)
    num_tokens, shape = 512, (6, 512, 8, 128)
    q = normal(rng, (num_tokens, 32, 128), jnp.bfloat16)
    k = jnp.asarray(poison_tail(rng.normal(size=shape), slots, kv_lens), jnp.bfloat16)
    v = jnp.asarray(poison_tail(rng.normal(size=shape), slots, kv_lens), jnp.bfloat16)
    dout = normal(rng, q.shape, jnp.bfloat16)
    batch = dict(query_start_loc=qsl, kv_lens=kv_lens, slot_ids=slots)

    def grads(impl, *operands):
        def f(*operands):
            return pk.masked_tail_attention(
                *operands, **batch, sliding_window=window, implementation=impl
            )

        return jax.vjp(f, *operands)[1](dout.astype(operands[0].dtype))

    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    for name, g, ref in zip(
        ("dq", "dk", "dv"), grads(impl, q, k, v), grads("xla", *f32), strict=True
    ):
        assert g.dtype == jnp.bfloat16
        assert_close(as_f32(g), as_f32(ref), rtol=2e-2, name=f"{name} ({impl}, {window=})")


def test_masked_tail_attention_triton_backward_runs_its_own_kernels():
    q, k, v, batch, _ = _attn_inputs(6, "prefill")
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)

    def loss(q, k, v):
        out = pk.masked_tail_attention(
            q, k, v, **batch, implementation="triton", config=ATTN_CONFIG
        )
        return jnp.sum(out * out)

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v).jaxpr
    kernels = " ".join(pallas_call_names(jaxpr))
    # dQ on the forward's tiles; dK/dV on 32-key blocks stepping with the same Q tiles.
    assert "attention_bwd_dq_bq8_bk16_g2_d16" in kernels
    assert "attention_bwd_dkv_bq8_bk32_g2_d16" in kernels
    outside = primitives_outside_kernels(jaxpr)
    # The reference's logits, softmax and products (einsum, exp) run nowhere but in kernels.
    assert not outside & {"dot_general", "exp", "exp2"}, outside


@pytest.mark.parametrize("paged", [False, True], ids=["slots", "pages"])
def test_write_kv_gradients(paged):
    """The Triton write_kv is differentiable as the scatter it is: the caches' cotangents
    pass through with the written rows zeroed, each token gets its row's cotangent (0 for
    a padding sequence's tokens and the bucket rows past the batch); equal to the xla
    scatter's autodiff, and the zeroing runs the write kernel."""
    rng = np.random.default_rng(21)
    T, Hkv, D = 9, 2, 8
    batch = dict(
        query_start_loc=jnp.array([0, 3, 4, 7], jnp.int32),
        kv_lens=jnp.array([5, 1, 6], jnp.int32),
        slot_ids=jnp.array([2, -1, 0], jnp.int32),
    )
    shape = (3, 8, Hkv, D)
    if paged:  # pages of 4 rows, shuffled in a pool of 6
        shape = (6, 4, Hkv, D)
        batch["block_table"] = jnp.array([[4, 1], [0, 0], [5, 2]], jnp.int32)
    k_cache, v_cache = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in "kv")
    k, v = (jnp.asarray(rng.standard_normal((T, Hkv, D)), jnp.float32) for _ in "kv")
    cotangents = tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in "kv")

    def grads(impl):
        def write(*args):
            return pk.write_kv(*args, **batch, implementation=impl)

        _, vjp = jax.vjp(write, k_cache, v_cache, k, v)
        return vjp(cotangents)

    for got, want in zip(grads("triton"), grads("xla"), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    dk = np.asarray(grads("triton")[2])
    np.testing.assert_array_equal(dk[3], 0.0)  # the padding sequence's token
    np.testing.assert_array_equal(dk[7:], 0.0)  # bucket rows past the batch
    assert np.all(dk[:3] != 0.0)

    def loss(k_cache, v_cache, k, v):
        kc, vc = pk.write_kv(k_cache, v_cache, k, v, **batch, implementation="triton")
        return jnp.sum(kc * cotangents[0]) + jnp.sum(vc * cotangents[1])

    # jax.grad drops the unused forward write: what is left is the backward's zeroing.
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2, 3)))(k_cache, v_cache, k, v).jaxpr
    assert "write_kv_h2_d8" in pallas_call_names(jaxpr)


# --------------------------------------------------------------------------- lowering


def test_internal_backward_kernels_lower_for_cuda():
    """The backward kernels lower for CUDA at real sizes with the heuristics' tiles
    (interpret mode does not enforce Triton's rules), the Mosaic backend's gradient (the
    Triton forward with lse and backward kernels) included."""
    dim, gs = 2064, 258
    cfg = norm_config.default_block_sizes(gs)

    def norm(x, z, w, dy):
        f = functools.partial(
            norm_triton.gated_rms_norm, group_size=gs, eps=1e-5, norm_before_gate=False, config=cfg
        )
        return jax.vjp(f, x, z, w)[1](dy)

    text = lower_for_cuda(norm, spec((64, dim)), spec((64, dim)), spec((dim,)), spec((64, dim)))
    assert "gated_rms_norm_bwd" in text

    T, B, S, width = 256, 3, 4, 4
    conv_cfg = conv_config.default_block_sizes(dim, width)

    def conv(x, w, b, qsl, cache, slots, has_state, dy, dcache):
        f = functools.partial(
            conv_triton.causal_conv1d,
            query_start_loc=qsl,
            conv_state_cache=cache,
            slot_ids=slots,
            has_initial_state=has_state,
            activation="silu",
            config=conv_cfg,
        )
        return jax.vjp(f, x, w, b)[1]((dy, dcache))

    cache = spec((S, width - 1, dim))
    text = lower_for_cuda(
        conv,
        spec((T, dim)),
        spec((dim, width)),
        spec((dim,)),
        spec((B + 1,), jnp.int32),
        cache,
        spec((B,), jnp.int32),
        spec((B,), jnp.bool_),
        spec((T, dim)),
        cache,
    )
    assert "causal_conv1d_bwd" in text

    T, Hq, Hkv, D, S, L, B = 512, 32, 8, 128, 8, 1024, 4

    def attention(q, k, v, qsl, kv_lens, slots, dout):
        batch = dict(query_start_loc=qsl, kv_lens=kv_lens, slot_ids=slots)
        f = functools.partial(
            attn_api._mosaic_attention,
            **batch,
            causal=True,
            sm_scale=D**-0.5,
            sliding_window=None,
            config=attn_mosaic_config.BlockSizes(),
        )
        return jax.vjp(f, q, k, v)[1](dout)

    cache = spec((S, L, Hkv, D))
    ints = spec((B,), jnp.int32)
    text = lower_for_cuda(
        attention,
        spec((T, Hq, D)),
        cache,
        cache,
        spec((B + 1,), jnp.int32),
        ints,
        ints,
        spec((T, Hq, D)),
    )
    # The forward (saving lse), dQ and dK/dV are Mosaic kernels.
    assert text.count("custom_call @mosaic_gpu") == 3 and "attention_bwd_dq_bq" not in text


def test_vjp_errors_catches_a_wrong_gradient():
    """The finite-difference check itself: exact gradients of a float64 function score at
    rounding level, a gradient off by 1% or missing a term scores far above FD_TOL."""
    rng = np.random.default_rng(9)
    x, w = rng.normal(size=(5, 3)), rng.normal(size=(3, 4))
    u = rng.normal(size=(5, 4))

    def f(x, w):
        return np.tanh(x @ w)

    def grads(x, w):
        dt = u * (1 - np.tanh(x @ w) ** 2)
        return dt @ w.T, x.T @ dt

    dx, dw = grads(x, w)
    errors = vjp_errors(f, (x, w), u, (dx, dw))
    assert max(errors.values()) < 1e-8, errors
    assert vjp_errors(f, (x, w), u, (dx * 1.01, dw))[0] > 1e-3
    assert vjp_errors(f, (x, w), u, (dx, x.T @ u))[1] > 1e-2
    assert vjp_errors(f, (x, w), u, (np.zeros_like(dx), None), wrt=(0,))[0] > 1e-2
