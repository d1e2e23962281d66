"""mamba2_decode against the float64 oracles of its two steps (conv update, then the SSM
state update on the conv's output), on poisoned caches; its lowering for CUDA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.mamba_decode import api as mamba_decode_api
from pallas_kernels.mamba_decode import triton as mamba_decode_triton
from pallas_kernels.state_update.triton import BlockSizes
from pallas_kernels.testing import (
    assert_close,
    causal_conv1d_update_oracle,
    selective_state_update_oracle,
    tolerance_for,
)
from tests.helpers import (
    as_f32,
    check_slot_cache,
    implementations,
    lower_for_cuda,
    normal,
    poison_slots,
    spec,
)

IMPLS = implementations(mamba_decode_api.MAMBA2_DECODE)


def make_step(
    rows, *, slots=6, heads=4, head_dim=8, state_dim=8, groups=2, width=4, dtype=jnp.float32, seed=0
):
    rng = np.random.default_rng(seed)
    d_inner = heads * head_dim
    conv_dim = d_inner + 2 * groups * state_dim
    arrays = dict(
        zxbcdt=normal(rng, (rows, d_inner + conv_dim + heads), dtype),
        conv_state_cache=normal(rng, (slots, width - 1, conv_dim), dtype),
        ssm_state_cache=normal(rng, (slots, heads, head_dim, state_dim)),
        conv_weight=normal(rng, (conv_dim, width), dtype, scale=0.5),
        A=-jnp.asarray(np.exp(rng.normal(size=heads)), jnp.float32),
    )
    options = dict(
        conv_bias=normal(rng, (conv_dim,), dtype),
        D=normal(rng, (heads,)),
        dt_bias=normal(rng, (heads,), scale=0.5),
        dt_softplus=True,
        dt_limit=(0.0, 4.0),
    )
    return arrays, options


def oracle(arrays, options, slot_ids, gate):
    """The op's two steps, each by its float64 token-by-token oracle."""
    a = {k: as_f32(v) for k, v in arrays.items()}
    H, P, N = a["ssm_state_cache"].shape[1:]
    d_inner, conv_dim = H * P, a["conv_weight"].shape[0]
    G = (conv_dim - d_inner) // (2 * N)
    rows = a["zxbcdt"].shape[0]
    z, xbc, dt = np.split(a["zxbcdt"], [d_inner, d_inner + conv_dim], axis=-1)
    xbc, conv_state = causal_conv1d_update_oracle(
        xbc,
        a["conv_state_cache"],
        a["conv_weight"],
        as_f32(options["conv_bias"]),
        slot_ids=slot_ids,
        activation="silu",
    )
    x, B, C = np.split(xbc, [d_inner, d_inner + G * N], axis=-1)
    y, ssm_state = selective_state_update_oracle(
        a["ssm_state_cache"],
        x.reshape(rows, H, P),
        dt,
        a["A"],
        B.reshape(rows, G, N),
        C.reshape(rows, G, N),
        slot_ids=slot_ids,
        D=as_f32(options["D"]),
        z=z.reshape(rows, H, P) if gate else None,
        dt_bias=as_f32(options["dt_bias"]),
        dt_softplus=True,
        dt_limit=options["dt_limit"],
    )
    return y.reshape(rows, d_inner), np.sum(y * y, axis=-1), conv_state, ssm_state


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize(
    "config",
    [None, BlockSizes(block_p=4, block_h=2, num_warps=4, num_stages=2)],
    ids=["default", "two_head_blocks"],
)
def test_mamba2_decode_matches_the_oracles(impl, gate, config):
    """Rows on live slots, a padding row and an out-of-range slot; every slot not named is
    NaN (a read shows in the outputs, a write breaks bit-identity)."""
    if impl == "xla" and config is not None:
        pytest.skip("the xla backend takes no block sizes")
    slot_ids = np.array([4, -1, 0, 9, 2], np.int32)
    arrays, options = make_step(len(slot_ids), head_dim=12)  # P = 12: a partial p block
    for name in ("conv_state_cache", "ssm_state_cache"):
        arrays[name] = poison_slots(arrays[name], slot_ids)
    want = oracle(arrays, options, slot_ids, gate)
    u, squares, conv_state, ssm_state = pk.mamba2_decode(
        **arrays, slot_ids=slot_ids, gate=gate, implementation=impl, config=config, **options
    )
    assert u.shape == want[0].shape and u.dtype == arrays["zxbcdt"].dtype
    assert_close(as_f32(u), want[0], rtol=1e-5, name="u")
    assert_close(as_f32(squares), want[1], rtol=1e-5, name="squares")
    padding = np.flatnonzero((slot_ids < 0) | (slot_ids >= 6))
    np.testing.assert_array_equal(as_f32(u)[padding], 0.0)
    np.testing.assert_array_equal(as_f32(squares)[padding], 0.0)
    for new, old, expected, name in (
        (conv_state, arrays["conv_state_cache"], want[2], "conv_state_cache"),
        (ssm_state, arrays["ssm_state_cache"], want[3], "ssm_state_cache"),
    ):
        check_slot_cache(new, old, expected, slot_ids, rtol=1e-5, name=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_mamba2_decode_bf16_one_group(impl):
    """bf16 inputs, one group for all heads (as Bamba): within bf16 tolerance."""
    slot_ids = np.array([1, 3], np.int32)
    arrays, options = make_step(2, heads=8, groups=1, dtype=jnp.bfloat16, seed=3)
    want = oracle(arrays, options, slot_ids, True)
    u, squares, conv_state, ssm_state = pk.mamba2_decode(
        **arrays, slot_ids=slot_ids, implementation=impl, **options
    )
    tol = tolerance_for(jnp.bfloat16)
    assert_close(as_f32(u), want[0], rtol=tol, name="u")
    assert_close(as_f32(squares), want[1], rtol=tol, name="squares")
    assert_close(as_f32(ssm_state)[slot_ids], want[3][slot_ids], rtol=tol, name="ssm state")
    assert_close(as_f32(conv_state)[slot_ids], want[2][slot_ids], rtol=tol, name="conv state")


def test_mamba2_decode_arguments_are_checked():
    arrays, options = make_step(2)
    slots = np.array([0, 1], np.int32)
    bad = [
        (dict(zxbcdt=arrays["zxbcdt"][:, 1:]), "zxbcdt"),
        (dict(conv_weight=arrays["conv_weight"][1:]), "conv_weight"),
        (dict(conv_state_cache=arrays["conv_state_cache"][:, 1:]), "conv_state_cache"),
        (dict(A=arrays["A"][1:]), "A"),
    ]
    for change, name in bad:
        with pytest.raises(ValueError, match=name):
            pk.mamba2_decode(**(arrays | change), slot_ids=slots, **options)
    with pytest.raises(ValueError, match="block_h"):
        pk.mamba2_decode(
            **arrays,
            slot_ids=slots,
            implementation="triton",
            config=BlockSizes(block_p=8, block_h=8),  # 4 heads
            **options,
        )


def test_mamba2_decode_default_blocks_divide_the_heads():
    """Whole blocks of heads per program (H = 24 has no block of 16)."""
    blocks = mamba_decode_triton.default_block_sizes(64, 128, rows=256, num_heads=24)
    assert 24 % blocks.block_h == 0 and blocks.block_h == 8
    assert mamba_decode_triton.default_block_sizes(64, 128, rows=256, num_heads=128).block_h == 16


@pytest.mark.parametrize("rows", [1, 256])
def test_mamba2_decode_lowers_for_cuda(rows):
    """Bamba-9B's shapes (H 128, P 64, N 128, G 1, K 4; bf16 row, fp32 states): one Triton
    kernel with the default tiles of one and of many rows."""
    H, P, N, G, K, S = 128, 64, 128, 1, 4, 256
    d_inner = H * P
    conv_dim = d_inner + 2 * G * N

    config = mamba_decode_triton.default_block_sizes(P, N, rows=rows, num_heads=H)

    def fn(zxbcdt, conv, ssm, w, b, A, D, dt_bias, slots):
        return mamba_decode_triton.mamba2_decode(
            zxbcdt,
            conv,
            ssm,
            w,
            A,
            slot_ids=slots,
            conv_bias=b,
            D=D,
            dt_bias=dt_bias,
            dt_softplus=True,
            dt_limit=(0.0, float("inf")),
            gate=True,
            config=config,
        )

    text = lower_for_cuda(
        fn,
        spec((rows, d_inner + conv_dim + H)),
        spec((S, K - 1, conv_dim)),
        spec((S, H, P, N), jnp.float32),
        spec((conv_dim, K)),
        spec((conv_dim,)),
        spec((H,), jnp.float32),
        spec((H,), jnp.float32),
        spec((H,), jnp.float32),
        spec((rows,), jnp.int32),
    )
    assert f"mamba2_decode_bp64_bh{config.block_h}" in text


@pytest.mark.gpu
def test_mamba2_decode_real_size():
    """Bamba-9B's shapes at 64 rows on the GPU, bf16, against the float64 oracles."""
    slot_ids = np.random.default_rng(5).permutation(96)[:64].astype(np.int32)
    arrays, options = make_step(
        64, slots=96, heads=128, head_dim=64, state_dim=128, groups=1, dtype=jnp.bfloat16
    )
    want = oracle(arrays, options, slot_ids, True)
    u, squares, _, ssm_state = jax.block_until_ready(
        pk.mamba2_decode(**arrays, slot_ids=slot_ids, implementation="triton", **options)
    )
    tol = tolerance_for(jnp.bfloat16)
    assert_close(as_f32(u), want[0], rtol=tol, name="u")
    assert_close(as_f32(squares), want[1], rtol=tol, name="squares")
    assert_close(as_f32(ssm_state)[slot_ids], want[3][slot_ids], rtol=tol, name="ssm state")
