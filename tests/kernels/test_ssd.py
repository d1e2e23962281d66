"""ssd_scan against the float64 token-by-token oracle, for every implementation."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_kernels import chunk_metadata, max_chunks_for, ssd_scan
from pallas_kernels.ssd import api as ssd_api
from pallas_kernels.ssd import mosaic_config as ssd_mosaic_config
from pallas_kernels.ssd import mosaic_state_scan as ssd_states
from pallas_kernels.ssd import triton as ssd_triton
from pallas_kernels.ssd import triton_config as ssd_config
from pallas_kernels.testing import assert_close, assert_close_per_row, ssd_oracle
from tests.helpers import (
    check_out_of_range_slots_are_padding,
    check_slot_cache,
    implementations,
    normal,
    out_of_range_slot_ids,
    poison_slots,
    query_start_loc,
    skip_if_mosaic_refuses,
    tiled_implementations,
)

IMPLS = tiled_implementations(ssd_api.SSD_SCAN)
GPU_IMPLS = [impl for impl in implementations(ssd_api.SSD_SCAN) if impl != "xla"]
F32_TOL, BF16_TOL = 1e-5, 2e-2


@dataclasses.dataclass
class Problem:
    """A random ragged SSD batch; ``num_tokens`` may exceed the real tokens (bucket rows)."""

    x: jax.Array
    dt: jax.Array
    A: jax.Array
    B: jax.Array
    C: jax.Array
    D: jax.Array
    z: jax.Array
    dt_bias: jax.Array
    initial_states: jax.Array
    qsl: np.ndarray
    computed: np.ndarray
    chunk_size: int

    def metadata(self):
        return chunk_metadata(
            jnp.asarray(self.qsl),
            jnp.asarray(self.computed),
            chunk_size=self.chunk_size,
            max_chunks=max_chunks_for(self.x.shape[0], len(self.computed), self.chunk_size),
        )


def make_problem(
    lengths,
    *,
    computed=None,
    heads=4,
    head_dim=4,
    state_dim=8,
    groups=2,
    chunk_size=8,
    dtype=jnp.float32,
    extra_rows=3,
    seed=0,
    a_scale=1.0,
):
    rng = np.random.default_rng(seed)
    qsl = query_start_loc(lengths)
    T = int(qsl[-1]) + extra_rows
    computed = np.zeros(len(lengths), np.int32) if computed is None else np.asarray(computed)
    return Problem(
        x=normal(rng, (T, heads, head_dim), dtype),
        dt=normal(rng, (T, heads), dtype),
        A=-jnp.asarray(np.exp(rng.normal(size=heads)) * a_scale, jnp.float32),
        B=normal(rng, (T, groups, state_dim), dtype),
        C=normal(rng, (T, groups, state_dim), dtype),
        D=normal(rng, (heads, head_dim)),
        z=normal(rng, (T, heads, head_dim), dtype),
        dt_bias=normal(rng, (heads,), scale=0.5),
        initial_states=normal(rng, (len(lengths), heads, head_dim, state_dim)),
        qsl=qsl,
        computed=computed.astype(np.int32),
        chunk_size=chunk_size,
    )


def run(p: Problem, impl: str, **options):
    """``ssd_scan`` on ``p`` (skipped where the Mosaic kernel does not serve it)."""
    args = (p.x, p.dt, p.A, p.B, p.C)
    kwargs = dict(metadata=p.metadata(), chunk_size=p.chunk_size, implementation=impl, **options)
    skip_if_mosaic_refuses(ssd_scan, *args, **kwargs)
    return ssd_scan(*args, **kwargs)


def oracle(p: Problem, **options):
    return ssd_oracle(p.x, p.dt, p.A, p.B, p.C, query_start_loc=p.qsl, **options)


def full_options(p: Problem):
    return dict(D=p.D, z=p.z, dt_bias=p.dt_bias, dt_softplus=True, initial_states=p.initial_states)


LAYOUTS = {
    "prefill": ([20, 13], None),
    "continuation": ([10, 5, 9], [13, 16, 5]),  # first chunks shortened by alignment
    "decode_like": ([1, 1, 1], [7, 8, 0]),
    "with_empty": ([0, 11, 0, 3], [4, 0, 0, 2]),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_all_options_match_oracle(impl, layout):
    lengths, computed = LAYOUTS[layout]
    p = make_problem(lengths, computed=computed)
    y, states = run(p, impl, **full_options(p))
    y_ref, states_ref = oracle(p, **full_options(p))
    assert_close_per_row(y, y_ref, rtol=F32_TOL, name="y")  # bucket rows: exactly 0
    assert_close_per_row(states, states_ref, rtol=F32_TOL, name="final states")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("d_shape", ["H", "HP"])
def test_groups_and_skip(impl, groups, d_shape):
    p = make_problem([9, 17], groups=groups, seed=groups)
    D = p.D[:, 0] if d_shape == "H" else p.D
    y, states = run(p, impl, D=D, dt_softplus=True)
    y_ref, states_ref = oracle(p, D=D, dt_softplus=True)
    assert_close(y, y_ref, rtol=F32_TOL, name="y")
    assert_close(states, states_ref, rtol=F32_TOL, name="states")


@pytest.mark.parametrize("impl", IMPLS)
def test_dt_limit_clamps(impl):
    p = make_problem([19, 6], seed=3)
    limit = (0.3, 0.9)
    options = dict(dt_bias=p.dt_bias, dt_softplus=True)
    y, _ = run(p, impl, dt_limit=limit, **options)
    y_ref, _ = oracle(p, dt_limit=limit, **options)
    y_unclamped, _ = oracle(p, **options)
    assert_close(y, y_ref, rtol=F32_TOL, name="y")
    # The limit is active on this data: the clamped and unclamped results differ.
    assert np.linalg.norm(y_ref - y_unclamped) > 0.1 * np.linalg.norm(y_ref)


@pytest.mark.parametrize("impl", IMPLS)
def test_intermediate_states_are_oracle_states_at_chunk_ends(impl):
    p = make_problem([20, 10, 5, 2], computed=[0, 13, 16, 5])
    md = p.metadata()
    _, chunk_states = run(p, impl, return_intermediate_states=True, **full_options(p))
    _, _, token_states = oracle(p, return_token_states=True, **full_options(p))
    n = int(md.num_chunks)
    ends = np.asarray(md.cu_chunk_seqlens)[1 : n + 1] - 1
    assert chunk_states.shape == (md.max_chunks, *p.initial_states.shape[1:])
    assert_close(chunk_states[:n], token_states[ends], rtol=F32_TOL, name="chunk states")
    assert np.all(np.asarray(chunk_states[n:]) == 0)


@pytest.mark.parametrize("intermediate", [False, True])
def test_triton_several_steps_per_chunk(intermediate):
    """Small tiles on a 64-token chunk: the state scan takes 4 steps per chunk (some past a
    short chunk's end), the chunk scan 4 row blocks per chunk."""
    small = ssd_config.BlockSizes(block_m=16, block_k=16, block_t=16)
    p = make_problem(
        [150, 70, 1, 20], computed=[0, 100, 63, 30], chunk_size=64, groups=1, extra_rows=40
    )
    options = full_options(p)
    y, states = run(p, "triton", return_intermediate_states=intermediate, config=small, **options)
    y_ref, states_ref, token_states = oracle(p, return_token_states=True, **options)
    assert_close_per_row(y, y_ref, rtol=F32_TOL, name="y")
    assert np.all(np.asarray(y[int(p.qsl[-1]) :]) == 0), "bucket rows past the sequences"
    if intermediate:
        md = p.metadata()
        ends = np.asarray(md.cu_chunk_seqlens)[1 : int(md.num_chunks) + 1] - 1
        assert_close_per_row(
            states[: len(ends)], token_states[ends], rtol=F32_TOL, name="chunk states"
        )
    else:
        assert_close_per_row(states, states_ref, rtol=F32_TOL, name="final states")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("split", [1, 5, 8, 13])
def test_two_passes_chained_equal_one_pass(impl, split):
    """A prefix computed earlier continues seamlessly from its final state."""
    whole = make_problem([21, 11], extra_rows=0, seed=7)
    options = dict(D=whole.D, z=whole.z, dt_bias=whole.dt_bias, dt_softplus=True)
    y_whole, s_whole = run(whole, impl, **options)

    s0, s1 = min(split, 21), min(split, 11)
    first_rows = np.r_[0:s0, 21 : 21 + s1]
    second_rows = np.r_[s0:21, 21 + s1 : 32]

    def part(rows, lengths, computed):
        fields = {f: getattr(whole, f)[rows] for f in ("x", "dt", "B", "C", "z")}
        return dataclasses.replace(
            whole, **fields, qsl=query_start_loc(lengths), computed=np.asarray(computed, np.int32)
        )

    first = part(first_rows, [s0, s1], [0, 0])
    second = part(second_rows, [21 - s0, 11 - s1], [s0, s1])
    opts1 = dict(options, z=first.z)
    opts2 = dict(options, z=second.z)
    y1, s1 = run(first, impl, **opts1)
    y2, s2 = run(second, impl, initial_states=s1, **opts2)
    assert_close(
        np.concatenate([y1, y2])[np.argsort(np.r_[first_rows, second_rows])],
        y_whole,
        rtol=F32_TOL,
        name="y",
    )
    assert_close(s2, s_whole, rtol=F32_TOL, name="final states")


@pytest.mark.parametrize("impl", IMPLS)
def test_large_decay_is_finite(impl):
    p = make_problem([30, 3], a_scale=1e4, seed=5)
    options = dict(dt_bias=p.dt_bias + 5.0, dt_softplus=True, D=p.D)
    y, states = run(p, impl, **options)
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(states))
    y_ref, states_ref = oracle(p, **options)
    assert_close(y, y_ref, rtol=F32_TOL, name="y")
    assert_close(states, states_ref, rtol=F32_TOL, name="states")


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_sequences_keep_initial_state_and_padding_rows_are_zero(impl):
    p = make_problem([0, 5, 0], extra_rows=4)
    # NaN in the bucket rows past the last sequence must not leak anywhere.
    x = p.x.at[5:].set(jnp.nan)
    p = dataclasses.replace(p, x=x)
    y, states = run(p, impl, initial_states=p.initial_states, dt_softplus=True)
    assert np.all(np.asarray(y[5:]) == 0)
    np.testing.assert_array_equal(np.asarray(states)[[0, 2]], np.asarray(p.initial_states)[[0, 2]])
    y_ref, states_ref = oracle(p, initial_states=p.initial_states, dt_softplus=True)
    assert_close(y[:5], y_ref[:5], rtol=F32_TOL, name="y")
    assert_close(states, states_ref, rtol=F32_TOL, name="states")


