"""mamba2_prefill against the float64 oracles of its three ops on the split rows."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import mamba2_prefill
from pallas_kernels.conv1d import triton as conv_triton
from pallas_kernels.conv1d import triton_config as conv_config
from pallas_kernels.mamba_prefill import api as mamba_prefill_api
from pallas_kernels.mamba_prefill import triton_config as mamba_prefill_config
from pallas_kernels.norm import triton as norm_triton
from pallas_kernels.testing import (
    assert_close_per_row,
    causal_conv1d_oracle,
    gated_rms_norm_oracle,
    ssd_oracle,
)
from tests.helpers import (
    check_slot_cache,
    dead_rows,
    eqns_outside_kernels,
    implementations,
    lower_for_cuda,
    normal,
    poison_slots,
    query_start_loc,
    spec,
)

IMPLS = implementations(mamba_prefill_api.MAMBA2_PREFILL)
F32_TOL, BF16_TOL = 1e-4, 3e-2
H, P, N, K, CHUNK = 4, 16, 8, 4, 8  # heads, head dim, state size, conv width, chunk size


def make_step(
    lengths,
    slots,
    has_state,
    *,
    groups,
    num_tokens,
    num_slots=6,
    heads=H,
    head_dim=P,
    state_dim=N,
    chunk_size=CHUNK,
    dtype=jnp.float32,
    seed=0,
    conv_bias=True,
):
    """Arrays of one prefill step: in_proj rows z | x | B | C | dt of the packed sequences
    (NaN in the bucket rows past them and in the rows of padding sequences), both caches
    (slots no sequence names NaN), weights, and the layout."""
    H, P, N = heads, head_dim, state_dim
    rng = np.random.default_rng(seed)
    d_inner = H * P
    conv_dim = d_inner + 2 * groups * N
    qsl = query_start_loc(lengths)
    zxbcdt = np.array(normal(rng, (num_tokens, d_inner + conv_dim + H)), np.float32)
    zxbcdt[dead_rows(num_tokens, qsl, slots)] = np.nan
    arrays = dict(
        zxbcdt=jnp.asarray(zxbcdt, dtype),
        conv_state_cache=poison_slots(normal(rng, (num_slots, K - 1, conv_dim), dtype), slots),
        conv_weight=normal(rng, (conv_dim, K), scale=0.5),
        conv_bias=normal(rng, (conv_dim,), scale=0.5) if conv_bias else None,
        ssm_state_cache=poison_slots(normal(rng, (num_slots, H, P, N)), slots),
        A_log=jnp.asarray(rng.normal(size=H), jnp.float32),
    )
    metadata = pk.chunk_metadata(
        jnp.asarray(qsl),
        jnp.zeros(len(lengths), jnp.int32),
        chunk_size=chunk_size,
        max_chunks=pk.max_chunks_for(num_tokens, len(lengths), chunk_size),
    )
    options = dict(
        query_start_loc=jnp.asarray(qsl),
        metadata=metadata,
        chunk_size=chunk_size,
        slot_ids=jnp.asarray(slots, jnp.int32),
        has_initial_state=jnp.asarray(has_state),
        D=normal(rng, (H,)),
        dt_bias=normal(rng, (H,), scale=0.5),
        dt_softplus=True,
        norm_weight=1.0 + normal(rng, (d_inner,), scale=0.2),
    )
    return arrays, options


def oracle(
    arrays, *, groups, norm_weight, norm_group_size=None, norm_before_gate=False, gate=True, **o
):
    """The conv, SSD and gated norm oracles on the split rows, the caches read and written
    per sequence as the ops' ``state_cache`` forms do (without a norm, y gated by silu(z)
    unless ``gate`` is False)."""
    a = arrays
    T = a["zxbcdt"].shape[0]
    H, P, N = a["ssm_state_cache"].shape[1:]
    d_inner, gn = H * P, groups * N
    conv_dim = d_inner + 2 * gn
    qsl, slots = np.asarray(o["query_start_loc"]), np.asarray(o["slot_ids"])
    has_state = np.asarray(o["has_initial_state"])
    rows = np.asarray(a["zxbcdt"], np.float64)
    z, xbc, dt = rows[:, :d_inner], rows[:, d_inner : d_inner + conv_dim], rows[:, -H:]
    xbc, conv_cache = causal_conv1d_oracle(
        xbc, a["conv_weight"], a["conv_bias"], query_start_loc=qsl,
        conv_state_cache=a["conv_state_cache"], slot_ids=slots, has_initial_state=has_state,
        activation="silu",
    )  # fmt: skip
    cache = np.asarray(a["ssm_state_cache"], np.float64)
    live = slots >= 0
    initial = np.where((live & has_state)[:, None, None, None], cache[np.maximum(slots, 0)], 0)
    dead = dead_rows(T, qsl, slots)
    xbc = np.where(dead[:, None], 0.0, xbc)  # the padding rows' NaN stays out of the oracle
    dt = np.where(dead[:, None], 0.0, dt)
    z = np.where(dead[:, None], 0.0, z)
    y, final = ssd_oracle(
        xbc[:, :d_inner].reshape(T, H, P), dt, -np.exp(np.asarray(a["A_log"], np.float64)),
        xbc[:, d_inner : d_inner + gn].reshape(T, groups, N),
        xbc[:, d_inner + gn :].reshape(T, groups, N),
        query_start_loc=qsl, D=o["D"], dt_bias=o["dt_bias"], dt_softplus=True,
        z=z.reshape(T, H, P) if norm_weight is None and gate else None,
        initial_states=initial,
    )  # fmt: skip
    ssm_cache = cache.copy()
    for b, slot in enumerate(slots):
        if slot >= 0 and qsl[b + 1] > qsl[b]:
            ssm_cache[slot] = final[b]
    y = y.reshape(T, d_inner)
    if norm_weight is not None:
        y = gated_rms_norm_oracle(
            y, z, norm_weight,
            group_size=norm_group_size or d_inner // groups, norm_before_gate=norm_before_gate,
        )  # fmt: skip
    return np.where(dead[:, None], 0.0, y), conv_cache, ssm_cache


def run(impl, arrays, **options):
    a = arrays
    return mamba2_prefill(
        a["zxbcdt"],
        a["conv_state_cache"],
        a["conv_weight"],
        a["conv_bias"],
        a["ssm_state_cache"],
        a["A_log"],
        implementation=impl,
        **options,
    )


def check(arrays, out, *, groups, rtol, **options):
    y, conv_cache, ssm_cache = out
    y_ref, conv_ref, ssm_ref = oracle(arrays, groups=groups, **options)
    T = arrays["zxbcdt"].shape[0]
    qsl, slots = np.asarray(options["query_start_loc"]), np.asarray(options["slot_ids"])
    assert y.shape == y_ref.shape and y.dtype == arrays["zxbcdt"].dtype
    dead = dead_rows(T, qsl, slots)
    assert np.all(np.asarray(y)[dead] == 0), "padding and bucket rows must be 0"
    assert np.all(np.isfinite(np.asarray(y, np.float32))), "a poisoned slot was read"
    assert_close_per_row(y, y_ref, rtol=rtol, name="y")
    written = [s for b, s in enumerate(slots) if qsl[b + 1] > qsl[b]]
    check_slot_cache(conv_cache, arrays["conv_state_cache"], conv_ref, written, rtol=rtol,
                     name="conv state")  # fmt: skip
    check_slot_cache(ssm_cache, arrays["ssm_state_cache"], ssm_ref, written, rtol=rtol,
                     name="ssm state")  # fmt: skip


# Sequences: a prompt continuing from its slot, an empty one, a padding sequence with
# tokens, a fresh prompt shorter than the conv width, and one across several chunks; 5
# bucket rows past them.
LENGTHS, SLOTS, HAS_STATE = [13, 0, 6, 2, 19], [3, 1, -1, 0, 5], [True, True, False, False, False]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "groups, norm, conv_bias",
    [
        (1, "after_gate", True),
        (2, "before_gate", False),
        (4, "none", True),
        (1, "none, ungated", False),
    ],
)
def test_matches_oracles(impl, groups, norm, conv_bias):
    """G 1 / 2 / 4; the norm after or before the gate, or none (z gates the scan, or with
    ``gate=False`` nothing does); rows of padding sequences and of the bucket (NaN in)
    give 0; NaN-poisoned slots no sequence names come back bit-identical, as does the slot
    of the empty sequence."""
    arrays, options = make_step(
        LENGTHS, SLOTS, HAS_STATE, groups=groups, num_tokens=45, seed=groups, conv_bias=conv_bias
    )
    if norm.startswith("none"):
        options["norm_weight"] = None
    if norm == "none, ungated":
        options["gate"] = False
    options["norm_before_gate"] = norm == "before_gate"
    out = run(impl, arrays, **options)
    check(arrays, out, groups=groups, rtol=F32_TOL, **options)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_rows_and_norm_groups(impl):
    """bf16 in_proj rows and conv state (fp32 SSM state), a norm group smaller than
    d_inner / G."""
    arrays, options = make_step(
        [9, 17], [4, 2], [True, False], groups=1, num_tokens=32, dtype=jnp.bfloat16, seed=5
    )
    options["norm_group_size"] = H * P // 4
    out = run(impl, arrays, **options)
    check(arrays, out, groups=1, rtol=BF16_TOL, **options)


def test_equals_the_three_ops():
    """The fused call equals causal_conv1d, ssd_scan and gated_rms_norm called one after
    another on the split rows (the mixer's unfused prefill path), bit for bit."""
    arrays, options = make_step(LENGTHS, SLOTS, HAS_STATE, groups=2, num_tokens=45, seed=3)
    # Finite padding rows: the unfused path zeroes y before its norm, so a NaN z there
    # would reach its output (the fused call selects after the norm).
    arrays["zxbcdt"] = jnp.nan_to_num(arrays["zxbcdt"], nan=0.5)
    a, o, impl = arrays, options, "triton"  # interpreted off-GPU
    d_inner, conv_dim = H * P, H * P + 4 * N
    T = a["zxbcdt"].shape[0]
    z, xbc, dt = jnp.split(a["zxbcdt"], [d_inner, d_inner + conv_dim], axis=-1)
    layout = dict(slot_ids=o["slot_ids"], has_initial_state=o["has_initial_state"])
    xbc, conv_cache = pk.causal_conv1d(
        xbc, a["conv_weight"], a["conv_bias"], query_start_loc=o["query_start_loc"],
        conv_state_cache=a["conv_state_cache"], implementation=impl, **layout,
    )  # fmt: skip
    x, B, C = jnp.split(xbc, [d_inner, d_inner + 2 * N], axis=-1)
    y, ssm_cache = pk.ssd_scan(
        x.reshape(T, H, P), dt, -jnp.exp(a["A_log"]), B.reshape(T, 2, N), C.reshape(T, 2, N),
        metadata=o["metadata"], chunk_size=CHUNK, D=o["D"], dt_bias=o["dt_bias"],
        dt_softplus=True, state_cache=a["ssm_state_cache"], implementation=impl, **layout,
    )  # fmt: skip
    y = pk.gated_rms_norm(
        y.reshape(T, d_inner), z, o["norm_weight"], group_size=d_inner // 2, implementation=impl
    )
    fused = run(impl, arrays, **options)
    for got, want in zip(fused, (y, conv_cache, ssm_cache), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("norm", [True, False])
def test_gradients_equal_the_references(norm):
    """The Pallas step's VJP (recomputed through the three ops' kernels on the split rows)
    equals the ``xla`` backend's, in every differentiable input."""
    arrays, options = make_step(
        [13, 6, 19], [3, -1, 5], [True, False, False], groups=2, num_tokens=40, seed=7
    )
    arrays["zxbcdt"] = jnp.nan_to_num(arrays["zxbcdt"], nan=0.5)
    for cache in ("conv_state_cache", "ssm_state_cache"):
        arrays[cache] = jnp.nan_to_num(arrays[cache], nan=0.25)
    if not norm:
        options["norm_weight"] = None
    names = ["zxbcdt", "conv_state_cache", "conv_weight", "conv_bias", "ssm_state_cache", "A_log"]
    extra = ["D", "dt_bias"] + (["norm_weight"] if norm else [])
    weights = [normal(np.random.default_rng(i), s.shape) for i, s in enumerate(
        run("xla", arrays, **options))]  # fmt: skip

    def loss(impl, *values):
        a = dict(zip(names, values[: len(names)], strict=True))
        o = options | dict(zip(extra, values[len(names) :], strict=True))
        outs = run(impl, a, **o)
        return sum(
            jnp.sum(w * out.astype(jnp.float32)) for w, out in zip(weights, outs, strict=True)
        )

    values = [arrays[n] for n in names] + [options[n] for n in extra]
    argnums = tuple(range(len(values)))
    want = jax.grad(lambda *v: loss("xla", *v), argnums)(*values)
    got = jax.grad(lambda *v: loss("triton", *v), argnums)(*values)
    for name, g, w in zip(names + extra, got, want, strict=True):
        scale = float(jnp.max(jnp.abs(w))) or 1.0
        err = float(jnp.max(jnp.abs(g - w))) / scale
        assert err < 1e-4, f"d{name}: {err:.2e} of its largest entry"


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(zxbcdt=jnp.zeros((45, 10))), "zxbcdt must have shape"),
        (dict(query_start_loc=jnp.zeros((2, 3), jnp.int32)), "query_start_loc must have"),
        (dict(has_initial_state=jnp.zeros(3, bool)), "has_initial_state"),
        (dict(chunk_size=16), "chunk"),
        (dict(config=mamba_prefill_config.BlockSizes(
            conv=conv_config.BlockSizes(block_d=128))), "block_d=128 must divide"),
    ],
)  # fmt: skip
def test_bad_arguments(change, match):
    arrays, options = make_step(LENGTHS, SLOTS, HAS_STATE, groups=1, num_tokens=45)
    arrays = arrays | {k: v for k, v in change.items() if k in arrays}
    options = options | {k: v for k, v in change.items() if k not in arrays}
    impl = "triton" if "config" in change else "xla"
    with pytest.raises(ValueError, match=match):
        run(impl, arrays, **options)


