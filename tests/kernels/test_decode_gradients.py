"""Gradients of the decode steps (DESIGN.md §8 "Gradients": every op, every implementation):
``selective_state_update``, ``causal_conv1d_update`` and ``mamba2_decode`` against central
finite differences of their float64 oracles, the Pallas backends against the ``xla`` path's
``jax.grad``, through their own Pallas backward kernels (``jax.custom_vjp``).

Before these backward kernels the Triton forwards had no differentiation rule (a
``pallas_call`` that updates its cache in place cannot be linearised: "JVP with aliasing
not supported"). Shapes are tiny, not powers of two (masked tiles): every Triton kernel
runs in interpret mode on the CPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.conv1d import api as conv_api
from pallas_kernels.conv1d import triton as conv_triton
from pallas_kernels.conv1d import triton_config as conv_config
from pallas_kernels.mamba_decode import api as mamba_decode_api
from pallas_kernels.state_update import api as state_update_api
from pallas_kernels.state_update import triton as state_update_triton
from pallas_kernels.state_update import triton_config as state_update_config
from pallas_kernels.testing import (
    assert_close,
    causal_conv1d_update_oracle,
    selective_state_update_oracle,
    vjp_errors,
)
from tests.helpers import as_f32, implementations, lower_for_cuda, normal, pallas_call_names, spec
from tests.kernels import test_mamba_decode

# fp32 rounding of the kernels' sums scores ~1e-7 (``vjp_errors``); a wrong term is O(1).
FD_TOL = 1e-5
XLA_TOL = 1e-5
SLOTS = np.array([2, -1, 0], np.int32)  # a padding row; slots 1, 3 and 4 are not named
NUM_SLOTS = 5
UNNAMED = [1, 3, 4]


def _check(grads, names, primals, oracle, cotangent, xla_grads):
    for name, g, p in zip(names, grads, primals, strict=True):
        assert g.shape == p.shape and g.dtype == p.dtype, name
    errors = vjp_errors(oracle, tuple(as_f32(p) for p in primals), cotangent, grads)
    for i, name in enumerate(names):
        assert errors[i] <= FD_TOL, f"{name}: finite-difference error {errors[i]:.2e}"
    if xla_grads is not None:
        for name, g, ref in zip(names, grads, xla_grads, strict=True):
            assert_close(as_f32(g), as_f32(ref), rtol=XLA_TOL, name=f"{name} vs xla")


# ------------------------------------------------------------------- selective_state_update

# P and N not powers of two: masked tiles; P = 40 is three 16-row blocks of the backward
# (its 130 state columns pad to 256), so the sums over blocks are exercised.
SSU_H, SSU_P, SSU_N, SSU_G = 4, 40, 130, 2
# (D's shape or None, gated, dt_softplus, dt_limit, dt_bias): a head-wise D with the z gate
# and softplus; a per-channel D, no gate, a clamp both sides (some dt' held at a limit); no
# D and no dt_bias.
SSU_CASES = {
    "D_head_gated": ((SSU_H,), True, True, (0.0, float("inf")), True),
    "D_channel_clamped": ((SSU_H, SSU_P), False, False, (0.1, 0.9), True),
    "bare": (None, False, True, (0.0, float("inf")), False),
}


def _ssu_inputs(case: str, seed: int = 0):
    D_shape, gated, _, _, has_bias = SSU_CASES[case]
    rng = np.random.default_rng(seed)
    R = len(SLOTS)
    primals = dict(
        state_cache=normal(rng, (NUM_SLOTS, SSU_H, SSU_P, SSU_N)),
        x=normal(rng, (R, SSU_H, SSU_P)),
        dt=normal(rng, (R, SSU_H)),
        A=-jnp.asarray(np.exp(rng.normal(size=SSU_H)), jnp.float32),
        B=normal(rng, (R, SSU_G, SSU_N)),
        C=normal(rng, (R, SSU_G, SSU_N)),
    )
    if D_shape is not None:
        primals["D"] = normal(rng, D_shape)
    if has_bias:
        primals["dt_bias"] = normal(rng, (SSU_H,), scale=0.5)
    if gated:
        primals["z"] = normal(rng, (R, SSU_H, SSU_P))
    cotangent = (normal(rng, (R, SSU_H, SSU_P)), normal(rng, primals["state_cache"].shape))
    return primals, cotangent


def _ssu_call(case: str, impl: str, names):
    _, _, dt_softplus, dt_limit, _ = SSU_CASES[case]

    def f(*values):
        a = dict(zip(names, values, strict=True))
        return pk.selective_state_update(
            *(a[k] for k in ("state_cache", "x", "dt", "A", "B", "C")),
            slot_ids=SLOTS,
            D=a.get("D"),
            z=a.get("z"),
            dt_bias=a.get("dt_bias"),
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            implementation=impl,
        )

    return f


@pytest.mark.parametrize("case", list(SSU_CASES))
@pytest.mark.parametrize("impl", implementations(state_update_api.SELECTIVE_STATE_UPDATE))
def test_internal_selective_state_update_gradients(impl, case):
    """Every float input's gradient (the cache's from the cotangents of y and of the new
    cache) against finite differences of the float64 oracle and, for Pallas backends, the
    xla path's; the padding row's inputs get exactly 0 and slots no row names pass their
    cotangent through."""
    primals, cotangent = _ssu_inputs(case)
    names = tuple(primals)
    values = tuple(primals.values())
    _, vjp = jax.vjp(_ssu_call(case, impl, names), *values)
    grads = vjp(cotangent)
    g = dict(zip(names, grads, strict=True))
    for name in ("x", "dt", "B", "C", "z"):
        if name in g:
            np.testing.assert_array_equal(as_f32(g[name])[1], 0.0, err_msg=name)
    dcache = as_f32(cotangent[1])
    np.testing.assert_array_equal(as_f32(g["state_cache"])[UNNAMED], dcache[UNNAMED])
    _, _, dt_softplus, dt_limit, _ = SSU_CASES[case]

    def oracle(*values):
        a = dict(zip(names, values, strict=True))
        return selective_state_update_oracle(
            *(a[k] for k in ("state_cache", "x", "dt", "A", "B", "C")),
            slot_ids=SLOTS,
            D=a.get("D"),
            z=a.get("z"),
            dt_bias=a.get("dt_bias"),
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
        )

    xla = None
    if impl != "xla":
        xla = jax.vjp(_ssu_call(case, "xla", names), *values)[1](cotangent)
    _check(grads, names, values, oracle, tuple(as_f32(c) for c in cotangent), xla)


def test_selective_state_update_clamp_ties_split_as_xla():
    """dt' exactly at a clamp limit and dt' A exactly 0 (A = 0): the Triton backward
    splits the gradient in half there, as jax.grad of the xla path's jnp.clip and
    jnp.minimum do (before: 0 at both limits, and the full decay derivative at 0)."""
    R, H, P, N = 3, 4, 8, 16
    rng = np.random.default_rng(11)
    cache = normal(rng, (NUM_SLOTS, H, P, N))
    x, B, C = normal(rng, (R, H, P)), normal(rng, (R, 1, N)), normal(rng, (R, 1, N))
    # Below, at the lower limit, inside, at the upper limit, above; one head has A = 0.
    dt = jnp.asarray([[-1.0, 0.0, 0.25, 0.5], [0.5, 1.0, 0.0, 0.3], [0.2, 0.2, 0.2, 0.2]])
    A = jnp.asarray([-1.0, -0.5, 0.0, -2.0])
    cotangent = (normal(rng, (R, H, P)), normal(rng, cache.shape))

    def grads(impl):
        def f(cache, x, dt, A, B, C):
            return pk.selective_state_update(
                cache, x, dt, A, B, C, slot_ids=SLOTS, dt_limit=(0.0, 0.5), implementation=impl
            )

        return jax.vjp(f, cache, x, dt, A, B, C)[1](cotangent)

    names = ("dcache", "dx", "ddt", "dA", "dB", "dC")
    for name, g, ref in zip(names, grads("triton"), grads("xla"), strict=True):
        assert_close(as_f32(g), as_f32(ref), rtol=XLA_TOL, name=name)


@pytest.mark.parametrize(
    "cache_dtype", [jnp.float32, jnp.bfloat16], ids=["f32_cache", "bf16_cache"]
)
def test_decode_gradients_in_bf16(cache_dtype):
    """bf16 inputs (and a bf16 or fp32 cache): every gradient comes back in its input's
    dtype, close to the xla path's (the backward computes in fp32 from the same bf16
    values)."""
    rng = np.random.default_rng(12)
    R, H, P, N = 3, 4, 8, 16
    bf16 = jnp.bfloat16
    cache = normal(rng, (NUM_SLOTS, H, P, N), cache_dtype)
    x, z = normal(rng, (R, H, P), bf16), normal(rng, (R, H, P), bf16)
    dt, A = normal(rng, (R, H), bf16), -jnp.asarray(np.exp(rng.normal(size=H)), jnp.float32)
    B, C = normal(rng, (R, 1, N), bf16), normal(rng, (R, 1, N), bf16)
    cotangent = (normal(rng, (R, H, P), bf16), normal(rng, cache.shape, cache_dtype))

    def grads(impl):
        def f(cache, x, dt, A, B, C, z):
            return pk.selective_state_update(
                cache, x, dt, A, B, C, slot_ids=SLOTS, z=z, dt_softplus=True, implementation=impl
            )

        return jax.vjp(f, cache, x, dt, A, B, C, z)[1](cotangent)

    primals = (cache, x, dt, A, B, C, z)
    for i, (g, ref) in enumerate(zip(grads("triton"), grads("xla"), strict=True)):
        assert g.dtype == primals[i].dtype, i
        assert_close(as_f32(g), as_f32(ref), rtol=2e-2, name=f"input {i}")


# --------------------------------------------------------------------- causal_conv1d_update

CONV_DIM, CONV_K = 10, 4


# (steps, activation, bias): one token (x[Bd, dim]), L = 2 < K - 1 (the new state keeps old
# columns) with SiLU and a bias, L = 5 > K - 1 linear without one.
CONV_CASES = {
    "one_token": (None, "silu", True),
    "L2": (2, "silu", True),
    "L5_linear": (5, None, False),
}


@pytest.mark.parametrize("case", list(CONV_CASES))
@pytest.mark.parametrize("impl", implementations(conv_api.CAUSAL_CONV1D_UPDATE))
def test_internal_causal_conv1d_update_gradients(impl, case):
    """dx, the conv state cache's, dweight and dbias for one token per row (``x[Bd, dim]``)
    and ``L`` tokens, fewer and more than the ``K - 1`` history columns (fewer: the new
    state keeps some old columns), with and without SiLU and a bias, against finite
    differences of the float64 oracle and the xla path's; padding rows get 0, slots no row
    names pass their cotangent through."""
    steps, activation, has_bias = CONV_CASES[case]
    rng = np.random.default_rng(3)
    R = len(SLOTS)
    x_shape = (R, CONV_DIM) if steps is None else (R, steps, CONV_DIM)
    x = normal(rng, x_shape)
    cache = normal(rng, (NUM_SLOTS, CONV_K - 1, CONV_DIM))
    weight = normal(rng, (CONV_DIM, CONV_K), scale=0.5)
    primals = (x, cache, weight) + ((normal(rng, (CONV_DIM,), scale=0.5),) if has_bias else ())
    cotangent = (normal(rng, x_shape), normal(rng, cache.shape))

    def call(impl):
        def f(x, cache, weight, bias=None):
            return pk.causal_conv1d_update(
                x, cache, weight, bias, slot_ids=SLOTS, activation=activation, implementation=impl
            )

        return jax.vjp(f, *primals)[1](cotangent)

    grads = call(impl)
    np.testing.assert_array_equal(as_f32(grads[0])[1], 0.0)
    np.testing.assert_array_equal(as_f32(grads[1])[UNNAMED], as_f32(cotangent[1])[UNNAMED])

    def oracle(x, cache, weight, bias=None):
        return causal_conv1d_update_oracle(
            x, cache, weight, bias, slot_ids=SLOTS, activation=activation
        )

    xla = call("xla") if impl != "xla" else None
    names = ("dx", "dcache", "dweight", "dbias")[: len(primals)]
    cotangent32 = tuple(as_f32(c) for c in cotangent)
    _check(grads, names, primals, oracle, cotangent32, xla)


# ---------------------------------------------------------------------------- mamba2_decode

MD_NAMES = ("zxbcdt", "conv_state_cache", "conv_weight", "conv_bias", "ssm_state_cache",
            "A_log", "D", "dt_bias", "norm_weight")  # fmt: skip


@pytest.mark.parametrize("normed", [True, False], ids=["norm", "gate_in_update"])
@pytest.mark.parametrize("impl", implementations(mamba_decode_api.MAMBA2_DECODE))
def test_internal_mamba2_decode_gradients(impl, normed):
    """The fused decode step's gradients in every float input (with the gated norm, and
    with the z gate applied by the state update), against finite differences of the three
    ops' float64 oracles on the split row and the xla path's."""
    arrays, options = test_mamba_decode.make_step(len(SLOTS), groups=2, slots=NUM_SLOTS)
    primals = {**arrays, "D": options["D"], "dt_bias": options["dt_bias"]}
    if normed:
        primals["norm_weight"] = options["norm_weight"]
    names = tuple(k for k in MD_NAMES if k in primals)
    values = tuple(primals[k] for k in names)
    rng = np.random.default_rng(4)
    d_inner = arrays["ssm_state_cache"].shape[1] * arrays["ssm_state_cache"].shape[2]
    cotangent = (
        normal(rng, (len(SLOTS), d_inner)),
        normal(rng, arrays["conv_state_cache"].shape),
        normal(rng, arrays["ssm_state_cache"].shape),
    )

    def split(values):
        a = dict(zip(names, values, strict=True))
        arrays = {k: a[k] for k in MD_NAMES[:6]}
        return arrays, dict(D=a["D"], dt_bias=a["dt_bias"], norm_weight=a.get("norm_weight"))

    def call(impl):
        def f(*values):
            arrays, opts = split(values)
            return test_mamba_decode.run(impl, arrays, SLOTS, dt_softplus=True, **opts)

        return jax.vjp(f, *values)[1](cotangent)

    def oracle(*values):
        arrays, opts = split(values)
        return test_mamba_decode.oracle(arrays, SLOTS, groups=2, dt_softplus=True, **opts)

    grads = call(impl)
    np.testing.assert_array_equal(as_f32(grads[0])[1], 0.0)  # the padding row's in_proj row
    xla = call("xla") if impl != "xla" else None
    _check(grads, names, values, oracle, tuple(as_f32(c) for c in cotangent), xla)


def test_decode_backward_runs_its_own_kernels():
    """The Triton backends differentiate through their own backward kernels: the fused
    step's backward runs the conv update's, the state update's and the gated norm's."""
    arrays, options = test_mamba_decode.make_step(len(SLOTS), groups=2, slots=NUM_SLOTS)

    def loss(zxbcdt, conv_cache, ssm_cache):
        a = {**arrays, "zxbcdt": zxbcdt, "conv_state_cache": conv_cache}
        a["ssm_state_cache"] = ssm_cache
        y, c, s = test_mamba_decode.run("triton", a, SLOTS, **options)
        return jnp.sum(y * y) + jnp.sum(c) + jnp.sum(s * s)

    args = (arrays["zxbcdt"], arrays["conv_state_cache"], arrays["ssm_state_cache"])
    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(*args).jaxpr
    kernels = " ".join(pallas_call_names(jaxpr))
    for name in ("causal_conv1d_update_bwd", "selective_state_update_bwd", "gated_rms_norm_bwd"):
        assert name in kernels, kernels


def test_internal_decode_backward_kernels_lower_for_cuda():
    """The backward kernels lower for CUDA at Bamba-9B's sizes (interpret mode does not
    enforce Triton's rules): 128 heads of 64 × 128 fp32 states, with softplus, D[H] and
    the gate, and without softplus, with a two-sided clamp and D[H, P] (whose clamp mask
    once multiplied a bool into a float: a lowering error only the GPU run showed); a
    8448-channel conv."""
    R, S, H, P, N, G = 4, 8, 128, 64, 128, 1
    f32 = jnp.float32
    cache = spec((S, H, P, N), f32)
    cfg = state_update_config.default_block_sizes(P, N, rows=R, num_heads=H)
    for dt_softplus, dt_limit, D_shape, gated in (
        (True, (0.0, float("inf")), (H,), True),
        (False, (0.1, 0.9), (H, P), False),
    ):
        update = functools.partial(
            state_update_triton.selective_state_update,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            config=cfg,
        )

        def ssu(cache, x, dt, A, B, C, slots, D, z, bias, dy, dcache, update=update):
            f = functools.partial(update, slot_ids=slots)
            _, vjp = jax.vjp(lambda *a: f(*a[:6], D=a[6], z=a[7], dt_bias=a[8]),
                             cache, x, dt, A, B, C, D, z, bias)  # fmt: skip
            return vjp((dy, dcache))

        z = spec((R, H, P)) if gated else None
        text = lower_for_cuda(
            ssu, cache, spec((R, H, P)), spec((R, H)), spec((H,), f32), spec((R, G, N)),
            spec((R, G, N)), spec((R,), jnp.int32), spec(D_shape, f32), z,
            spec((H,), f32), spec((R, H, P)), cache,
        )  # fmt: skip
        assert "selective_state_update_bwd" in text

    dim, K = 8448, 4
    conv = functools.partial(
        conv_triton.causal_conv1d_update,
        activation="silu",
        config=conv_config.default_update_block_sizes(dim),
    )

    def conv_grads(x, cache, w, b, slots, dy, dcache):
        _, vjp = jax.vjp(lambda *a: conv(*a, slot_ids=slots), x, cache, w, b)
        return vjp((dy, dcache))

    conv_cache = spec((S, K - 1, dim))
    text = lower_for_cuda(
        conv_grads, spec((R, 1, dim)), conv_cache, spec((dim, K), f32), spec((dim,), f32),
        spec((R,), jnp.int32), spec((R, 1, dim)), conv_cache,
    )  # fmt: skip
    assert "causal_conv1d_update_bwd" in text