# Sequences of a state-cache call: a continuation from its slot, a fresh prompt whose slot
# holds NaN (must not be read), an empty sequence with a state, a second continuation (row
# 3, made padding below), a fresh short one and an empty one without a state (NaN slot).
# Empty sequences write nothing. Slots 2, 5, 7 are named by nobody.
CACHE_LENGTHS, CACHE_COMPUTED = [10, 5, 0, 9, 3, 0], [13, 0, 4, 5, 0, 0]
CACHE_SLOTS = [6, 1, 3, 0, 4, 8]
CACHE_HAS_STATE = [True, False, True, True, False, False]
CACHE_NUM_SLOTS = 9


def state_cache_problem(impl, *, padding_row):
    """The CACHE_* layout with sequence ``padding_row``'s slot id -1, a NaN-poisoned cache
    (every slot not read), and ``run(slot_ids) -> ((y,), (new_cache,))`` (one compile)."""
    p = make_problem(CACHE_LENGTHS, computed=CACHE_COMPUTED)
    slots = np.array(CACHE_SLOTS, np.int32)
    slots[padding_row] = -1
    has_state = np.array(CACHE_HAS_STATE)
    cache = normal(np.random.default_rng(3), (CACHE_NUM_SLOTS, *p.initial_states.shape[1:]))
    cache = poison_slots(cache, slots[has_state])
    options = dict(D=p.D, z=p.z, dt_bias=p.dt_bias, dt_softplus=True)
    scan = jax.jit(
        lambda slot_ids: ssd_scan(
            p.x,
            p.dt,
            p.A,
            p.B,
            p.C,
            metadata=p.metadata(),
            chunk_size=p.chunk_size,
            state_cache=cache,
            slot_ids=slot_ids,
            has_initial_state=jnp.asarray(has_state),
            implementation=impl,
            **options,
        )
    )

    def run(slot_ids):
        y, new_cache = scan(jnp.asarray(slot_ids))
        return (y,), (new_cache,)

    initial = np.where(
        (has_state & (slots >= 0))[:, None, None, None], np.asarray(cache)[slots], 0.0
    )
    y_ref, final_ref = oracle(p, initial_states=initial, **options)
    cache_ref = np.array(cache, np.float64)
    writes = (slots >= 0) & (np.asarray(CACHE_LENGTHS) > 0)
    cache_ref[slots[writes]] = final_ref[writes]
    return p, slots, cache, run, y_ref, cache_ref