def test_internal_lowers_without_column_copies():
    """Bamba-9B's prefill mixer (chunk 256, 4k tokens): the conv reading in_proj's rows
    and writing x and ``B | C`` apart, and the norm reading z from in_proj's rows and
    zeroing padding rows, lower for CUDA; and the step copies no slice as wide as d_inner
    outside its kernels (in_proj's z and xBC and the conv output's x reach the kernels
    where they lie)."""
    S, H, P, N, G, K, T, Bs = 8, 128, 64, 128, 1, 4, 4096, 4
    d_inner, conv_dim = H * P, H * P + 2 * G * N
    config = mamba_prefill_config.default_block_sizes(spec((conv_dim, K)), d_inner, d_inner)
    layout = (spec((Bs + 1,), jnp.int32), spec((Bs,), jnp.int32), spec((Bs,), jnp.bool_))
    rows, conv_cache = spec((T, d_inner + conv_dim + H)), spec((S, K - 1, conv_dim))

    def conv_step(zxbcdt, conv_cache, conv_weight, qsl, slots, has):
        return conv_triton.prefill(
            zxbcdt, conv_weight, None, query_start_loc=qsl, conv_state_cache=conv_cache,
            slot_ids=slots, has_initial_state=has, activation="silu", config=config.conv,
            interpret=False, x_col0=d_inner, split=d_inner,
        )  # fmt: skip

    text = lower_for_cuda(conv_step, rows, conv_cache, spec((conv_dim, K)), *layout)
    assert f"causal_conv1d_k4_bt{config.conv.block_t}" in text and f"_split{d_inner}" in text

    def norm_step(y, zxbcdt, weight, live):
        return norm_triton.forward(
            y, zxbcdt, weight, group_size=d_inner, eps=1e-5, norm_before_gate=False,
            config=config.norm, live_rows=live,
        )  # fmt: skip

    args = (spec((T, d_inner)), rows, spec((d_inner,)), spec((T,), jnp.bool_))
    assert "gated_rms_norm" in lower_for_cuda(norm_step, *args)

    metadata = jax.eval_shape(
        lambda qsl: pk.chunk_metadata(
            qsl, jnp.zeros(Bs, jnp.int32), chunk_size=256,
            max_chunks=pk.max_chunks_for(T, Bs, 256),
        ),
        layout[0],
    )  # fmt: skip

    def step(
        zxbcdt, conv_cache, conv_weight, ssm_cache, A_log, qsl, slots, has, D, dt_bias, w, gate=True
    ):
        return mamba2_prefill(
            zxbcdt, conv_cache, conv_weight, None, ssm_cache, A_log, query_start_loc=qsl,
            metadata=metadata, chunk_size=256, slot_ids=slots, has_initial_state=has, D=D,
            dt_bias=dt_bias, dt_softplus=True, norm_weight=w, gate=gate,
            implementation="triton",
        )  # fmt: skip

    args = (
        rows, conv_cache, spec((conv_dim, K)), spec((S, H, P, N), jnp.float32),
        spec((H,), jnp.float32), *layout, spec((H,), jnp.float32), spec((H,), jnp.float32),
        spec((d_inner,)),
    )  # fmt: skip

    def wide_copies(step, kinds=("slice", "dynamic_slice", "select_n", "concatenate", "copy")):
        return [
            (eqn.primitive.name, var.aval.shape)
            for eqn in eqns_outside_kernels(jax.make_jaxpr(step)(*args).jaxpr)
            for var in eqn.outvars
            if eqn.primitive.name in kinds and math.prod(var.aval.shape) >= T * d_inner
        ]

    assert not wide_copies(step)
    # Without the norm and ungated (a tp mixer whose norm group spans its devices gates and
    # norms y itself): the scan takes no z, so no column is copied either. (A select over y
    # zeroes the padding rows, the norm's job otherwise; XLA fuses it into the caller's.)
    assert not wide_copies(
        lambda *a: step(*a[:-1], None, gate=False), ("slice", "dynamic_slice", "concatenate")
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "groups, norm, gate", [(1, True, True), (8, False, True), (1, False, False)]
)
def test_gpu_real_sizes(groups, norm, gate):
    """Bamba-9B's mixer (H 128, P 64, N 128, K 4, chunk 256), bf16 rows, fp32 states, 16
    sequences of 1-1000 tokens in a 16k bucket; ``auto`` (the Mosaic scan on Hopper)."""
    rng = np.random.default_rng(groups)
    lengths = [int(n) for n in rng.integers(1, 1000, 16)]
    slots = list(rng.permutation(40)[:16])
    slots[5] = -1
    has_state = list(rng.random(16) < 0.5)
    arrays, options = make_step(
        lengths, slots, has_state, groups=groups, num_tokens=16384, num_slots=40, heads=128,
        head_dim=64, state_dim=128, chunk_size=256, dtype=jnp.bfloat16, seed=groups,
    )  # fmt: skip
    if not norm:
        options["norm_weight"] = None
    options["gate"] = gate
    out = run("auto", arrays, **options)
    check(arrays, out, groups=groups, rtol=BF16_TOL, **options)
