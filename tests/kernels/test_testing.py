"""The public assert helpers of ``pallas_kernels.testing``: what each one catches."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.testing import (
    assert_close,
    assert_close_per_row,
    assert_slots_untouched,
    attention_oracle,
    causal_conv1d_oracle,
    causal_conv1d_update_oracle,
    relative_error,
    selective_state_update_oracle,
    write_kv_oracle,
)


def _cache_with_one_garbage_slot():
    """256 slots of [4, 8]; slot 77 holds 10 % noise: 0.6 % of the cache's norm."""
    rng = np.random.default_rng(0)
    expected = rng.normal(size=(256, 4, 8))
    actual = expected.copy()
    actual[77] += 0.1 * rng.normal(size=(4, 8))
    return actual, expected


def test_per_row_catches_a_garbage_row_the_global_norm_passes():
    actual, expected = _cache_with_one_garbage_slot()
    assert relative_error(actual, expected) < 1e-2
    assert_close(actual, expected, rtol=2e-2, name="cache")  # hidden by the norm
    with pytest.raises(AssertionError, match=r"cache: 1 of 256 entries .* \[77\]") as err:
        assert_close_per_row(actual, expected, rtol=2e-2, name="cache")
    assert "worst is entry 77" in str(err.value)
    assert_close_per_row(expected.copy(), expected, rtol=0.0)  # identical rows pass


def test_per_row_axis_atol_and_non_finite():
    actual, expected = _cache_with_one_garbage_slot()
    moved = np.moveaxis(actual, 0, 2), np.moveaxis(expected, 0, 2)
    with pytest.raises(AssertionError, match="worst is entry 77"):
        assert_close_per_row(*moved, rtol=2e-2, axis=2)
    # An all-zero expected row (a padding row) must come back as zeros, up to atol.
    zeros = np.zeros((3, 5))
    noisy = zeros.copy()
    noisy[1, 2] = 1e-7
    with pytest.raises(AssertionError, match="worst is entry 1"):
        assert_close_per_row(noisy, zeros, rtol=1e-5)
    assert_close_per_row(noisy, zeros, rtol=1e-5, atol=1e-6)
    nan_row = expected.copy()
    nan_row[3, 0, 0] = np.nan
    with pytest.raises(AssertionError, match=r"\[3\].*first non-finite"):
        assert_close_per_row(nan_row, expected, rtol=1.0)
    # NaN expected where NaN came back (a poisoned entry) is a match.
    assert_close_per_row(nan_row, nan_row.copy(), rtol=0.0)
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_close_per_row(actual[:3], expected[:4], rtol=1.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_slots_untouched_compares_bytes(dtype):
    old = jnp.asarray(np.random.default_rng(1).normal(size=(6, 3, 4)), jnp.float32)
    old = old.at[2].set(jnp.nan).astype(dtype)
    new = old.at[4].set(0.0)
    assert_slots_untouched(new, old, [4])
    assert_slots_untouched(new, old, [-1, 4, 6, 99])  # padding ids name no slot
    with pytest.raises(AssertionError, match=r"1 untouched slot\(s\) changed: \[4\]"):
        assert_slots_untouched(new, old, [-1])
    # A NaN with another payload, and -0.0 for 0.0, are changes.
    other_nan = np.asarray(old).copy()
    other_nan.view(np.uint16 if dtype == jnp.bfloat16 else np.uint32)[2, 0, 0] ^= 1
    assert np.isnan(other_nan[2, 0, 0].astype(np.float32))
    with pytest.raises(AssertionError, match=r"slot 2 at \(0, 0\)"):
        assert_slots_untouched(other_nan, old, [4])
    zeros = jnp.zeros((2, 3), dtype)
    with pytest.raises(AssertionError, match=r"\[1\]"):
        assert_slots_untouched(zeros.at[1, 1].set(-0.0), zeros, [0])
    with pytest.raises(AssertionError, match="went in as"):
        assert_slots_untouched(new.astype(jnp.float16), old, [4])


def test_oracles_treat_out_of_range_slot_ids_as_padding():
    """DESIGN.md §8: any slot id outside [0, S) is padding, in the oracles as in the ops."""
    rng = np.random.default_rng(2)
    S, H, P, N, dim, K, L = 3, 2, 2, 4, 4, 3, 8
    cache = rng.normal(size=(S, H, P, N))
    step = dict(
        x=rng.normal(size=(2, H, P)),
        dt=rng.random((2, H)),
        A=-rng.random(H),
        B=rng.normal(size=(2, 1, N)),
        C=rng.normal(size=(2, 1, N)),
    )
    conv = rng.normal(size=(S, K - 1, dim))
    x, weight = rng.normal(size=(5, dim)), rng.normal(size=(dim, K))
    q, kv = rng.normal(size=(5, 2, 4)), rng.normal(size=(2, S, L, 1, 4))
    qsl, kv_lens = np.array([0, 3, 5]), np.array([3, 6])
    for bad in (S, S + 3, -2, -7):
        for fn, (padded, out_of_range) in (
            (
                lambda ids: selective_state_update_oracle(cache, **step, slot_ids=ids),
                ([1, -1], [1, bad]),
            ),
            (
                lambda ids: causal_conv1d_oracle(
                    x,
                    weight,
                    query_start_loc=qsl,
                    conv_state_cache=conv,
                    slot_ids=ids,
                    has_initial_state=[True, True],
                ),
                ([-1, 2], [bad, 2]),
            ),
            (
                lambda ids: causal_conv1d_update_oracle(x[:2], conv, weight, slot_ids=ids),
                ([0, -1], [0, bad]),
            ),
            (
                lambda ids: (
                    attention_oracle(
                        q,
                        *kv,
                        query_start_loc=qsl,
                        kv_lens=kv_lens,
                        slot_ids=ids,
                    ),
                ),
                ([-1, 1], [bad, 1]),
            ),
            (
                lambda ids: write_kv_oracle(
                    *kv, x[:, None], x[:, None], query_start_loc=qsl, kv_lens=kv_lens, slot_ids=ids
                ),
                ([2, -1], [2, bad]),
            ),
        ):
            for want, got in zip(fn(padded), fn(out_of_range), strict=True):
                np.testing.assert_array_equal(got, want)