@pytest.mark.parametrize("impl", IMPLS)
def test_state_cache_reads_and_writes_each_sequence_slot(impl):
    """ssd_scan(state_cache=): sequences with a state start from their slot, fresh ones
    from 0 whatever the slot holds; each sequence with new tokens writes its final state
    to its slot, empty ones write nothing. Compared per token row and per slot; slots not
    written (NaN where not read) stay unread and bit-identical. Slot ids >= S or < -1
    behave exactly like -1: bit-identical results (DESIGN.md §8)."""
    padding_row = 3
    p, slots, cache, run, y_ref, cache_ref = state_cache_problem(impl, padding_row=padding_row)
    (y,), (new_cache,) = check_out_of_range_slots_are_padding(
        run, CACHE_SLOTS, padding_row, num_slots=CACHE_NUM_SLOTS
    )
    assert np.all(np.isfinite(np.asarray(y))), "a NaN (unread) slot was read"
    live = np.ones(y.shape[0], bool)
    live[p.qsl[padding_row] : p.qsl[padding_row + 1]] = False
    assert_close_per_row(y[live], y_ref[live], rtol=F32_TOL, name="y")
    written = slots[np.asarray(CACHE_LENGTHS) > 0]
    check_slot_cache(new_cache, cache, cache_ref, written, rtol=F32_TOL, name="state_cache")
    assert not np.any(np.isin([3, 8], written))  # the empty sequences' slots: untouched
    for bad in out_of_range_slot_ids(CACHE_NUM_SLOTS):
        bad_slots = np.array(CACHE_SLOTS, np.int32)
        bad_slots[padding_row] = bad
        with pytest.raises(ValueError, match="slot_ids must be -1 or in"):
            ssd_scan(
                p.x,
                p.dt,
                p.A,
                p.B,
                p.C,
                metadata=p.metadata(),
                chunk_size=p.chunk_size,
                state_cache=cache,
                slot_ids=jnp.asarray(bad_slots),
                has_initial_state=jnp.asarray(CACHE_HAS_STATE),
                validate=True,
                implementation=impl,
            )


