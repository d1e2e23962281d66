"""mamba2_decode against the float64 oracles of its three ops on the split row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mamba2_decode
from pallas_kernels.mamba_decode import api as mamba_decode_api
from pallas_kernels.testing import (
    assert_close_per_row,
    causal_conv1d_update_oracle,
    gated_rms_norm_oracle,
    selective_state_update_oracle,
)
from tests.helpers import (
    check_out_of_range_slots_are_padding,
    check_slot_cache,
    implementations,
    normal,
    poison_slots,
)

IMPLS = implementations(mamba_decode_api.MAMBA2_DECODE)
F32_TOL, BF16_TOL = 1e-5, 2e-2
H, P, N, K = 4, 8, 8, 4  # heads, head dim, state size, conv width


def make_step(
    rows,
    *,
    groups,
    slots=6,
    heads=H,
    head_dim=P,
    state_dim=N,
    dtype=jnp.float32,
    seed=0,
    conv_bias=True,
):
    """Arrays of one decode step: in_proj rows z | x | B | C | dt, both caches, weights."""
    H, P, N = heads, head_dim, state_dim
    rng = np.random.default_rng(seed)
    conv_dim = H * P + 2 * groups * N
    arrays = dict(
        zxbcdt=normal(rng, (rows, H * P + conv_dim + H), dtype),
        conv_state_cache=normal(rng, (slots, K - 1, conv_dim), dtype),
        conv_weight=normal(rng, (conv_dim, K), scale=0.5),
        conv_bias=normal(rng, (conv_dim,), scale=0.5) if conv_bias else None,
        ssm_state_cache=normal(rng, (slots, H, P, N)),
        A_log=jnp.asarray(rng.normal(size=H), jnp.float32),
    )
    options = dict(
        D=normal(rng, (H,)),
        dt_bias=normal(rng, (H,), scale=0.5),
        dt_softplus=True,
        norm_weight=1.0 + normal(rng, (H * P,), scale=0.2),
    )
    return arrays, options


def oracle(
    arrays,
    slot_ids,
    *,
    groups,
    norm_weight,
    norm_group_size=None,
    norm_before_gate=False,
    gate=True,
    **options,
):
    """The conv update, state update and gated norm oracles on the split row (without a
    norm, y gated by silu(z) unless ``gate`` is False)."""
    a = arrays
    rows = a["zxbcdt"].shape[0]
    H, P, N = a["ssm_state_cache"].shape[1:]
    d_inner, gn = H * P, groups * N
    conv_dim = d_inner + 2 * gn
    row = np.asarray(a["zxbcdt"], np.float64)
    z, xbc, dt = row[:, :d_inner], row[:, d_inner : d_inner + conv_dim], row[:, -H:]
    xbc, conv_cache = causal_conv1d_update_oracle(
        xbc, a["conv_state_cache"], a["conv_weight"], a["conv_bias"], slot_ids=slot_ids,
        activation="silu",
    )  # fmt: skip
    y, ssm_cache = selective_state_update_oracle(
        a["ssm_state_cache"],
        xbc[:, :d_inner].reshape(rows, H, P),
        dt,
        -np.exp(np.asarray(a["A_log"], np.float64)),
        xbc[:, d_inner : d_inner + gn].reshape(rows, groups, N),
        xbc[:, d_inner + gn :].reshape(rows, groups, N),
        slot_ids=slot_ids,
        z=z.reshape(rows, H, P) if norm_weight is None and gate else None,
        **options,
    )
    y = y.reshape(rows, d_inner)
    if norm_weight is not None:
        y = gated_rms_norm_oracle(
            y, z, norm_weight, group_size=norm_group_size or d_inner // groups,
            norm_before_gate=norm_before_gate,
        )  # fmt: skip
    return y, conv_cache, ssm_cache


def run(impl, arrays, slot_ids, **options):
    a = arrays
    return mamba2_decode(
        a["zxbcdt"],
        a["conv_state_cache"],
        a["conv_weight"],
        a["conv_bias"],
        a["ssm_state_cache"],
        a["A_log"],
        slot_ids=jnp.asarray(slot_ids, jnp.int32),
        implementation=impl,
        **options,
    )


def check(arrays, slots, out, *, groups, rtol, **options):
    y, conv_cache, ssm_cache = out
    y_ref, conv_ref, ssm_ref = oracle(arrays, slots, groups=groups, **options)
    d_inner = np.prod(arrays["ssm_state_cache"].shape[1:3])
    assert y.shape == (len(slots), d_inner) and y.dtype == arrays["zxbcdt"].dtype
    assert np.all(np.isfinite(np.asarray(y, np.float32))), "a poisoned slot was read"
    assert_close_per_row(y, y_ref, rtol=rtol, name="y")
    assert np.all(np.asarray(y)[np.asarray(slots) < 0] == 0), "padding rows must be 0"
    check_slot_cache(conv_cache, arrays["conv_state_cache"], conv_ref, slots, rtol=rtol,
                     name="conv state")  # fmt: skip
    check_slot_cache(ssm_cache, arrays["ssm_state_cache"], ssm_ref, slots, rtol=rtol,
                     name="ssm state")  # fmt: skip


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
    """G 1 / 2 / 4; the norm after or before the gate, or none (z gates the state update,
    or with ``gate=False`` nothing does); padding rows give 0 and NaN-poisoned slots no row
    names come back bit-identical."""
    arrays, options = make_step(4, groups=groups, seed=groups, conv_bias=conv_bias)
    if norm.startswith("none"):
        options["norm_weight"] = None
    if norm == "none, ungated":
        options["gate"] = False
    options["norm_before_gate"] = norm == "before_gate"
    slots = [3, -1, 0, 5]
    for cache in ("conv_state_cache", "ssm_state_cache"):
        arrays[cache] = poison_slots(arrays[cache], slots)
    out = run(impl, arrays, slots, **options)
    check(arrays, slots, out, groups=groups, rtol=F32_TOL, **options)


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_rows_and_norm_groups(impl):
    """bf16 in_proj rows and conv state (fp32 SSM state), a norm group smaller than
    d_inner / G."""
    arrays, options = make_step(3, groups=1, dtype=jnp.bfloat16, seed=5)
    options["norm_group_size"] = H * P // 4
    slots = [2, 4, -1]
    out = run(impl, arrays, slots, **options)
    check(arrays, slots, out, groups=1, rtol=BF16_TOL, **options)


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_slot_ids_are_padding(impl):
    arrays, options = make_step(3, groups=2, slots=5, seed=9)
    step = jax.jit(
        lambda slot_ids: mamba2_decode(
            arrays["zxbcdt"], arrays["conv_state_cache"], arrays["conv_weight"],
            arrays["conv_bias"], arrays["ssm_state_cache"], arrays["A_log"], slot_ids=slot_ids,
            implementation=impl, **options,
        )
    )  # fmt: skip

    def run_ids(slot_ids):
        y, conv_cache, ssm_cache = step(jnp.asarray(slot_ids))
        return (y,), (conv_cache, ssm_cache)

    (y,), caches = check_out_of_range_slots_are_padding(run_ids, [1, 4, 0], 1, num_slots=5)
    check(arrays, [1, -1, 0], (y, *caches), groups=2, rtol=F32_TOL, **options)


def test_equals_the_three_ops():
    """The fused call equals causal_conv1d_update, selective_state_update (given A =
    -exp(A_log)) and gated_rms_norm called one after another on the split row (the mixer's
    unfused decode path): the caches bit for bit where both exponentials are XLA's."""
    import pallas_kernels as pk

    arrays, options = make_step(4, groups=2, seed=3)
    a, slots = arrays, jnp.array([5, 1, -1, 2], jnp.int32)
    d_inner, conv_dim = H * P, H * P + 4 * N
    impl = "triton"  # interpreted off-GPU
    z, xbc, dt = jnp.split(a["zxbcdt"], [d_inner, d_inner + conv_dim], axis=-1)
    xbc, conv_cache = pk.causal_conv1d_update(
        xbc, a["conv_state_cache"], a["conv_weight"], a["conv_bias"], slot_ids=slots,
        implementation=impl,
    )  # fmt: skip
    x, B, C = jnp.split(xbc, [d_inner, d_inner + 2 * N], axis=-1)
    y, ssm_cache = pk.selective_state_update(
        a["ssm_state_cache"], x.reshape(4, H, P), dt, -jnp.exp(a["A_log"]), B.reshape(4, 2, N),
        C.reshape(4, 2, N), slot_ids=slots, D=options["D"], dt_bias=options["dt_bias"],
        dt_softplus=True, implementation=impl,
    )  # fmt: skip
    y = pk.gated_rms_norm(
        y.reshape(4, d_inner), z, options["norm_weight"], group_size=d_inner // 2,
        implementation=impl,
    )  # fmt: skip
    fused = run(impl, arrays, slots, **options)
    np.testing.assert_array_equal(np.asarray(fused[1]), np.asarray(conv_cache))
    if jax.default_backend() == "cpu":  # interpreted: the kernel's exp is XLA's
        np.testing.assert_array_equal(np.asarray(fused[2]), np.asarray(ssm_cache))
    else:  # the kernel's -exp(A_log) is Triton's, within an ulp or two of XLA's
        np.testing.assert_allclose(
            np.asarray(fused[2]), np.asarray(ssm_cache), rtol=1e-6, atol=1e-6
        )
    # y: each op runs as one jitted program, so off-GPU XLA compiles the interpreted fused
    # kernel with its wrapper, and its norm rounds up to 2.4e-7 away from gated_rms_norm's
    # (bit-equal before 2026-11-28). On a GPU the kernel is a Triton call either way.
    np.testing.assert_allclose(np.asarray(fused[0]), np.asarray(y), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(conv_weight=jnp.zeros((H * P + 3, K))), "conv_weight must have shape"),
        (dict(zxbcdt=jnp.zeros((2, 10))), "zxbcdt must have shape"),
        (dict(conv_state_cache=jnp.zeros((4, K - 1, H * P + 2 * N))), "the same slots"),
        (dict(A_log=jnp.zeros((H + 1,))), "A_log must have shape"),
    ],
)
def test_bad_arguments(change, match):
    arrays, options = make_step(2, groups=1)
    with pytest.raises(ValueError, match=match):
        run("xla", arrays | change, [0, 1], **options)


