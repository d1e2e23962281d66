"""``causal_conv1d`` / ``causal_conv1d_update`` against the float64 token-by-token oracles.

Every test runs against every implementation in the op's registries (Pallas kernels in
interpret mode off-GPU), on small shapes. Cache lines that must not be read hold NaN, and
cache lines that must not be written are checked bit for bit.

The Triton prefill kernel runs with small tiles (``SMALL_TILES``: 8-row blocks, two
channel blocks) unless a test asks for the default tiling: several blocks per sequence
and per channel range on these small shapes, and interpret mode compiles fewer unrolled
rows. ``test_prefill_default_tiling`` runs the heuristic's tiling.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pallas_kernels as pk
from pallas_kernels.conv1d import api
from pallas_kernels.conv1d import triton as conv_triton
from pallas_kernels.conv1d import triton_config as conv_config
from pallas_kernels.testing import (
    assert_close,
    assert_close_per_row,
    causal_conv1d_oracle,
    causal_conv1d_update_oracle,
    tolerance_for,
)
from tests.helpers import (
    as_f32,
    assert_bit_identical,
    check_out_of_range_slots_are_padding,
    dead_rows,
    implementations,
    lower_for_cuda,
    normal,
    out_of_range_slot_ids,
    poison_slots,
    query_start_loc,
    spec,
)

PREFILL = implementations(api.CAUSAL_CONV1D)
UPDATE = implementations(api.CAUSAL_CONV1D_UPDATE)
WIDTHS = (2, 3, 4)
DTYPES = (jnp.float32, jnp.bfloat16)
DIM = 16
# Small Triton prefill tiles: 8-row blocks (sequences span several), 4-row steps (>= K - 1
# for every width here), two 8-channel blocks.
SMALL_TILES = conv_config.BlockSizes(block_t=8, unroll_t=4, block_d=8, num_warps=2)


def prefill_config(impl: str, tiles=SMALL_TILES):
    """``config=`` for ``impl``: the Triton tiles, None for backends without block sizes
    (and for the Triton heuristic's default: ``tiles=None``)."""
    return tiles if impl == "triton" else None


# --------------------------------------------------------------------------- helpers


@dataclasses.dataclass(frozen=True)
class VarlenCase:
    """A packed prefill batch: per-sequence lengths, initial-state flags, padding flags
    (slot -1) and bucket padding rows past ``query_start_loc[-1]``."""

    name: str
    lengths: tuple[int, ...]
    has_initial_state: tuple[bool, ...]
    padding: tuple[bool, ...] | None = None
    pad_rows: int = 0


CASES = (
    VarlenCase("prefill", (9, 16, 5), (False, True, False)),
    VarlenCase("decode_only", (1, 1, 1, 1), (True, True, True, True)),
    VarlenCase("mixed", (12, 1, 6, 1), (False, True, True, True)),
    # Zero-length padding sequences (slot -1), a padding sequence with tokens, a
    # zero-length sequence that names a slot (must leave it untouched), bucket padding rows.
    VarlenCase(
        "padded",
        (5, 0, 1, 0, 2, 0),
        (True, False, True, False, True, True),
        padding=(False, True, False, True, True, False),
        pad_rows=7,
    ),
)
CASE_IDS = [c.name for c in CASES]
MIXED = CASES[2]


@dataclasses.dataclass
class ConvBatch:
    """Arguments of one ``causal_conv1d`` call plus what the checks need to know."""

    x: jax.Array
    weight: jax.Array
    bias: jax.Array | None
    query_start_loc: np.ndarray
    conv_state_cache: jax.Array
    slot_ids: np.ndarray
    has_initial_state: np.ndarray

    def kwargs(self) -> dict:
        return dict(
            query_start_loc=self.query_start_loc,
            conv_state_cache=self.conv_state_cache,
            slot_ids=self.slot_ids,
            has_initial_state=self.has_initial_state,
        )

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.query_start_loc)

    def written_slots(self) -> set[int]:
        return {int(s) for s, n in zip(self.slot_ids, self.lengths, strict=True) if s >= 0 and n}

    def dead_rows(self) -> np.ndarray:
        """bool[T]: rows of padding sequences and rows past ``query_start_loc[-1]``."""
        return dead_rows(self.x.shape[0], self.query_start_loc, self.slot_ids)