@pytest.mark.parametrize("impl", IMPLS)
def test_state_cache_padding_sequence_outputs_are_zero(impl):
    padding_row = 3
    p, _, _, run, _, _ = state_cache_problem(impl, padding_row=padding_row)
    (y,), _ = run(np.where(np.arange(len(CACHE_SLOTS)) == padding_row, -1, CACHE_SLOTS))
    rows = slice(p.qsl[padding_row], p.qsl[padding_row + 1])
    assert np.all(np.asarray(y[rows]) == 0)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16])
def test_bf16_inputs_fp32_accumulation(impl, state_dtype):
    p = make_problem([24, 9], dtype=jnp.bfloat16, seed=11)
    options = full_options(p)
    y, states = run(p, impl, state_dtype=state_dtype, **options)
    assert y.dtype == jnp.bfloat16 and states.dtype == state_dtype
    y_ref, states_ref = oracle(p, **options)  # the oracle sees the same bf16 values
    assert_close(y, y_ref, rtol=BF16_TOL, name="y")
    assert_close(states, states_ref, rtol=BF16_TOL, name="states")


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_and_determinism(impl):
    p = make_problem([12, 7])
    md = p.metadata()
    fn = jax.jit(
        lambda x, dt, B, C: ssd_scan(
            x,
            dt,
            p.A,
            B,
            C,
            metadata=md,
            chunk_size=p.chunk_size,
            dt_softplus=True,
            implementation=impl,
        )
    )
    a = fn(p.x, p.dt, p.B, p.C)
    b = fn(p.x, p.dt, p.B, p.C)
    for u, w in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(w))


PROPERTY_TOKENS = 4 * 23 + 4  # one bucket for every layout: one compile per chunk size


@functools.cache
def _jitted_full_scan(impl: str, chunk_size: int):
    """``ssd_scan`` with every option, metadata built inside, jitted once per (impl,
    chunk size): eager Pallas calls in interpret mode re-trace their kernels every time."""
    max_chunks = max_chunks_for(PROPERTY_TOKENS, 4, chunk_size)

    def scan(x, dt, A, B, C, D, z, dt_bias, initial_states, qsl, computed):
        md = chunk_metadata(qsl, computed, chunk_size=chunk_size, max_chunks=max_chunks)
        return ssd_scan(
            x,
            dt,
            A,
            B,
            C,
            metadata=md,
            chunk_size=chunk_size,
            D=D,
            z=z,
            dt_bias=dt_bias,
            dt_softplus=True,
            initial_states=initial_states,
            implementation=impl,
        )

    return jax.jit(scan)


@given(
    # Four sequences, empty ones included, in a fixed bucket of rows.
    lengths=st.lists(st.sampled_from([0, 1, 2, 7, 8, 9, 16, 23]), min_size=4, max_size=4),
    computed=st.lists(st.sampled_from([0, 1, 5, 8, 11]), min_size=4, max_size=4),
    chunk_size=st.sampled_from([4, 8]),
)
@pytest.mark.parametrize("impl", IMPLS)
def test_random_layouts_property(impl, lengths, computed, chunk_size):
    p = make_problem(
        lengths,
        computed=computed,
        chunk_size=chunk_size,
        extra_rows=PROPERTY_TOKENS - sum(lengths),
    )
    o = full_options(p)
    y, states = _jitted_full_scan(impl, chunk_size)(
        p.x, p.dt, p.A, p.B, p.C, o["D"], p.z, p.dt_bias, p.initial_states, p.qsl, p.computed
    )
    y_ref, states_ref = oracle(p, **o)
    assert_close_per_row(y, y_ref, rtol=F32_TOL, name="y")
    assert_close_per_row(states, states_ref, rtol=F32_TOL, name="states")