def test_bad_norm_group_size():
    arrays, options = make_step(2, groups=1)
    with pytest.raises(ValueError, match="norm_group_size"):
        run("xla", arrays, [0, 1], norm_group_size=5, **options)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "rows, groups, norm, gate",
    [(1, 1, True, True), (64, 8, False, True), (256, 1, True, True), (256, 8, False, True),
     (256, 1, False, False)],
)  # fmt: skip
def test_gpu_real_sizes(rows, groups, norm, gate):
    """Bamba-9B's mixer (H 128, P 64, N 128, K 4), bf16 rows, fp32 states; with the norm,
    with z gating the state update (its own tiling at many rows), or neither (a tp mixer's
    ungated update)."""
    arrays, options = make_step(
        rows, groups=groups, slots=2 * rows + 1, heads=128, head_dim=64, state_dim=128,
        dtype=jnp.bfloat16, seed=rows + groups,
    )  # fmt: skip
    if not norm:
        options["norm_weight"] = None
    options["gate"] = gate
    slots = np.random.default_rng(rows).permutation(2 * rows + 1)[:rows]
    slots[::7] = -1
    for cache in ("conv_state_cache", "ssm_state_cache"):
        arrays[cache] = poison_slots(arrays[cache], slots)
    out = run("triton", arrays, slots, **options)
    check(arrays, slots, out, groups=groups, rtol=BF16_TOL, **options)