def make_batch(
    rng: np.random.Generator,
    lengths,
    has_initial_state,
    *,
    K: int,
    dim: int = DIM,
    dtype=jnp.float32,
    padding=None,
    pad_rows: int = 0,
    with_bias: bool = True,
    extra_slots: int = 2,
) -> ConvBatch:
    """A random prefill batch. Slots are a random permutation; every cache line that must
    not be read (unnamed slots, slots of sequences without an initial state) is NaN."""
    num_seqs = len(lengths)
    num_slots = num_seqs + extra_slots
    slot_ids = rng.permutation(num_slots)[:num_seqs].astype(np.int32)
    if padding is not None:
        slot_ids[np.asarray(padding, bool)] = -1
    has_init = np.asarray(has_initial_state, bool)
    cache = rng.normal(size=(num_slots, K - 1, dim)).astype(np.float32)
    readable = {int(s) for s, h in zip(slot_ids, has_init, strict=True) if s >= 0 and h}
    for s in range(num_slots):
        if s not in readable:
            cache[s] = np.nan
    num_tokens = int(sum(lengths)) + pad_rows
    return ConvBatch(
        x=normal(rng, (num_tokens, dim), dtype),
        weight=normal(rng, (dim, K), dtype, scale=0.5),
        bias=normal(rng, (dim,), dtype) if with_bias else None,
        query_start_loc=query_start_loc(lengths),
        conv_state_cache=jnp.asarray(cache).astype(dtype),
        slot_ids=slot_ids,
        has_initial_state=has_init,
    )


def case_batch(rng, case: VarlenCase, **kw) -> ConvBatch:
    return make_batch(
        rng,
        case.lengths,
        case.has_initial_state,
        padding=case.padding,
        pad_rows=case.pad_rows,
        **kw,
    )


@functools.cache
def _jitted_prefill(impl: str, activation, tiles):
    return jax.jit(
        functools.partial(
            pk.causal_conv1d,
            activation=activation,
            implementation=impl,
            config=prefill_config(impl, tiles),
        )
    )


def run_prefill(
    batch: ConvBatch, impl: str, activation="silu", tiles=SMALL_TILES, *, eager=False, **kw
):
    """``causal_conv1d`` on ``batch``, jitted once per (impl, activation, tiles): a jitted
    call compiles once per shape, where an eager Pallas call in interpret mode re-traces
    its kernel every time. Eager with ``eager=True`` or extra options (``validate=True``
    needs concrete arrays)."""
    if not eager and not kw:
        fn = _jitted_prefill(impl, activation, tiles)
        return fn(batch.x, batch.weight, batch.bias, **batch.kwargs())
    return pk.causal_conv1d(
        batch.x,
        batch.weight,
        batch.bias,
        **batch.kwargs(),
        activation=activation,
        implementation=impl,
        config=prefill_config(impl, tiles),
        **kw,
    )


def prefill_oracle(batch: ConvBatch, activation):
    return causal_conv1d_oracle(
        as_f32(batch.x),
        as_f32(batch.weight),
        None if batch.bias is None else as_f32(batch.bias),
        query_start_loc=batch.query_start_loc,
        conv_state_cache=as_f32(batch.conv_state_cache),
        slot_ids=batch.slot_ids,
        has_initial_state=batch.has_initial_state,
        activation=activation,
    )


def check_cache(new_cache, old_cache, ref_cache, written: set[int]) -> None:
    """Written slots hold exactly the oracle's columns (inputs are copied, not computed:
    stricter than a per-slot tolerance); every other line comes back bit-identical (NaN
    included)."""
    assert new_cache.dtype == old_cache.dtype and new_cache.shape == old_cache.shape
    expected = np.asarray(jnp.asarray(ref_cache, jnp.float32).astype(old_cache.dtype))
    for s in range(old_cache.shape[0]):
        if s in written:
            assert_bit_identical(np.asarray(new_cache[s]), expected[s], f"conv state of slot {s}")
        else:
            assert_bit_identical(new_cache[s], old_cache[s], f"unnamed cache line {s}")


def check_prefill(batch: ConvBatch, y, new_cache, activation) -> None:
    y_ref, cache_ref = prefill_oracle(batch, activation)
    assert y.dtype == batch.x.dtype and y.shape == batch.x.shape
    y32 = as_f32(y)
    assert np.all(np.isfinite(y32)), "non-finite output (NaN cache lines were read?)"
    assert np.all(y32[batch.dead_rows()] == 0), "padding rows must be exact zeros"
    assert_close_per_row(y32, y_ref, rtol=tolerance_for(batch.x.dtype), name="y")
    check_cache(new_cache, batch.conv_state_cache, cache_ref, batch.written_slots())