def test_xla_is_differentiable():
    p = make_problem([9, 6])
    md = p.metadata()

    def loss(x, B):
        y, s = ssd_scan(
            x,
            p.dt,
            p.A,
            B,
            p.C,
            metadata=md,
            chunk_size=p.chunk_size,
            dt_softplus=True,
            D=p.D,
            implementation="xla",
        )
        return jnp.sum(y**2) + jnp.sum(s)

    gx, gB = jax.grad(loss, argnums=(0, 1))(p.x, p.B)
    assert np.all(np.isfinite(gx)) and np.all(np.isfinite(gB))
    # Directional derivative against a central finite difference.
    direction = normal(np.random.default_rng(1), p.x.shape)
    eps = 1e-3
    fd = (loss(p.x + eps * direction, p.B) - loss(p.x - eps * direction, p.B)) / (2 * eps)
    np.testing.assert_allclose(jnp.vdot(gx, direction), fd, rtol=2e-2)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(A=jnp.zeros(3)), r"A must have shape \[H\]"),
        (dict(dt=jnp.zeros((5, 4))), r"dt must have shape \[T, H\]"),
        (dict(B=jnp.zeros((37, 3, 8))), "groups"),
        (dict(D=jnp.zeros((4, 5))), "D must have shape"),
        (dict(z=jnp.zeros((37, 4, 5))), r"z must have shape \[T, H, P\]"),
        (dict(initial_states=jnp.zeros((2, 4, 4, 8))), r"initial_states must have shape"),
        (dict(dt_limit=(1.0, 0.5)), "dt_limit"),
        (dict(implementation="cuda"), "implementation"),
    ],
)
def test_argument_errors(change, match):
    p = make_problem([20, 10, 5, 2])
    args = (
        dict(x=p.x, dt=p.dt, A=p.A, B=p.B, C=p.C, metadata=p.metadata(), chunk_size=p.chunk_size)
        | change
    )
    with pytest.raises(ValueError, match=match):
        ssd_scan(**args)


def test_unservable_implementation_is_a_clear_error():
    """The Mosaic kernel asked for by name where it cannot run (off Hopper: the device;
    on Hopper: fp32 inputs) raises the reason instead of running something else."""
    p = make_problem([4])
    with pytest.raises(ValueError, match="Hopper|bf16 or fp16"):
        ssd_scan(
            p.x,
            p.dt,
            p.A,
            p.B,
            p.C,
            metadata=p.metadata(),
            chunk_size=p.chunk_size,
            implementation="mosaic",
        )
    with pytest.raises(ValueError, match="config of type"):
        run(p, "xla", config=ssd_config.BlockSizes())


def test_validate_rejects_inconsistent_metadata():
    p = make_problem([20, 10])
    md = p.metadata()
    bad = dataclasses.replace(md, cu_chunk_seqlens=md.cu_chunk_seqlens.at[1].set(10))
    with pytest.raises(ValueError, match="longer than"):
        ssd_scan(p.x, p.dt, p.A, p.B, p.C, metadata=bad, chunk_size=8, validate=True)
    assert math.isfinite(float(run(p, "xla")[0].sum()))


# ------------------------------------------------------------------ GPU, real sizes


def _real_problem(lengths, *, groups, chunk_size, dtype, head_dim=64, state_dim=128, seed=0):
    """Mamba2-like magnitudes (dt' ~ softplus(dt - 2), A ~ -exp(N(0, 1))), drawn on the
    device: host-side NumPy draws of multi-GB tensors would dominate the test."""
    heads, T = 128, int(sum(lengths)) + 5
    keys = iter(jax.random.split(jax.random.key(seed), 10))

    def normal(shape, scale=1.0, dtype=dtype):
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(dtype)

    return Problem(
        x=normal((T, heads, head_dim), 0.5),
        dt=normal((T, heads)),
        A=-jnp.exp(normal((heads,), dtype=jnp.float32)),
        B=normal((T, groups, state_dim)),
        C=normal((T, groups, state_dim)),
        D=normal((heads, head_dim), dtype=jnp.float32),
        z=normal((T, heads, head_dim)),
        dt_bias=normal((heads,), 0.5, jnp.float32) - 2.0,
        initial_states=normal((len(lengths), heads, head_dim, state_dim), dtype=jnp.float32),
        qsl=query_start_loc(lengths),
        computed=np.zeros(len(lengths), np.int32),
        chunk_size=chunk_size,
    )


def _check_sequences_against_oracle(p: Problem, y, states, seqs, options, rtol):
    """The oracle on single sequences (sequences are independent), fast enough at real
    sizes: exactly what a wrong offset, a crossed sequence or a lost state would break."""
    for b in seqs:
        lo, hi = int(p.qsl[b]), int(p.qsl[b + 1])
        opts = dict(
            options,
            z=None if options.get("z") is None else options["z"][lo:hi],
            initial_states=None
            if options.get("initial_states") is None
            else options["initial_states"][b : b + 1],
        )
        y_ref, s_ref = ssd_oracle(
            p.x[lo:hi],
            p.dt[lo:hi],
            p.A,
            p.B[lo:hi],
            p.C[lo:hi],
            query_start_loc=np.array([0, hi - lo]),
            **opts,
        )
        assert_close(y[lo:hi], y_ref, rtol=rtol, name=f"y of sequence {b}")
        assert_close(states[b], s_ref[0], rtol=rtol, name=f"state of sequence {b}")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize("groups", [1, 8])