@pytest.mark.parametrize("unroll_heads", [False, True])
def test_config_sets_each_kernels_tiling(unroll_heads):
    """``config=`` (DESIGN.md §8) reaches the three kernels: tilings other than their
    defaults (several heads and half the head dim a state-update program, looped or
    unrolled, 2-row norm programs, 8-channel conv blocks) give the oracles' results and show
    in the kernels' names; a config of another type, or with a field of another kernel's
    type, is refused."""
    from pallas_kernels.conv1d import triton_config as conv_config
    from pallas_kernels.mamba_decode import triton_config as mamba_decode_config
    from pallas_kernels.norm import triton_config as norm_config
    from pallas_kernels.state_update import triton_config as state_update_config

    arrays, options = make_step(3, groups=2, seed=11)
    slots = [4, -1, 1]
    config = mamba_decode_config.BlockSizes(
        conv=conv_config.BlockSizes(block_t=4, unroll_t=4, block_d=8, num_warps=1),
        state_update=state_update_config.BlockSizes(
            block_p=4, block_h=2, num_warps=1, unroll_heads=unroll_heads
        ),
        norm=norm_config.BlockSizes(block_rows=2, num_warps=1),
    )
    out = run("triton", arrays, slots, config=config, **options)
    check(arrays, slots, out, groups=2, rtol=F32_TOL, **options)
    jaxpr = str(jax.make_jaxpr(lambda a: run("triton", a, slots, config=config, **options))(arrays))
    state_update = "selective_state_update_bp4_bh2" + ("_unrolled" if unroll_heads else "")
    for kernel in ("causal_conv1d_update_k4_bd8", state_update, "rows2"):
        assert kernel in jaxpr, f"{kernel} not among the step's kernels"
    with pytest.raises(ValueError, match="config of type"):
        run("triton", arrays, slots, config=state_update_config.BlockSizes(), **options)
    with pytest.raises(ValueError, match="state_update="):
        mamba_decode_config.BlockSizes(state_update=norm_config.BlockSizes())
