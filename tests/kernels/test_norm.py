"""``gated_rms_norm`` and ``rms_norm`` against the float64 oracle, for every implementation
in the registry (Pallas kernels in interpret mode off-GPU)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.norm import api
from pallas_kernels.norm import triton as norm_triton
from pallas_kernels.norm import triton_config as norm_config
from pallas_kernels.testing import assert_close, gated_rms_norm_oracle, tolerance_for
from tests.helpers import as_f32, implementations, lower_for_cuda, normal, spec

IMPLS = implementations(api.GATED_RMS_NORM)
DTYPES = (jnp.float32, jnp.bfloat16)

# (T, Dm, group_size): one group, several groups, group_size == Dm, small groups, size 1.
SHAPES = {
    "one_group": (6, 16, 16),
    "four_groups": (6, 16, 4),
    "three_groups": (5, 24, 8),
    "group_size_1": (4, 12, 1),
    "wide_group": (3, 64, 32),
}


# --------------------------------------------------------------------------- helpers


def make_inputs(rng, T, Dm, *, dtype=jnp.float32, gated=True, x_scale=1.0):
    x = normal(rng, (T, Dm), dtype, scale=x_scale)
    z = normal(rng, (T, Dm), dtype, scale=2.0) if gated else None
    weight = jnp.asarray(1.0 + 0.3 * rng.normal(size=Dm), jnp.float32).astype(dtype)
    return x, z, weight


def check_norm(x, z, weight, y, *, rtol=None, **options) -> None:
    ref = gated_rms_norm_oracle(
        as_f32(x), None if z is None else as_f32(z), as_f32(weight), **options
    )
    assert y.shape == x.shape and y.dtype == x.dtype
    assert np.all(np.isfinite(as_f32(y)))
    assert_close(as_f32(y), ref, rtol=rtol or tolerance_for(x.dtype), name="y")


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("gated", [True, False], ids=["z", "no_z"])
@pytest.mark.parametrize("norm_before_gate", [False, True], ids=["gate_first", "norm_first"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_oracle(impl, shape, norm_before_gate, gated, dtype):
    T, Dm, group_size = SHAPES[shape]
    x, z, weight = make_inputs(np.random.default_rng(0), T, Dm, dtype=dtype, gated=gated)
    y = pk.gated_rms_norm(
        x, z, weight, group_size=group_size, norm_before_gate=norm_before_gate, implementation=impl
    )
    check_norm(x, z, weight, y, group_size=group_size, norm_before_gate=norm_before_gate)


@pytest.mark.parametrize("impl", IMPLS)
def test_gate_order_matters(impl):
    """norm_before_gate=True and False differ (the flag is not ignored), each matching
    its own oracle."""
    x, z, weight = make_inputs(np.random.default_rng(1), 6, 16)
    outs = [
        pk.gated_rms_norm(x, z, weight, group_size=4, norm_before_gate=f, implementation=impl)
        for f in (False, True)
    ]
    assert not np.allclose(as_f32(outs[0]), as_f32(outs[1]), rtol=1e-2)
    for flag, y in zip((False, True), outs, strict=True):
        check_norm(x, z, weight, y, group_size=4, norm_before_gate=flag)


@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.5])
@pytest.mark.parametrize("impl", IMPLS)
def test_eps_inside_the_square_root(impl, eps):
    """Small inputs (mean square ~1e-4) make eps = 0.5 dominate the denominator."""
    x, z, weight = make_inputs(np.random.default_rng(2), 5, 16, x_scale=1e-2)
    y = pk.gated_rms_norm(x, z, weight, group_size=8, eps=eps, implementation=impl)
    check_norm(x, z, weight, y, group_size=8, eps=eps)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_statistics_in_fp32(impl, dtype):
    """Inputs ~1e3: their squares (~1e6) overflow float16, so the mean square must be
    accumulated in fp32."""
    x, z, weight = make_inputs(np.random.default_rng(3), 4, 32, dtype=dtype, x_scale=1e3)
    for norm_before_gate in (False, True):
        y = pk.gated_rms_norm(
            x, z, weight, group_size=16, norm_before_gate=norm_before_gate, implementation=impl
        )
        check_norm(x, z, weight, y, group_size=16, norm_before_gate=norm_before_gate)


@pytest.mark.parametrize("impl", IMPLS)
def test_groups_are_independent(impl):
    """Scaling one group of x leaves every other group's output unchanged (and this one's
    too, RMSNorm being scale invariant up to eps)."""
    x, z, weight = make_inputs(np.random.default_rng(4), 3, 16, gated=False)
    norm = functools.partial(pk.gated_rms_norm, group_size=4, eps=0.0, implementation=impl)
    base = as_f32(norm(x, None, weight))
    scaled = as_f32(norm(x.at[:, 4:8].multiply(100.0), None, weight))
    np.testing.assert_array_equal(scaled[:, :4], base[:, :4])
    np.testing.assert_array_equal(scaled[:, 8:], base[:, 8:])
    np.testing.assert_allclose(scaled[:, 4:8], base[:, 4:8], rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic_and_jittable(impl):
    x, z, weight = make_inputs(np.random.default_rng(5), 7, 24, dtype=jnp.bfloat16)
    norm = functools.partial(pk.gated_rms_norm, group_size=8, implementation=impl)
    first, second = norm(x, z, weight), norm(x, z, weight)
    assert np.asarray(first).tobytes() == np.asarray(second).tobytes()
    y = jax.jit(norm)(x, z, weight)
    check_norm(x, z, weight, y, group_size=8)


@pytest.mark.parametrize("impl", IMPLS)
def test_runs_the_named_implementation(impl):
    """The named backend is selected (no hand-off), and a Pallas backend really runs a
    ``pallas_call`` (the xla path none)."""
    x, z, weight = make_inputs(np.random.default_rng(6), 4, 16)
    fn = functools.partial(pk.gated_rms_norm, group_size=8, implementation=impl)
    assert pk.backend_for(fn, x, z, weight) == impl
    jaxpr = str(jax.make_jaxpr(fn)(x, z, weight))
    assert ("pallas_call" in jaxpr) == (impl != "xla")


@pytest.mark.parametrize("block_rows", [1, 4])
def test_triton_config_is_used(block_rows):
    """An explicit config reaches the kernel (its name carries the tiling) and gives the
    oracle's numbers; the default heuristic's config too."""
    x, z, weight = make_inputs(np.random.default_rng(9), 5, 24)
    config = norm_config.BlockSizes(block_rows=block_rows)
    fn = functools.partial(pk.gated_rms_norm, group_size=8, implementation="triton")

    def kernel_names(**kw):
        jaxpr = jax.make_jaxpr(functools.partial(fn, **kw))(x, z, weight)
        return set(re.findall(r"gated_rms_norm_gs8_rows\d+", str(jaxpr)))

    default = norm_config.default_block_sizes(8).block_rows
    assert default not in (1, 4)
    assert kernel_names(config=config) == {f"gated_rms_norm_gs8_rows{block_rows}"}
    assert kernel_names() == {f"gated_rms_norm_gs8_rows{default}"}
    check_norm(x, z, weight, fn(x, z, weight, config=config), group_size=8)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("impl", IMPLS)
def test_argument_errors_name_the_argument(impl):
    x, z, weight = make_inputs(np.random.default_rng(7), 4, 16)
    norm = functools.partial(pk.gated_rms_norm, implementation=impl)
    for group_size in (5, 3, 32, 0, -4):
        with pytest.raises(ValueError, match="group_size"):
            norm(x, z, weight, group_size=group_size)
    with pytest.raises(ValueError, match="weight"):
        norm(x, z, weight[:8], group_size=4)
    with pytest.raises(ValueError, match="weight"):
        norm(x, z, weight[None], group_size=4)
    with pytest.raises(ValueError, match="z"):
        norm(x, z[:, :8], weight, group_size=4)
    with pytest.raises(ValueError, match="x must"):
        norm(x[None], None, weight, group_size=4)
    with pytest.raises(ValueError, match="eps"):
        norm(x, z, weight, group_size=4, eps=-1e-5)


# --------------------------------------------------------------------------- rms_norm

RMS_IMPLS = implementations(api.RMS_NORM)


def check_rms_norm(x, residual, weight, out, *, eps=1e-5) -> None:
    """y against the oracle on the sum; the sum bit for bit what ``x + residual`` gives
    (the residual stream the next block reads)."""
    total = x if residual is None else x + residual
    y = out if residual is None else out[0]
    if residual is not None:
        assert out[1].dtype == x.dtype
        np.testing.assert_array_equal(as_f32(out[1]), as_f32(total))
    check_norm(total, None, weight, y, group_size=x.shape[1], eps=eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("added", [True, False], ids=["residual", "plain"])
@pytest.mark.parametrize("impl", RMS_IMPLS)
def test_rms_norm_matches_oracle(impl, added, dtype):
    """5 rows of 24 channels: a partial row block and masked columns (24 is not a power of
    two); a residual ~30× x, so a sum taken in the wrong dtype or dropped shows."""
    rng = np.random.default_rng(10)
    x, _, weight = make_inputs(rng, 5, 24, dtype=dtype, gated=False)
    residual = normal(rng, (5, 24), dtype, scale=30.0) if added else None
    out = pk.rms_norm(x, weight, residual=residual, implementation=impl)
    check_rms_norm(x, residual, weight, out)
    jitted = jax.jit(functools.partial(pk.rms_norm, implementation=impl))
    check_rms_norm(x, residual, weight, jitted(x, weight, residual=residual))


@pytest.mark.parametrize("impl", RMS_IMPLS)
def test_rms_norm_runs_the_named_implementation(impl):
    x, _, weight = make_inputs(np.random.default_rng(11), 4, 16, gated=False)
    fn = functools.partial(pk.rms_norm, residual=x, implementation=impl)
    assert pk.backend_for(fn, x, weight) == impl
    jaxpr = str(jax.make_jaxpr(fn)(x, weight))
    assert ("add_rms_norm" in jaxpr) == (impl == "triton")
    assert ("pallas_call" in jaxpr) == (impl != "xla")


@pytest.mark.parametrize("impl", RMS_IMPLS)
def test_rms_norm_empty_and_argument_errors(impl):
    x, _, weight = make_inputs(np.random.default_rng(12), 4, 16, gated=False)
    norm = functools.partial(pk.rms_norm, implementation=impl)
    y, total = norm(x[:0], weight, residual=x[:0])
    assert y.shape == total.shape == (0, 16)
    with pytest.raises(ValueError, match="residual"):
        norm(x, weight, residual=x[:, :8])
    with pytest.raises(ValueError, match="residual"):
        norm(x, weight, residual=x.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="weight"):
        norm(x, weight[:8])
    with pytest.raises(ValueError, match="x must"):
        norm(x[None], weight)
    with pytest.raises(ValueError, match="eps"):
        norm(x, weight, eps=-1.0)


# --------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("Dm, group_size", [(8192, 1024), (4096, 4096), (5120, 640)])
@pytest.mark.parametrize("impl", IMPLS)
def test_real_size(impl, Dm, group_size, norm_before_gate):
    rng = np.random.default_rng(8)
    x, z, weight = make_inputs(rng, 8192, Dm, dtype=jnp.bfloat16)
    y = pk.gated_rms_norm(
        x, z, weight, group_size=group_size, norm_before_gate=norm_before_gate, implementation=impl
    )
    assert np.all(np.isfinite(as_f32(y)))
    rows = np.unique(np.concatenate([[0, 8191], rng.choice(8192, 126, replace=False)]))
    check_norm(
        x[rows],
        z[rows],
        weight,
        y[rows],
        group_size=group_size,
        norm_before_gate=norm_before_gate,
    )


@pytest.mark.parametrize(("dim", "group_size"), [(8192, 1024), (2064, 258), (8192, 8192)])
@pytest.mark.parametrize("gated", [True, False])
def test_internal_triton_kernel_lowers_for_cuda(dim, group_size, gated):
    """The Triton kernel lowers for CUDA (interpret mode does not enforce Triton's rules)."""

    def fn(x, z, w):
        return norm_triton.gated_rms_norm(
            x,
            z if gated else None,
            w,
            group_size=group_size,
            eps=1e-5,
            norm_before_gate=False,
            config=norm_config.default_block_sizes(group_size),
        )

    text = lower_for_cuda(fn, spec((64, dim)), spec((64, dim)), spec((dim,)))
    assert "gated_rms_norm_gs" in text


@pytest.mark.parametrize("rows", [1, 64])
def test_internal_add_rms_norm_kernel_lowers_for_cuda(rows):
    """The add-and-norm kernel (one row: the one-row decode step's) lowers for CUDA."""

    def fn(x, residual, w):
        return norm_triton.rms_norm(
            x, w, residual=residual, eps=1e-5, config=norm_config.default_block_sizes(4096)
        )

    text = lower_for_cuda(fn, spec((rows, 4096)), spec((rows, 4096)), spec((4096,)))
    assert "add_rms_norm_gs4096" in text