@pytest.mark.parametrize("chunk_size", [128, 256])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_real_sizes(impl, groups, chunk_size, dtype):
    rng = np.random.default_rng(chunk_size + groups)
    lengths = [int(n) for n in rng.integers(1, 1200, size=7)] + [1]
    p = _real_problem(lengths, groups=groups, chunk_size=chunk_size, dtype=dtype)
    options = full_options(p)
    y, states = run(p, impl, **options)
    with jax.default_matmul_precision("highest"):
        y_xla, states_xla = run(p, "xla", **options)
    rtol = F32_TOL * 10 if dtype == jnp.float32 else BF16_TOL
    assert_close(y, y_xla, rtol=rtol, name="y vs xla")
    assert_close(states, states_xla, rtol=rtol, name="states vs xla")
    assert np.all(np.asarray(y[int(p.qsl[-1]) :]) == 0)
    shortest = int(np.argmin(lengths[:-1]))
    _check_sequences_against_oracle(p, y, states, [shortest, len(lengths) - 1], options, rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
@pytest.mark.parametrize(("num_seqs", "initial"), [(1, True), (64, True), (64, False)])
def test_gpu_65k_tokens(impl, num_seqs, initial):
    """Without initial states the Mosaic kernels skip the (zero) carried state of each
    sequence's first chunk: neither written nor read."""
    rng = np.random.default_rng(num_seqs)
    cuts = np.sort(rng.choice(np.arange(1, 65536), size=num_seqs - 1, replace=False))
    lengths = np.diff(np.r_[0, cuts, 65536]).tolist()
    p = _real_problem(lengths, groups=1, chunk_size=256, dtype=jnp.bfloat16)
    options = dict(D=p.D, dt_bias=p.dt_bias, dt_softplus=True)
    options["initial_states"] = p.initial_states if initial else None
    y, states = run(p, impl, **options)
    with jax.default_matmul_precision("highest"):
        y_xla, states_xla = run(p, "xla", **options)
    assert_close(y, y_xla, rtol=BF16_TOL, name="y vs xla")
    assert_close(states, states_xla, rtol=BF16_TOL, name="states vs xla")
    # The oracle costs ~2 ms per token at these sizes: check the sequences under 1.5k.
    short = [b for b in np.argsort(lengths)[:3] if lengths[b] <= 1500]
    _check_sequences_against_oracle(p, y, states, short, options, BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", GPU_IMPLS)
def test_gpu_many_short_and_empty_sequences(impl):
    """Short sequences share a Mosaic state-scan block (``state_scan_groups``) and empty
    ones are alone: every final state is its own sequence's, an empty sequence's exactly
    its initial state (or zero), with and without initial states."""
    rng = np.random.default_rng(7)
    lengths = [int(n) for n in rng.integers(1, 300, size=40)] + [2000, 0]
    lengths[3] = lengths[17] = 0
    empty = [b for b, n in enumerate(lengths) if n == 0]
    p = _real_problem(lengths, groups=1, chunk_size=256, dtype=jnp.bfloat16)
    for initial in (p.initial_states, None):
        options = dict(D=p.D, dt_bias=p.dt_bias, dt_softplus=True, initial_states=initial)
        y, states = run(p, impl, **options)
        with jax.default_matmul_precision("highest"):
            y_xla, states_xla = run(p, "xla", **options)
        assert_close(y, y_xla, rtol=BF16_TOL, name="y vs xla")
        assert_close(states, states_xla, rtol=BF16_TOL, name="states vs xla")
        got = np.asarray(states)[empty]
        want = np.zeros_like(got) if initial is None else np.asarray(initial)[empty]
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "auto"])
def test_gpu_headdim_80_dstate_256(impl):
    """``auto`` routes what the Mosaic kernel does not take (head dim 80) to Triton."""
    p = _real_problem(
        [700, 1, 333], groups=2, chunk_size=256, dtype=jnp.bfloat16, head_dim=80, state_dim=256
    )
    options = full_options(p)
    y, states = run(p, impl, return_intermediate_states=False, **options)
    _check_sequences_against_oracle(p, y, states, [0, 1, 2], options, BF16_TOL)


@pytest.mark.gpu
def test_gpu_offsets_past_2_to_the_31():
    """T·H·P > 2³¹: the last sequence's rows sit past every 32-bit element offset."""
    total = (1 << 31) // (128 * 64) + 4096
    lengths = [total - 300, 300]
    p = _real_problem(lengths, groups=1, chunk_size=256, dtype=jnp.bfloat16)
    options = dict(D=p.D, dt_bias=p.dt_bias, dt_softplus=True, initial_states=p.initial_states)
    y, states = run(p, "triton", **options)
    assert p.x.size > 2**31
    _check_sequences_against_oracle(p, y, states, [1], options, BF16_TOL)


# ------------------------------------------------------------- the Mosaic GPU chunk scan


def _mosaic_args(*, T=1024, H=8, P=64, G=2, N=128, chunk_size=256, dtype=jnp.bfloat16):
    x, B = jnp.zeros((T, H, P), dtype), jnp.zeros((T, G, N), dtype)
    return (x, jnp.zeros((T, H), jnp.float32), jnp.zeros((H,), jnp.float32), B, B), dict(
        chunk_size=chunk_size
    )