def make_update(rng, slot_ids, *, K, num_slots, steps=None, dim=DIM, dtype=jnp.float32):
    """Decode inputs: x[Bd, dim] (steps=None) or x[Bd, steps, dim], weight, bias, and a cache
    whose unnamed lines are NaN."""
    slot_ids = np.asarray(slot_ids, np.int32)
    shape = (len(slot_ids), dim) if steps is None else (len(slot_ids), steps, dim)
    cache = rng.normal(size=(num_slots, K - 1, dim)).astype(np.float32)
    cache[np.setdiff1d(np.arange(num_slots), slot_ids)] = np.nan
    return (
        normal(rng, shape, dtype),
        jnp.asarray(cache).astype(dtype),
        normal(rng, (dim, K), dtype, scale=0.5),
        normal(rng, (dim,), dtype),
        slot_ids,
    )


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("K", WIDTHS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("impl", PREFILL)
def test_prefill_matches_oracle_on_named_cases(impl, case, K, dtype):
    batch = case_batch(np.random.default_rng(0), case, K=K, dtype=dtype)
    y, cache = run_prefill(batch, impl, activation="silu")
    check_prefill(batch, y, cache, "silu")


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("activation", [None, "silu"], ids=["linear", "silu"])
@pytest.mark.parametrize("impl", PREFILL)
def test_prefill_activation_and_bias(impl, activation, with_bias):
    batch = case_batch(np.random.default_rng(1), MIXED, K=4, with_bias=with_bias)
    y, cache = run_prefill(batch, impl, activation=activation)
    check_prefill(batch, y, cache, activation)


@pytest.mark.parametrize("K", [3, 4])
@pytest.mark.parametrize("impl", PREFILL)
def test_sequence_shorter_than_state_shifts_the_state(impl, K):
    short = K - 2  # 1 or 2 new tokens: fewer than the K-1 state columns
    batch = make_batch(
        np.random.default_rng(2), (1, short, 1, short), (True, True, False, False), K=K
    )
    y, cache = run_prefill(batch, impl, activation=None)
    check_prefill(batch, y, cache, None)
    # Independent of the oracle: the new state is the old one shifted left by n columns
    # (zeros without an initial state) followed by the n new inputs.
    x, old = as_f32(batch.x), as_f32(batch.conv_state_cache)
    for b, slot in enumerate(batch.slot_ids):
        start, end = batch.query_start_loc[b], batch.query_start_loc[b + 1]
        history = old[slot] if batch.has_initial_state[b] else np.zeros_like(old[slot])
        expected = np.concatenate([history, x[start:end]])[end - start :]
        np.testing.assert_array_equal(as_f32(cache[slot]), expected)


@pytest.mark.parametrize("impl", PREFILL)
def test_has_initial_state_false_ignores_the_slot(impl):
    """A fresh prompt starts from zeros whatever its slot holds (here NaN), and equals the
    same prompt run with an explicit all-zero initial state."""
    rng = np.random.default_rng(3)
    fresh = make_batch(rng, (6, 3), (False, False), K=4)
    y_fresh, cache_fresh = run_prefill(fresh, impl)
    check_prefill(fresh, y_fresh, cache_fresh, "silu")
    zeros = dataclasses.replace(
        fresh,
        conv_state_cache=jnp.zeros_like(fresh.conv_state_cache),
        has_initial_state=np.ones(2, bool),
    )
    y_zeros, _ = run_prefill(zeros, impl)
    assert_close(as_f32(y_fresh), as_f32(y_zeros), rtol=1e-6, name="y")


@pytest.mark.parametrize("impl", PREFILL)
def test_padding_rows_and_unused_slots(impl):
    """Slot 0 is unnamed and NaN (a gather of slot -1 clamped to 0 would read it); padding
    sequences and bucket rows give exact zeros; nothing is written for them."""
    rng = np.random.default_rng(4)
    batch = make_batch(
        rng,
        (3, 2, 0, 4),
        (True, True, True, False),
        K=4,
        padding=(False, True, True, False),
        pad_rows=5,
    )
    batch.slot_ids[:] = [2, -1, -1, 3]
    cache = np.asarray(rng.normal(size=batch.conv_state_cache.shape), np.float32)
    cache[[0, 1, 3, 4, 5]] = np.nan  # only slot 2 (has_initial_state) is ever read
    batch.conv_state_cache = jnp.asarray(cache)
    y, new_cache = run_prefill(batch, impl)
    assert batch.dead_rows().sum() == 2 + 5
    check_prefill(batch, y, new_cache, "silu")


@pytest.mark.parametrize("impl", PREFILL)
def test_prefill_is_deterministic(impl):
    batch = case_batch(np.random.default_rng(5), MIXED, K=4, dtype=jnp.bfloat16)
    y1, cache1 = run_prefill(batch, impl, eager=True)
    y2, cache2 = run_prefill(batch, impl, eager=True)
    assert_bit_identical(y1, y2, "y")
    assert_bit_identical(cache1, cache2, "conv_state_cache")


@pytest.mark.parametrize("impl", PREFILL)
def test_prefill_under_jit(impl):
    batch = case_batch(np.random.default_rng(6), CASES[3], K=3)
    fn = jax.jit(
        functools.partial(
            pk.causal_conv1d,
            activation="silu",
            implementation=impl,
            config=prefill_config(impl),
        )
    )
    y, cache = fn(batch.x, batch.weight, batch.bias, **batch.kwargs())
    check_prefill(batch, y, cache, "silu")


@pytest.mark.parametrize("impl", PREFILL)
def test_prefill_runs_the_named_implementation(impl):
    """The named backend is the one selected (no hand-off), and a Pallas backend really
    runs a ``pallas_call`` (the xla path none)."""
    batch = case_batch(np.random.default_rng(7), MIXED, K=4)
    fn = functools.partial(pk.causal_conv1d, activation="silu", implementation=impl)
    args = (batch.x, batch.weight, batch.bias)
    assert pk.backend_for(fn, *args, **batch.kwargs()) == impl
    assert pk.backend_for(fn, *args, **batch.kwargs(), config=prefill_config(impl)) == impl
    jaxpr = str(jax.make_jaxpr(fn)(*args, **batch.kwargs()))
    assert ("pallas_call" in jaxpr) == (impl != "xla")


@pytest.mark.parametrize("impl", PREFILL)
def test_prefill_default_tiling(impl):
    """The default tiling (128-row blocks; what the GPU runs), with sequences spanning
    several blocks and one shorter than K - 1, compared row by row and slot by slot."""
    batch = make_batch(
        np.random.default_rng(8), (150, 1, 131, 2), (True, True, False, True), K=4, pad_rows=9
    )
    y, cache = run_prefill(batch, impl, tiles=None)
    check_prefill(batch, y, cache, "silu")


@pytest.mark.parametrize("impl", PREFILL)
def test_prefill_out_of_range_slot_ids_are_padding(impl):
    """Slot ids >= S and < -1 behave exactly like -1 (DESIGN.md §8): the sequence's rows
    are 0, its slot is neither read nor written (every unnamed slot is NaN, including
    those a wrapped or clamped id would hit), other rows and the cache are bit-identical
    to the run with -1. ``validate=True`` rejects them."""
    batch = case_batch(np.random.default_rng(9), MIXED, K=4, extra_slots=4)
    num_slots = batch.conv_state_cache.shape[0]  # 8; the MIXED batch names 4 of them
    row = 2  # the 6-token sequence with an initial state
    named = np.delete(batch.slot_ids, row)
    batch.conv_state_cache = poison_slots(batch.conv_state_cache, named)
    fn = jax.jit(
        lambda slot_ids: pk.causal_conv1d(
            batch.x,
            batch.weight,
            batch.bias,
            **(batch.kwargs() | dict(slot_ids=slot_ids)),
            implementation=impl,
            config=prefill_config(impl),
        )
    )

    def run(slot_ids):
        y, cache = fn(jnp.asarray(slot_ids))
        return (y,), (cache,)

    (y,), (cache,) = check_out_of_range_slots_are_padding(
        run, batch.slot_ids, row, num_slots=num_slots
    )
    padded = dataclasses.replace(batch, slot_ids=np.where(np.arange(4) == row, -1, batch.slot_ids))
    check_prefill(padded, y, cache, "silu")  # the row is 0; slots not named untouched
    for bad in out_of_range_slot_ids(num_slots):
        slots = batch.slot_ids.copy()
        slots[row] = bad
        with pytest.raises(ValueError, match="slot_ids must be -1 or in"):
            run_prefill(dataclasses.replace(batch, slot_ids=slots), impl, validate=True)


@pytest.mark.parametrize("impl", PREFILL)
@given(
    K=st.sampled_from(WIDTHS),
    lengths=st.lists(st.sampled_from([0, 1, 2, 3, 5, 8]), min_size=4, max_size=4),
    has_init=st.lists(st.booleans(), min_size=4, max_size=4),
    padding=st.lists(st.sampled_from([False, False, True]), min_size=4, max_size=4),
    activation=st.sampled_from([None, "silu"]),
    seed=st.integers(0, 2**16),
)
def test_prefill_property_random_batches(impl, K, lengths, has_init, padding, activation, seed):
    # Fixed T (bucket) and B: shapes depend on K only, so few compilations.
    batch = make_batch(
        np.random.default_rng(seed),
        lengths,
        has_init,
        K=K,
        padding=padding,
        pad_rows=32 - sum(lengths),
    )
    y, cache = run_prefill(batch, impl, activation=activation)
    check_prefill(batch, y, cache, activation)


@pytest.mark.parametrize("impl", PREFILL)
@given(
    K=st.sampled_from(WIDTHS),
    lengths=st.lists(st.sampled_from([1, 2, 3, 6, 9]), min_size=3, max_size=3),
    cut_fraction=st.lists(st.sampled_from([0.0, 0.2, 0.5, 0.9, 1.0]), min_size=3, max_size=3),
    seed=st.integers(0, 2**16),
)
def test_prefill_split_anywhere_with_carried_state_changes_nothing(
    impl, K, lengths, cut_fraction, seed
):
    """Chunked prefill: two calls (the second with has_initial_state) equal one call."""
    rng = np.random.default_rng(seed)
    whole = make_batch(rng, lengths, (False,) * 3, K=K, pad_rows=32 - sum(lengths))
    y_whole, cache_whole = run_prefill(whole, impl)
    check_prefill(whole, y_whole, cache_whole, "silu")

    firsts = [int(round(f * n)) for f, n in zip(cut_fraction, lengths, strict=True)]
    seconds = [n - m for n, m in zip(lengths, firsts, strict=True)]
    x = np.asarray(whole.x)
    starts = whole.query_start_loc[:-1]
    rows1 = np.concatenate([np.arange(s, s + m) for s, m in zip(starts, firsts, strict=True)])
    rows2 = np.concatenate(
        [np.arange(s + m, s + n) for s, m, n in zip(starts, firsts, lengths, strict=True)]
    )
    # Same bucket size for both calls; padding rows hold arbitrary (non-zero) data.
    pad = rng.normal(size=(32, DIM)).astype(np.float32)
    x1, x2 = pad.copy(), pad.copy()
    x1[: len(rows1)], x2[: len(rows2)] = x[rows1], x[rows2]
    first = dataclasses.replace(whole, x=jnp.asarray(x1), query_start_loc=query_start_loc(firsts))
    y1, cache1 = run_prefill(first, impl)
    # A sequence whose first part was empty still has no state: its slot is untouched.
    second = dataclasses.replace(
        whole,
        x=jnp.asarray(x2),
        query_start_loc=query_start_loc(seconds),
        conv_state_cache=cache1,
        has_initial_state=np.asarray(firsts) > 0,
    )
    y2, cache2 = run_prefill(second, impl)

    y_split = np.zeros_like(as_f32(y_whole))
    y_split[rows1], y_split[rows2] = as_f32(y1)[: len(rows1)], as_f32(y2)[: len(rows2)]
    assert_close(y_split, as_f32(y_whole), rtol=1e-5, name="y (split vs whole)")
    assert_bit_identical(cache2, cache_whole, "final conv state (split vs whole)")


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("steps", [None, 1, 3, 5], ids=["x2d", "L1", "L3", "L5"])
@pytest.mark.parametrize("K", WIDTHS)
@pytest.mark.parametrize("impl", UPDATE)
def test_update_matches_oracle(impl, K, steps, dtype):
    x, cache, weight, bias, slot_ids = make_update(
        np.random.default_rng(10), [3, -1, 0, 5], K=K, num_slots=6, steps=steps, dtype=dtype
    )
    y, new_cache = pk.causal_conv1d_update(
        x, cache, weight, bias, slot_ids=slot_ids, activation="silu", implementation=impl
    )
    y_ref, cache_ref = causal_conv1d_update_oracle(
        as_f32(x),
        as_f32(cache),
        as_f32(weight),
        as_f32(bias),
        slot_ids=slot_ids,
        activation="silu",
    )
    assert y.shape == x.shape and y.dtype == x.dtype
    y32 = as_f32(y)
    assert np.all(np.isfinite(y32))
    assert np.all(y32[1] == 0), "slot -1 row must be exact zeros"
    assert_close_per_row(y32, y_ref, rtol=tolerance_for(dtype), name="y")
    check_cache(new_cache, cache, cache_ref, written={0, 3, 5})


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("activation", [None, "silu"], ids=["linear", "silu"])
@pytest.mark.parametrize("impl", UPDATE)
def test_update_activation_and_bias(impl, activation, with_bias):
    x, cache, weight, bias, slot_ids = make_update(
        np.random.default_rng(11), [1, 2, -1], K=3, num_slots=4, steps=2
    )
    bias = bias if with_bias else None
    y, new_cache = pk.causal_conv1d_update(
        x, cache, weight, bias, slot_ids=slot_ids, activation=activation, implementation=impl
    )
    y_ref, cache_ref = causal_conv1d_update_oracle(
        x, cache, weight, bias, slot_ids=slot_ids, activation=activation
    )
    assert np.all(as_f32(y)[2] == 0)
    assert_close_per_row(y, y_ref, rtol=1e-5, name="y")
    check_cache(new_cache, cache, cache_ref, written={1, 2})


@pytest.mark.parametrize("impl", UPDATE)
def test_update_with_only_padding_rows_changes_nothing(impl):
    x, cache, weight, bias, _ = make_update(np.random.default_rng(12), [0], K=4, num_slots=3)
    cache = cache.at[0].set(jnp.nan)  # slot 0 is now unnamed too
    slot_ids = np.full(1, -1, np.int32)
    y, new_cache = pk.causal_conv1d_update(
        x, cache, weight, bias, slot_ids=slot_ids, implementation=impl
    )
    assert np.all(np.asarray(y) == 0)
    assert_bit_identical(new_cache, cache, "conv_state_cache")


@pytest.mark.parametrize("impl", UPDATE)
def test_update_is_deterministic_and_jittable(impl):
    x, cache, weight, bias, slot_ids = make_update(
        np.random.default_rng(13), [2, -1, 0], K=4, num_slots=4, steps=3, dtype=jnp.bfloat16
    )
    eager = [
        pk.causal_conv1d_update(x, cache, weight, bias, slot_ids=slot_ids, implementation=impl)
        for _ in range(2)
    ]
    assert_bit_identical(eager[0][0], eager[1][0], "y")
    assert_bit_identical(eager[0][1], eager[1][1], "conv_state_cache")
    fn = jax.jit(functools.partial(pk.causal_conv1d_update, implementation=impl))
    y, new_cache = fn(x, cache, weight, bias, slot_ids=slot_ids)
    y_ref, cache_ref = causal_conv1d_update_oracle(
        as_f32(x), as_f32(cache), as_f32(weight), as_f32(bias), slot_ids=slot_ids, activation="silu"
    )
    assert_close(as_f32(y), y_ref, rtol=tolerance_for(jnp.bfloat16), name="y (jit)")
    check_cache(new_cache, cache, cache_ref, written={0, 2})


@pytest.mark.parametrize("impl", UPDATE)
def test_update_runs_the_named_implementation(impl):
    x, cache, weight, bias, slot_ids = make_update(
        np.random.default_rng(14), [1, 0], K=4, num_slots=2
    )
    fn = functools.partial(pk.causal_conv1d_update, slot_ids=slot_ids, implementation=impl)
    assert pk.backend_for(fn, x, cache, weight, bias) == impl
    jaxpr = str(jax.make_jaxpr(fn)(x, cache, weight, bias))
    assert ("pallas_call" in jaxpr) == (impl != "xla")


@pytest.mark.parametrize("steps", [None, 3], ids=["x2d", "L3"])
@pytest.mark.parametrize("impl", UPDATE)
def test_update_out_of_range_slot_ids_are_padding(impl, steps):
    """Slot ids >= S and < -1 behave exactly like -1 (DESIGN.md §8): the row's y is 0,
    nothing is read or written for it (every unnamed slot is NaN), other rows and the
    cache are bit-identical to the run with -1. ``validate=True`` rejects them."""
    num_slots, row = 8, 1
    x, cache, weight, bias, slot_ids = make_update(
        np.random.default_rng(15), [3, 5, 0, 4], K=4, num_slots=num_slots, steps=steps
    )
    cache = poison_slots(cache, np.delete(slot_ids, row))  # slot 5 too
    fn = jax.jit(
        lambda slot_ids: pk.causal_conv1d_update(
            x, cache, weight, bias, slot_ids=slot_ids, implementation=impl
        )
    )

    def run(ids):
        y, new_cache = fn(jnp.asarray(ids))
        return (y,), (new_cache,)

    (y,), (new_cache,) = check_out_of_range_slots_are_padding(
        run, slot_ids, row, num_slots=num_slots
    )
    padded = np.where(np.arange(4) == row, -1, slot_ids)
    y_ref, cache_ref = causal_conv1d_update_oracle(
        x, cache, weight, bias, slot_ids=padded, activation="silu"
    )
    assert np.all(np.asarray(y)[row] == 0)
    assert_close_per_row(y, y_ref, rtol=1e-5, name="y")
    check_cache(new_cache, cache, cache_ref, written={3, 0, 4})
    for bad in out_of_range_slot_ids(num_slots):
        ids = slot_ids.copy()
        ids[row] = bad
        with pytest.raises(ValueError, match="slot_ids must be -1 or in"):
            pk.causal_conv1d_update(
                x, cache, weight, bias, slot_ids=ids, implementation=impl, validate=True
            )


# --------------------------------------------------------------------------- prefill + decode


@pytest.mark.parametrize("mode", ["token_by_token", "multi_token"])
@pytest.mark.parametrize("K", WIDTHS)
@pytest.mark.parametrize("update_impl", UPDATE)
@pytest.mark.parametrize("prefill_impl", PREFILL)
def test_prefill_then_decode_equals_one_prefill(prefill_impl, update_impl, K, mode):
    """Prefill a prefix, then decode the remaining tokens (one by one with x[Bd, dim], or
    all at once with x[Bd, L, dim]): outputs and final states equal one longer prefill."""
    rng = np.random.default_rng(20 + K)
    full_lengths, prefix_lengths, steps = (10, 7, 5), (6, 3, 1), 4
    whole = make_batch(rng, full_lengths, (False,) * 3, K=K)
    whole.slot_ids[:] = [2, 0, 4]  # slots 1, 3 unnamed (NaN)
    y_whole, cache_whole = run_prefill(whole, prefill_impl)
    check_prefill(whole, y_whole, cache_whole, "silu")

    x = np.asarray(whole.x)
    starts = whole.query_start_loc[:-1]
    prefix_rows = np.concatenate(
        [np.arange(s, s + p) for s, p in zip(starts, prefix_lengths, strict=True)]
    )
    tail_rows = np.stack(
        [np.arange(s + p, s + p + steps) for s, p in zip(starts, prefix_lengths, strict=True)]
    )
    prefix = dataclasses.replace(
        whole, x=jnp.asarray(x[prefix_rows]), query_start_loc=query_start_loc(prefix_lengths)
    )
    y_prefix, cache = run_prefill(prefix, prefill_impl)

    decode = jax.jit(  # one compile for every decode step
        functools.partial(
            pk.causal_conv1d_update,
            weight=whole.weight,
            bias=whole.bias,
            slot_ids=whole.slot_ids,
            activation="silu",
            implementation=update_impl,
        )
    )
    x_tail = jnp.asarray(x[tail_rows])  # [Bd, steps, dim]
    if mode == "token_by_token":
        ys = []
        for i in range(steps):
            y_i, cache = decode(x_tail[:, i], cache)
            assert y_i.shape == (3, DIM)
            ys.append(y_i)
        y_tail = jnp.stack(ys, axis=1)
    else:
        y_tail, cache = decode(x_tail, cache)
        assert y_tail.shape == (3, steps, DIM)

    y_split = np.zeros_like(as_f32(y_whole))
    y_split[prefix_rows] = as_f32(y_prefix)
    y_split[tail_rows.ravel()] = as_f32(y_tail).reshape(-1, DIM)
    assert_close(y_split, as_f32(y_whole), rtol=1e-5, name="y (prefill + decode vs prefill)")
    for slot in (0, 2, 4):
        assert_bit_identical(cache[slot], cache_whole[slot], f"state of slot {slot}")
    for slot in (1, 3):
        assert_bit_identical(cache[slot], whole.conv_state_cache[slot], f"unnamed slot {slot}")


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("impl", PREFILL)
def test_prefill_argument_errors_name_the_argument(impl):
    batch = case_batch(np.random.default_rng(30), MIXED, K=4)
    call = functools.partial(run_prefill, impl=impl)
    bad = {
        "weight": dict(weight=batch.weight[:, :3].T),
        "bias": dict(bias=batch.bias[:5]),
        "conv_state_cache": dict(conv_state_cache=batch.conv_state_cache[:, :2]),
        "slot_ids": dict(slot_ids=batch.slot_ids[:2]),
        "has_initial_state": dict(has_initial_state=batch.has_initial_state[:1]),
        "query_start_loc": dict(query_start_loc=batch.query_start_loc.astype(np.float32)),
        "x must": dict(x=batch.x[None]),
    }
    for name, change in bad.items():
        with pytest.raises(ValueError, match=name):
            call(dataclasses.replace(batch, **change))
    with pytest.raises(ValueError, match="weight"):
        call(dataclasses.replace(batch, weight=batch.weight[:, :1]))  # K = 1
    with pytest.raises(ValueError, match="activation"):
        call(batch, activation="gelu")


@pytest.mark.parametrize("impl", PREFILL)
def test_prefill_validate_rejects_bad_data(impl):
    batch = case_batch(np.random.default_rng(31), MIXED, K=4)
    run_prefill(batch, impl, validate=True)  # valid data passes
    bad_qsl = batch.query_start_loc.copy()
    bad_qsl[2] = bad_qsl[1] - 1
    with pytest.raises(ValueError, match="query_start_loc"):
        run_prefill(dataclasses.replace(batch, query_start_loc=bad_qsl), impl, validate=True)
    past_end = batch.query_start_loc.copy()
    past_end[-1] = batch.x.shape[0] + 1
    with pytest.raises(ValueError, match="query_start_loc"):
        run_prefill(dataclasses.replace(batch, query_start_loc=past_end), impl, validate=True)
    num_slots = batch.conv_state_cache.shape[0]
    for slots in ([0, 1, 2, num_slots], [0, 1, -2, 3], [-7, 1, 2, 3], [0, 1, 1, 3]):
        with pytest.raises(ValueError, match="slot_ids"):
            run_prefill(
                dataclasses.replace(batch, slot_ids=np.asarray(slots, np.int32)),
                impl,
                validate=True,
            )


@pytest.mark.parametrize("impl", UPDATE)
def test_update_argument_errors_name_the_argument(impl):
    x, cache, weight, bias, slot_ids = make_update(
        np.random.default_rng(32), [1, 0], K=4, num_slots=3
    )
    call = functools.partial(pk.causal_conv1d_update, implementation=impl)
    with pytest.raises(ValueError, match="weight"):
        call(x, cache, weight[:8], bias, slot_ids=slot_ids)
    with pytest.raises(ValueError, match="bias"):
        call(x, cache, weight, bias[:3], slot_ids=slot_ids)
    with pytest.raises(ValueError, match="conv_state_cache"):
        call(x, cache[:, :2], weight, bias, slot_ids=slot_ids)
    with pytest.raises(ValueError, match="conv_state_cache"):
        call(x, cache[0], weight, bias, slot_ids=slot_ids)
    with pytest.raises(ValueError, match="slot_ids"):
        call(x, cache, weight, bias, slot_ids=slot_ids[:1])
    with pytest.raises(ValueError, match="x"):
        call(x[None, None], cache, weight, bias, slot_ids=slot_ids)
    with pytest.raises(ValueError, match="activation"):
        call(x, cache, weight, bias, slot_ids=slot_ids, activation="relu")
    with pytest.raises(ValueError, match="slot_ids"):
        call(x, cache, weight, bias, slot_ids=np.asarray([1, 3], np.int32), validate=True)
    with pytest.raises(ValueError, match="slot_ids"):
        call(x, cache, weight, bias, slot_ids=np.asarray([1, 1], np.int32), validate=True)


# --------------------------------------------------------------------------- GPU, real sizes


def real_size_batch(rng, case: str, dim: int) -> ConvBatch:
    """``few``: 8 sequences (length-1 decode rows, a padding sequence, empty ones) in an
    8192-token bucket; ``many``: 64 random sequences filling a 65,536-token bucket."""
    if case == "few":
        lengths = (3000, 1, 1, 2048, 0, 1, 1024, 77)
        has_init = (False, True, True, True, False, True, False, True)
        padding = (False, False, False, False, True, False, False, False)
        pad_rows = 8192 - sum(lengths)
    else:
        lengths = rng.integers(1, 2000, size=64)
        lengths[rng.choice(64, 8, replace=False)] = 1
        has_init = rng.random(64) < 0.5
        padding = rng.random(64) < 0.1
        pad_rows = 65536 - int(lengths.sum())
    return make_batch(
        rng,
        tuple(int(n) for n in lengths),
        has_init,
        K=4,
        dim=dim,
        dtype=jnp.bfloat16,
        padding=padding,
        pad_rows=pad_rows,
        extra_slots=64,
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dim", "case"),
    [(2048, "few"), (2064, "few"), (4096, "few"), (8448, "few"), (2064, "many"), (8448, "many")],
)
@pytest.mark.parametrize("impl", PREFILL)
def test_prefill_real_size(impl, dim, case):
    batch = real_size_batch(np.random.default_rng(40), case, dim)
    y, cache = run_prefill(batch, impl, tiles=None)  # the default tiling, as served
    check_prefill(batch, y, cache, "silu")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", PREFILL)
def test_prefill_strided_input(impl):
    """x as a column slice of the wider in_proj output, as the mixer passes it."""
    dim, offset = 2064, 4096 + 8
    batch = real_size_batch(np.random.default_rng(42), "few", dim)
    rng = np.random.default_rng(43)
    wide = jnp.concatenate(
        [
            normal(rng, (batch.x.shape[0], offset), jnp.bfloat16),
            batch.x,
            normal(rng, (batch.x.shape[0], 24), jnp.bfloat16),
        ],
        axis=1,
    )
    call = jax.jit(
        lambda wide: pk.causal_conv1d(
            wide[:, offset : offset + dim],
            batch.weight,
            batch.bias,
            **batch.kwargs(),
            activation="silu",
            implementation=impl,
        )
    )
    y, cache = call(wide)
    check_prefill(batch, y, cache, "silu")


@pytest.mark.gpu
@pytest.mark.parametrize("steps", [None, 4])
@pytest.mark.parametrize("impl", UPDATE)
def test_update_real_size(impl, steps):
    rng = np.random.default_rng(41)
    slot_ids = rng.permutation(512)[:256]
    slot_ids[::17] = -1
    x, cache, weight, bias, slot_ids = make_update(
        rng, slot_ids, K=4, num_slots=512, steps=steps, dim=4096, dtype=jnp.bfloat16
    )
    y, new_cache = pk.causal_conv1d_update(
        x, cache, weight, bias, slot_ids=slot_ids, implementation=impl
    )
    y_ref, cache_ref = causal_conv1d_update_oracle(
        as_f32(x), as_f32(cache), as_f32(weight), as_f32(bias), slot_ids=slot_ids, activation="silu"
    )
    assert np.all(as_f32(y)[slot_ids < 0] == 0)
    assert_close_per_row(as_f32(y), y_ref, rtol=tolerance_for(jnp.bfloat16), name="y")
    check_cache(new_cache, cache, cache_ref, written={int(s) for s in slot_ids if s >= 0})


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("dim", [64, 2064])
def test_internal_triton_kernels_lower_for_cuda(width, dim):
    """The Triton kernels lower for CUDA (interpret mode does not enforce Triton's rules),
    bf16 SiLU on the hardware tanh included (inline PTX, which interpret mode skips)."""
    T, B, S = 256, 3, 4

    def prefill(x, w, b, qsl, cache, slots, has_state):
        return conv_triton.causal_conv1d(
            x,
            w,
            b,
            query_start_loc=qsl,
            conv_state_cache=cache,
            slot_ids=slots,
            has_initial_state=has_state,
            activation="silu",
            config=conv_config.default_block_sizes(dim, width),
        )

    text = lower_for_cuda(
        prefill,
        spec((T, dim)),
        spec((dim, width)),
        spec((dim,)),
        spec((B + 1,), jnp.int32),
        spec((S, width - 1, dim)),
        spec((B,), jnp.int32),
        spec((B,), jnp.bool_),
    )
    assert "causal_conv1d_k" in text
    assert "tanh.approx" in text  # bf16 output: the hardware-tanh SiLU

    def update(x, cache, w, slots):
        return conv_triton.causal_conv1d_update(
            x,
            cache,
            w,
            None,
            slot_ids=slots,
            activation="silu",
            config=conv_config.default_update_block_sizes(dim),
        )

    text = lower_for_cuda(
        update,
        spec((B, 3, dim)),
        spec((S, width - 1, dim), jnp.float32),
        spec((dim, width)),
        spec((B,), jnp.int32),
    )
    assert "causal_conv1d_update_k" in text
    assert "tanh.approx" in text  # x (so y) is bf16; the fp32 cache does not matter
