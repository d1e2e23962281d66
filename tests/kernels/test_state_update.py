"""selective_state_update against the float64 oracle; decode steps against a prefill."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import chunk_metadata, max_chunks_for, selective_state_update, ssd_scan
from pallas_kernels.state_update import api as state_update_api
from pallas_kernels.state_update import triton_config as state_update_config
from pallas_kernels.testing import (
    assert_close,
    assert_close_per_row,
    selective_state_update_oracle,
)
from tests.helpers import (
    check_out_of_range_slots_are_padding,
    check_slot_cache,
    implementations,
    normal,
    out_of_range_slot_ids,
    poison_slots,
)

IMPLS = implementations(state_update_api.SELECTIVE_STATE_UPDATE)
F32_TOL, BF16_TOL = 1e-5, 2e-2


def make_step(
    rows,
    *,
    slots=6,
    heads=4,
    head_dim=4,
    state_dim=8,
    groups=2,
    dtype=jnp.float32,
    cache_dtype=jnp.float32,
    seed=0,
):
    rng = np.random.default_rng(seed)
    return dict(
        state_cache=normal(rng, (slots, heads, head_dim, state_dim), cache_dtype),
        x=normal(rng, (rows, heads, head_dim), dtype),
        dt=normal(rng, (rows, heads), dtype),
        A=-jnp.asarray(np.exp(rng.normal(size=heads)), jnp.float32),
        B=normal(rng, (rows, groups, state_dim), dtype),
        C=normal(rng, (rows, groups, state_dim), dtype),
    ), dict(
        D=normal(rng, (heads, head_dim)),
        z=normal(rng, (rows, heads, head_dim), dtype),
        dt_bias=normal(rng, (heads,), scale=0.5),
        dt_softplus=True,
    )


def call(impl, arrays, slot_ids, **options):
    a = arrays
    return selective_state_update(
        a["state_cache"],
        a["x"],
        a["dt"],
        a["A"],
        a["B"],
        a["C"],
        slot_ids=jnp.asarray(slot_ids, jnp.int32),
        implementation=impl,
        **options,
    )


def check_step(arrays, slots, y, cache, options, rtol):
    """y row by row and the cache slot by slot against the oracle; padding rows exact 0;
    slots no row names (NaN-poisoned by the callers) bit-identical."""
    y_ref, cache_ref = selective_state_update_oracle(**arrays, slot_ids=slots, **options)
    assert np.all(np.isfinite(np.asarray(y, np.float32))), "a poisoned slot was read"
    assert_close_per_row(y, y_ref, rtol=rtol, name="y")
    assert np.all(np.asarray(y)[np.asarray(slots) < 0] == 0), "padding rows must be 0"
    check_slot_cache(cache, arrays["state_cache"], cache_ref, slots, rtol=rtol, name="state")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("d_shape", ["H", "HP"])
def test_matches_oracle(impl, groups, d_shape):
    arrays, options = make_step(4, groups=groups, seed=groups)
    if d_shape == "H":
        options["D"] = options["D"][:, 0]
    slots = [3, -1, 0, 5]
    arrays["state_cache"] = poison_slots(arrays["state_cache"], slots)
    y, cache = call(impl, arrays, slots, **options)
    check_step(arrays, slots, y, cache, options, F32_TOL)


@pytest.mark.parametrize(
    "block_h, num_stages, unroll_heads, d_shape",
    [(4, 2, False, "HP"), (8, 1, False, "HP"), (4, 1, True, "H"), (2, 1, True, "H")],
)
def test_heads_per_program(block_h, num_stages, unroll_heads, d_shape):
    """Several heads per program (a loop; 6 heads, so the last block of 4 runs past H and
    one block of 8 covers them all), padding rows and poisoned unnamed slots. Unrolled,
    the block's per-head scalars come from vectors (4 heads: past H, and across groups of
    2 heads; 2 heads: one group, whose B and C are loaded once)."""
    arrays, options = make_step(5, heads=6, groups=3, seed=7)
    if d_shape == "H":
        options["D"] = options["D"][:, 0]
    slots = [3, -1, 0, 5, 2]
    arrays["state_cache"] = poison_slots(arrays["state_cache"], slots)
    config = state_update_config.BlockSizes(
        block_p=2, block_h=block_h, num_warps=4, num_stages=num_stages, unroll_heads=unroll_heads
    )
    y, cache = call("triton", arrays, slots, config=config, **options)
    check_step(arrays, slots, y, cache, options, F32_TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_rows_and_unnamed_slots(impl):
    arrays, options = make_step(3, slots=5)
    # NaN in the slots nobody names: they must come back bit-identical and stay unread.
    arrays["state_cache"] = arrays["state_cache"].at[jnp.array([1, 3])].set(jnp.nan)
    slots = [4, -1, 0]
    y, cache = call(impl, arrays, slots, **options)
    check_step(arrays, slots, y, cache, options, F32_TOL)  # slot 2 (finite, unnamed) too


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
def test_bf16_inputs_and_cache(impl, cache_dtype):
    arrays, options = make_step(4, dtype=jnp.bfloat16, cache_dtype=cache_dtype, seed=2)
    slots = [0, 1, 2, 3]
    arrays["state_cache"] = poison_slots(arrays["state_cache"], slots)
    y, cache = call(impl, arrays, slots, **options)
    assert y.dtype == jnp.bfloat16 and cache.dtype == cache_dtype
    check_step(arrays, slots, y, cache, options, BF16_TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_slot_ids_are_padding(impl):
    """Slot ids >= S and < -1 behave exactly like -1 (DESIGN.md §8): the row's y is 0,
    nothing is read or written for it (every unnamed slot is NaN), other rows and the
    cache are bit-identical to the run with -1."""
    num_slots = 8
    arrays, options = make_step(4, slots=num_slots, seed=7)
    slots = [3, 5, 0, 4]  # row 1 goes bad; slots 1, 2, 5, 6, 7 are then unnamed
    arrays["state_cache"] = poison_slots(arrays["state_cache"], [3, 0, 4])
    step = jax.jit(
        lambda cache, slot_ids: selective_state_update(
            cache,
            *(arrays[k] for k in ("x", "dt", "A", "B", "C")),
            slot_ids=slot_ids,
            implementation=impl,
            **options,
        )
    )

    def run(slot_ids):
        y, cache = step(arrays["state_cache"], jnp.asarray(slot_ids))
        return (y,), (cache,)

    (y,), (cache,) = check_out_of_range_slots_are_padding(run, slots, 1, num_slots=num_slots)
    check_step(arrays, [3, -1, 0, 4], y, cache, options, F32_TOL)
    for bad in out_of_range_slot_ids(num_slots):
        with pytest.raises(ValueError, match="slot_ids must be -1 or in"):
            call(impl, arrays, [3, bad, 0, 4], validate=True, **options)


@pytest.mark.parametrize("impl", IMPLS)
def test_decode_steps_equal_prefill(impl):
    """N decode steps from a cached state equal one ssd_scan over the same N tokens."""
    steps, rng = 5, np.random.default_rng(4)
    heads, head_dim, state_dim, groups = 4, 4, 8, 2
    x = normal(rng, (steps, heads, head_dim))
    dt = normal(rng, (steps, heads))
    A = -jnp.asarray(np.exp(rng.normal(size=heads)), jnp.float32)
    B = normal(rng, (steps, groups, state_dim))
    C = normal(rng, (steps, groups, state_dim))
    init = normal(rng, (1, heads, head_dim, state_dim))
    options = dict(D=normal(rng, (heads,)), dt_bias=normal(rng, (heads,)), dt_softplus=True)
    md = chunk_metadata(
        jnp.array([0, steps]), jnp.array([3]), chunk_size=4, max_chunks=max_chunks_for(steps, 1, 4)
    )
    y_prefill, s_prefill = ssd_scan(
        x,
        dt,
        A,
        B,
        C,
        metadata=md,
        chunk_size=4,
        initial_states=init,
        implementation="xla",
        **options,
    )
    cache = jnp.concatenate([normal(rng, (1, heads, head_dim, state_dim)), init])
    step = jax.jit(  # one compile for every step
        lambda cache, x, dt, B, C: selective_state_update(
            cache, x, dt, A, B, C, slot_ids=jnp.array([1]), implementation=impl, **options
        )
    )
    ys = []
    for t in range(steps):
        y, cache = step(cache, x[t : t + 1], dt[t : t + 1], B[t : t + 1], C[t : t + 1])
        ys.append(y)
    assert_close(jnp.concatenate(ys), y_prefill, rtol=F32_TOL, name="y")
    assert_close(cache[1], s_prefill[0], rtol=F32_TOL, name="state")


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_with_donation(impl):
    arrays, options = make_step(2)

    @jax.jit
    def step(cache, x):
        return selective_state_update(
            cache,
            x,
            arrays["dt"],
            arrays["A"],
            arrays["B"],
            arrays["C"],
            slot_ids=jnp.array([2, 0]),
            implementation=impl,
            **options,
        )

    expected = step(arrays["state_cache"], arrays["x"])
    donated = jax.jit(step.__wrapped__, donate_argnums=0)
    y, cache = donated(jnp.array(arrays["state_cache"]), arrays["x"])
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected[0]))
    np.testing.assert_array_equal(np.asarray(cache), np.asarray(expected[1]))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(x=jnp.zeros((2, 4))), r"x must have shape \[Bd, H, P\]"),
        (dict(x=jnp.zeros((2, 4, 5))), r"state_cache must have shape \[S, H, P, N\]"),
        (dict(state_cache=jnp.zeros((6, 4, 4))), r"state_cache must have shape \[S, H, P, N\]"),
        (dict(dt=jnp.zeros((2, 3))), r"dt must have shape \[Bd, H\]"),
        (dict(B=jnp.zeros((2, 3, 8))), "groups"),
        (dict(slot_ids=jnp.zeros(3, jnp.int32)), r"slot_ids must have shape \[Bd\]"),
        (dict(slot_ids=jnp.zeros(2)), "slot_ids must be an integer"),
    ],
)
def test_argument_errors(change, match):
    arrays, _ = make_step(2)
    args = arrays | dict(slot_ids=jnp.array([0, 1])) | change
    with pytest.raises(ValueError, match=match):
        selective_state_update(**args)


def test_validate_rejects_bad_slots():
    arrays, _ = make_step(2, slots=3)
    for slots, match in (
        ([0, 3], "slot_ids must be -1 or in"),
        ([-2, 1], "slot_ids must be -1 or in"),
        ([1, 1], "at most once"),
    ):
        with pytest.raises(ValueError, match=match):
            selective_state_update(**arrays, slot_ids=jnp.array(slots), validate=True)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("cache_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gated", [True, False])
def test_gpu_real_sizes(rows, cache_dtype, gated):
    """Bamba-9B-sized heads with 8 groups; without z, 64 and 256 rows run the default
    tiling's unrolled heads."""
    arrays, options = make_step(
        rows,
        slots=2 * rows + 1,
        heads=128,
        head_dim=64,
        state_dim=128,
        groups=8,
        dtype=jnp.bfloat16,
        cache_dtype=cache_dtype,
        seed=rows,
    )
    if not gated:
        options.pop("z")
    slots = np.random.default_rng(rows).permutation(2 * rows + 1)[:rows]
    slots[::7] = -1
    arrays["state_cache"] = poison_slots(arrays["state_cache"], slots)
    y, cache = call("triton", arrays, slots, **options)
    y_ref, cache_ref = selective_state_update_oracle(**arrays, slot_ids=slots, **options)
    assert_close_per_row(y, y_ref, rtol=BF16_TOL, name="y")
    assert np.all(np.asarray(y)[slots < 0] == 0)
    rtol = BF16_TOL if cache_dtype == jnp.bfloat16 else F32_TOL
    check_slot_cache(cache, arrays["state_cache"], cache_ref, slots, rtol=rtol, name="state")