def test_mosaic_supports_what_its_tiles_take():
    """bf16/fp16 with head dim 64, state dims 64/128/256 and chunks of 128/256 rows within
    the shared memory of a block; ``supports`` names the reason for everything else."""
    for options in (dict(), dict(dtype=jnp.float16, N=64), dict(chunk_size=128, N=256)):
        args, kwargs = _mosaic_args(**options)
        assert ssd_mosaic_config.supports(*args, **kwargs) is None, options
    for options, reason in (
        (dict(dtype=jnp.float32), "bf16 or fp16"),
        (dict(P=80), "head dim 80"),
        (dict(N=96), "state dim 96"),
        (dict(chunk_size=64), "chunk_size=64"),
        (dict(T=200), "T=200 is below chunk_size=256"),
        (dict(N=256), "shared memory"),  # chunk 256 with N 256: 284 KiB
    ):
        args, kwargs = _mosaic_args(**options)
        assert reason in ssd_mosaic_config.supports(*args, **kwargs), options
    args, kwargs = _mosaic_args()
    x, dt, A, B, C = args
    assert "dtype" in ssd_mosaic_config.supports(x, dt, A, B, C.astype(jnp.float16), **kwargs)


def test_mosaic_block_sizes_are_checked():
    sizes = dict(chunk_size=256, state_dim=128, itemsize=2)
    assert ssd_mosaic_config.default_heads_per_block(128) == 16
    assert ssd_mosaic_config.default_heads_per_block(12) == 12
    assert ssd_mosaic_config.default_heads_per_block(34) == 2
    ssd_mosaic_config.check_block_sizes(
        ssd_mosaic_config.BlockSizes(heads_per_block=4), heads_per_group=8, **sizes
    )
    with pytest.raises(ValueError, match="heads_per_block=3"):
        ssd_mosaic_config.check_block_sizes(
            ssd_mosaic_config.BlockSizes(heads_per_block=3), heads_per_group=8, **sizes
        )
    with pytest.raises(ValueError, match="num_stages=3"):
        ssd_mosaic_config.check_block_sizes(
            ssd_mosaic_config.BlockSizes(num_stages=3), heads_per_group=8, **sizes
        )
    with pytest.raises(ValueError, match="heads_per_block"):
        ssd_mosaic_config.BlockSizes(heads_per_block=0)
    with pytest.raises(ValueError, match="dbc_heads_per_block=0"):
        ssd_mosaic_config.BlockSizes(dbc_heads_per_block=0)
    with pytest.raises(ValueError, match="dbc_heads_per_block=16"):
        ssd_mosaic_config.check_block_sizes(
            ssd_mosaic_config.BlockSizes(dbc_heads_per_block=16), heads_per_group=8, **sizes
        )


def test_mosaic_backward_kernels_take_the_sizes_that_fit():
    """The backward's Mosaic chunk_dx and rows, and chunk_dbc, run where their shared
    memory (and, for chunk_dbc, a consumer's registers) hold them; the Triton kernels
    elsewhere."""
    dx, dbc = ssd_mosaic_config.backward_supports, ssd_mosaic_config.chunk_dbc_supports
    for cs, n in ((128, 64), (128, 128), (256, 64), (256, 128)):
        sizes = dict(chunk_size=cs, state_dim=n, num_stages=2, itemsize=2)
        assert dx(**sizes) and dbc(**sizes), sizes
    assert dx(chunk_size=128, state_dim=256, num_stages=2, itemsize=2)
    assert not dx(chunk_size=256, state_dim=256, num_stages=2, itemsize=2)
    assert not dbc(chunk_size=128, state_dim=256, num_stages=2, itemsize=2)  # registers
    assert not dbc(chunk_size=256, state_dim=128, num_stages=3, itemsize=2)  # 260 KiB


def test_internal_chunk_decay_is_the_triton_state_scans():
    """The Mosaic state scan's inputs (``triton.chunk_decay``, interpret mode): dt' and the
    within-chunk cumulative decay equal what the Triton state scan writes on every real
    chunk (chunks shortened by alignment, a chunk past the sequence's end, bias, softplus
    and a clamp; more heads than a program's 16), the weights and decays their formulas."""
    p = make_problem([300, 5, 395], computed=[0, 10, 3], heads=20, chunk_size=128, extra_rows=9)
    md = p.metadata()
    shapes = ssd_config.ScanShapes.of(p.x, p.B, md)
    options = dict(dt_softplus=True, dt_limit=(0.05, 2.0))
    dt_chunks, cum, weight, decay = ssd_triton.chunk_decay(
        shapes, md, p.dt, p.A, p.dt_bias, **options, interpret=True
    )
    expected_dt, expected_cum, _, _ = ssd_triton.state_scan(
        shapes,
        md,
        p.x,
        p.dt,
        p.A,
        p.B,
        p.dt_bias,
        None,
        intermediate=False,
        state_dtype=jnp.float32,
        carried_dtype=jnp.float32,
        blocks=ssd_config.BlockSizes(block_m=16, block_k=16, block_t=64),
        interpret=True,
        **options,
    )
    n = int(md.num_chunks)
    assert_close(dt_chunks[:, :n], expected_dt[:, :n], rtol=F32_TOL, name="dt'")
    assert_close(cum[:, :n], expected_cum[:, :n], rtol=F32_TOL, name="cum")
    end = np.asarray(cum[:, :n, -1:], np.float64)
    want_weight = np.exp(np.minimum(end - np.asarray(cum[:, :n]), 0)) * dt_chunks[:, :n]
    assert_close(weight[:, :n], want_weight, rtol=F32_TOL, name="weight")
    assert_close(decay[:, :n], np.exp(np.minimum(end[..., 0], 0)), rtol=F32_TOL, name="decay")


def test_internal_mosaic_state_scan_steps_cover_each_chunk_once():
    """The Mosaic state scan's 128-row steps (chunk size 256): each sequence's steps walk
    its chunks in order and cover every row of each once, a chunk of 128 rows or fewer in
    one step (chunks shortened by alignment, at a sequence's start or end); a sequence
    without chunks has none."""
    lengths, computed = [300, 5, 395, 0, 128, 900, 1], [0, 10, 3, 0, 60, 130, 255]
    p = make_problem(lengths, computed=computed, chunk_size=256)
    md = p.metadata()
    shapes = ssd_config.ScanShapes.of(p.x, p.B, md)
    _, first, count = ssd_config.sequence_chunks(shapes, md)
    cu = np.asarray(md.cu_chunk_seqlens)
    for b in range(len(lengths)):
        num_steps, step = ssd_states.sequence_steps(
            md.cu_chunk_seqlens, first[b], count[b], steps_per_chunk=2
        )
        walked = [tuple(int(v) for v in step(jnp.int32(i))) for i in range(int(num_steps))]
        chunks = range(int(first[b]), int(first[b] + count[b]))
        expected = [(c, row) for c in chunks for row in range(0, int(cu[c + 1] - cu[c]), 128)]
        assert walked == expected, b
    assert count[3] == 0


def test_internal_mosaic_state_scan_steps_stay_inside_the_chunk_table():
    """A sequence without chunks after the last real chunk has ``first == max_chunks``: its
    step count is 0 and no lookup of ``cu`` falls outside it (the kernel reads ``cu`` from
    device memory, where nothing would catch it)."""

    class CheckedTable:
        def __init__(self, values):
            self.values = np.asarray(values)
            self.shape = self.values.shape

        def __getitem__(self, i):
            assert 0 <= int(i) < len(self.values), f"cu[{int(i)}] outside [0, {len(self.values)})"
            return jnp.int32(self.values[int(i)])

    cu = CheckedTable([0, 256, 300])  # two chunks, both real
    num_steps, _ = ssd_states.sequence_steps(cu, jnp.int32(2), jnp.int32(0), steps_per_chunk=2)
    assert int(num_steps) == 0
    num_steps, step = ssd_states.sequence_steps(cu, jnp.int32(0), jnp.int32(2), steps_per_chunk=2)
    assert [tuple(int(v) for v in step(jnp.int32(i))) for i in range(int(num_steps))] == [
        (0, 0),
        (0, 128),
        (1, 0),
    ]


@pytest.mark.parametrize("heads", [128, 8])
def test_internal_mosaic_state_scan_groups_partition_the_sequences(heads):
    """The Mosaic state scan's blocks (chunk size 256): the leading positions of the windows
    split the sorted sequences into consecutive groups that cover each once; a sequence of a
    window's steps or more, and each sequence without chunks, is alone; a group of several
    holds at most two windows' steps. With Bamba's 128 heads short sequences share blocks;
    with 8 heads the batch is too small to fill the GPU and every sequence has its own."""
    lengths = [300, 5, 395, 0, 128, 900, 1] + [40] * 40 + [9000, 0, 0]
    p = make_problem(lengths, chunk_size=256)
    md = p.metadata()
    shapes = dataclasses.replace(ssd_config.ScanShapes.of(p.x, p.B, md), heads=heads)
    order, _, count = ssd_config.sequence_chunks(shapes, md)
    window, group_end = (np.asarray(a) for a in ssd_states.state_scan_groups(shapes, order, count))
    steps = np.asarray(count)[np.asarray(order)] * 2
    window_steps = ssd_states._WINDOW_STEPS
    leads = [j for j in range(len(lengths)) if j == 0 or window[j - 1] != window[j]]
    covered = [j for lead in leads for j in range(lead, group_end[lead])]
    assert covered == list(range(len(lengths)))
    for lead in leads:
        members = range(lead, group_end[lead])
        if len(members) > 1:
            assert all(0 < steps[j] < window_steps for j in members), lead
            assert steps[list(members)].sum() < 2 * window_steps, lead
    alone = [j for j in range(len(lengths)) if steps[j] == 0 or steps[j] >= window_steps]
    assert all(j in leads and group_end[j] == j + 1 for j in alone)
    if heads == 128:
        assert len(leads) < len(lengths) // 2
    else:
        assert leads == list(range(len(lengths)))
