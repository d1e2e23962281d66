"""``masked_tail_attention``, ``write_kv`` and ``kv_lens_from_mask`` against the float64
oracles.

Every KV cache holds NaN past each sequence's ``kv_lens`` and in every slot no sequence
names (``poison_tail``): an implementation that reads a masked tail shows NaN. Every test
runs against every implementation in the op's registry (Pallas kernels in interpret mode
off-GPU), on small shapes.
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
from pallas_kernels.attention import _layout as attention_layout
from pallas_kernels.attention import api
from pallas_kernels.attention import mosaic as attention_mosaic
from pallas_kernels.attention import mosaic_common as attention_mosaic_common
from pallas_kernels.attention import mosaic_config as attention_mosaic_config
from pallas_kernels.attention import triton as attention_triton
from pallas_kernels.attention import triton_config as attention_config
from pallas_kernels.attention import triton_decode as attention_decode
from pallas_kernels.backend import on_gpu, supports_mosaic
from pallas_kernels.testing import (
    assert_close,
    assert_close_per_row,
    assert_slots_untouched,
    attention_oracle,
    kv_lens_from_mask_oracle,
    tolerance_for,
    write_kv_oracle,
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
    poison_tail,
    query_start_loc,
    skip_if_mosaic_refuses,
    spec,
)

ATTENTION = implementations(api.MASKED_TAIL_ATTENTION)
WRITE_KV = implementations(api.WRITE_KV)
DTYPES = (jnp.float32, jnp.bfloat16)
CACHE_LEN = 32


# --------------------------------------------------------------------------- helpers


@dataclasses.dataclass(frozen=True)
class VarlenCase:
    """Per-sequence query lengths and KV lengths (this step's tokens included), padding
    sequences (slot -1) and bucket padding rows past ``query_start_loc[-1]``."""

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    padding: tuple[bool, ...] | None = None
    pad_rows: int = 0


CASES = (
    VarlenCase("prefill", (5, 12, 3), (5, 12, 3)),
    VarlenCase("chunked_prefill", (3, 8, 16), (19, 24, 32)),
    VarlenCase("decode", (1, 1, 1, 1, 1), (1, 7, 16, 17, 32)),
    VarlenCase("mixed", (9, 1, 4, 1), (9, 17, 25, 32)),
    VarlenCase(
        "padded",
        (4, 0, 1, 3, 0),
        (6, 0, 11, 3, 5),
        padding=(False, True, False, True, False),
        pad_rows=6,
    ),
)
CASE_IDS = [c.name for c in CASES]
MIXED = CASES[3]


@dataclasses.dataclass
class AttentionBatch:
    q: jax.Array
    k_cache: jax.Array
    v_cache: jax.Array
    query_start_loc: np.ndarray
    kv_lens: np.ndarray
    slot_ids: np.ndarray

    def kwargs(self) -> dict:
        return dict(
            query_start_loc=self.query_start_loc, kv_lens=self.kv_lens, slot_ids=self.slot_ids
        )

    def dead_rows(self) -> np.ndarray:
        """bool[T]: rows of padding sequences and rows past ``query_start_loc[-1]``."""
        return dead_rows(self.q.shape[0], self.query_start_loc, self.slot_ids)


def make_batch(
    rng: np.random.Generator,
    q_lens,
    kv_lens,
    *,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    cache_len: int = CACHE_LEN,
    dtype=jnp.float32,
    padding=None,
    pad_rows: int = 0,
    extra_slots: int = 2,
    q_scale: float = 1.0,
    slot_ids=None,
) -> AttentionBatch:
    """Random queries and caches in random slots (or ``slot_ids``); every cache entry no
    query may see (past ``kv_lens``, unnamed slots) is NaN."""
    num_seqs = len(q_lens)
    num_slots = num_seqs + extra_slots
    if slot_ids is None:
        slot_ids = rng.permutation(num_slots)[:num_seqs]
    slot_ids = np.array(slot_ids, np.int32)
    if padding is not None:
        slot_ids[np.asarray(padding, bool)] = -1
    kv_lens = np.asarray(kv_lens, np.int32)
    shape = (num_slots, cache_len, num_kv_heads, head_dim)
    k_cache = poison_tail(rng.normal(size=shape), slot_ids, kv_lens)
    v_cache = poison_tail(rng.normal(size=shape), slot_ids, kv_lens)
    num_tokens = int(sum(q_lens)) + pad_rows
    return AttentionBatch(
        q=normal(rng, (num_tokens, num_q_heads, head_dim), dtype, scale=q_scale),
        k_cache=jnp.asarray(k_cache).astype(dtype),
        v_cache=jnp.asarray(v_cache).astype(dtype),
        query_start_loc=query_start_loc(q_lens),
        kv_lens=kv_lens,
        slot_ids=slot_ids,
    )


def case_batch(rng, case: VarlenCase, **kw) -> AttentionBatch:
    return make_batch(
        rng, case.q_lens, case.kv_lens, padding=case.padding, pad_rows=case.pad_rows, **kw
    )


def skip_unless_served(batch: AttentionBatch, impl: str, **options) -> None:
    """``mosaic`` (on a Hopper GPU) serves only some batches (bf16/fp16 prefill, head dim
    64 or 128, T and L multiples of 8) and raises on the others: the test is skipped with
    the reason rather than run on another backend."""
    skip_if_mosaic_refuses(
        pk.masked_tail_attention,
        batch.q,
        batch.k_cache,
        batch.v_cache,
        implementation=impl,
        **options,
        **batch.kwargs(),
    )


def run_attention(batch: AttentionBatch, impl: str, **options):
    """``masked_tail_attention`` on ``batch`` (skipped where ``impl`` cannot serve it)."""
    skip_unless_served(batch, impl, **options)
    fn = functools.partial(pk.masked_tail_attention, implementation=impl, **options)
    return fn(batch.q, batch.k_cache, batch.v_cache, **batch.kwargs())


def check_attention(batch: AttentionBatch, out, **options) -> np.ndarray:
    """Finite, exact zeros where the oracle has no visible key or a padding row, and
    within the dtype's tolerance of the oracle. Returns the oracle's all-zero rows."""
    ref = attention_oracle(
        as_f32(batch.q),
        as_f32(batch.k_cache),
        as_f32(batch.v_cache),
        **batch.kwargs(),
        **options,
    )
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    out32 = as_f32(out)
    assert np.all(np.isfinite(out32)), "non-finite output: a masked cache entry was read"
    zero_rows = np.all(ref == 0, axis=(1, 2))
    assert np.all(zero_rows[batch.dead_rows()])
    assert np.all(out32[zero_rows] == 0), "rows without a visible key must be exact zeros"
    assert_close_per_row(out32, ref, rtol=tolerance_for(batch.q.dtype), name="out")
    return zero_rows


# --------------------------------------------------------------------------- attention


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("impl", ATTENTION)
def test_attention_matches_oracle_on_named_cases(impl, case, causal, dtype):
    batch = case_batch(np.random.default_rng(0), case, dtype=dtype)
    out = run_attention(batch, impl, causal=causal)
    check_attention(batch, out, causal=causal)


@pytest.mark.parametrize("head_dim", [8, 16])
@pytest.mark.parametrize(
    "num_q_heads, num_kv_heads", [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (4, 4)]
)
@pytest.mark.parametrize("impl", ATTENTION)
def test_grouped_query_heads(impl, num_q_heads, num_kv_heads, head_dim):
    batch = case_batch(
        np.random.default_rng(1),
        MIXED,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
    out = run_attention(batch, impl)
    check_attention(batch, out)


@pytest.mark.parametrize("impl", ATTENTION)
def test_query_heads_read_their_own_kv_head(impl):
    """Doubling the values of KV head 1 doubles exactly the query heads mapped to it
    (head h uses KV head h // (Hq // Hkv): heads 2, 3) and leaves heads 0, 1 alone."""
    batch = case_batch(np.random.default_rng(2), MIXED, num_q_heads=4, num_kv_heads=2)
    base = as_f32(run_attention(batch, impl))
    moved = dataclasses.replace(batch, v_cache=batch.v_cache.at[:, :, 1].multiply(2.0))
    out = as_f32(run_attention(moved, impl))
    live = ~batch.dead_rows()
    np.testing.assert_array_equal(out[:, :2], base[:, :2])
    np.testing.assert_allclose(out[live, 2:], 2 * base[live, 2:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("window", [1, 3, 8, 64])
@pytest.mark.parametrize("impl", ATTENTION)
def test_sliding_window(impl, window, causal):
    # Window 1: each query sees only itself; 64 > every kv_len: the window changes nothing.
    batch = make_batch(np.random.default_rng(3), (6, 1, 10, 1), (6, 20, 30, 2))
    out = run_attention(batch, impl, causal=causal, sliding_window=window)
    check_attention(batch, out, causal=causal, sliding_window=window)
    if window == 64:
        plain = run_attention(batch, impl, causal=causal)
        assert_close(as_f32(out), as_f32(plain), rtol=1e-6, name="window > kv_len")


@pytest.mark.parametrize("sm_scale, q_scale", [(0.05, 1.0), (1.0, 1.0), (1.0, 30.0)])
@pytest.mark.parametrize("impl", ATTENTION)
def test_custom_sm_scale(impl, sm_scale, q_scale):
    """Includes logits in the thousands: the softmax must subtract the row max."""
    batch = case_batch(np.random.default_rng(4), CASES[1], q_scale=q_scale)
    out = run_attention(batch, impl, sm_scale=sm_scale)
    check_attention(batch, out, sm_scale=sm_scale)


@pytest.mark.parametrize("impl", ATTENTION)
def test_default_sm_scale_is_inverse_sqrt_head_dim(impl):
    batch = case_batch(np.random.default_rng(5), MIXED, head_dim=8)
    default = as_f32(run_attention(batch, impl))
    explicit = as_f32(run_attention(batch, impl, sm_scale=8**-0.5))
    assert_close(default, explicit, rtol=1e-6, name="out")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ATTENTION)
def test_padding_sequences_and_bucket_rows_are_exact_zero(impl, dtype):
    """Slot 0 is unnamed and all NaN: a padding row whose slot -1 were clamped to 0 would
    read it. Padding sequences with and without tokens, a zero-length sequence with a
    slot, and rows past ``query_start_loc[-1]`` (non-zero queries) all give 0."""
    batch = make_batch(
        np.random.default_rng(6),
        (3, 0, 2, 0, 4),
        (7, 0, 2, 9, 4),
        padding=(False, True, True, False, False),
        pad_rows=5,
        dtype=dtype,
        slot_ids=[3, -1, -1, 1, 2],
    )
    assert np.all(np.isnan(as_f32(batch.k_cache[0])))
    for causal in (True, False):
        out = run_attention(batch, impl, causal=causal)
        zero_rows = check_attention(batch, out, causal=causal)
        assert zero_rows.sum() == 2 + 5


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("impl", ATTENTION)
def test_rows_without_visible_keys_return_zero_not_nan(impl, causal):
    """kv_lens = 0 with queries (no key at all), and kv_lens < q_len under the causal mask
    (the first rows sit at negative positions): such rows are 0, the others exact."""
    batch = make_batch(np.random.default_rng(7), (3, 5, 2), (0, 3, 6))
    out = run_attention(batch, impl, causal=causal)
    zero_rows = check_attention(batch, out, causal=causal)
    expected_zero = 3 + (2 if causal else 0)
    assert zero_rows.sum() == expected_zero


@pytest.mark.parametrize("impl", ATTENTION)
def test_kv_lens_past_cache_length_stays_in_bounds(impl):
    """Data the validator would reject: kv_lens > L. Kernels must stay in bounds; the
    result is the oracle's (kv_lens clipped to L)."""
    batch = make_batch(np.random.default_rng(8), (3, 1), (CACHE_LEN + 5, CACHE_LEN + 1))
    out = run_attention(batch, impl)
    check_attention(batch, out)


@pytest.mark.parametrize("impl", ATTENTION)
def test_attention_is_deterministic(impl):
    batch = case_batch(np.random.default_rng(9), CASES[1], dtype=jnp.bfloat16)
    first = run_attention(batch, impl, sliding_window=7)
    second = run_attention(batch, impl, sliding_window=7)
    assert_bit_identical(first, second, "out")


@pytest.mark.parametrize("impl", ATTENTION)
def test_attention_under_jit(impl):
    batch = case_batch(np.random.default_rng(10), CASES[4])
    skip_unless_served(batch, impl)
    fn = jax.jit(
        functools.partial(
            pk.masked_tail_attention, causal=True, sliding_window=5, implementation=impl
        )
    )
    out = fn(batch.q, batch.k_cache, batch.v_cache, **batch.kwargs())
    check_attention(batch, out, causal=True, sliding_window=5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ATTENTION)
def test_attention_runs_the_named_implementation(impl, dtype):
    """The named backend runs, or the call raises saying why: never another backend.
    A Pallas backend really runs a ``pallas_call`` (the xla path none)."""
    batch = case_batch(np.random.default_rng(11), MIXED, head_dim=64, dtype=dtype)
    fn = functools.partial(pk.masked_tail_attention, implementation=impl)
    args = (batch.q, batch.k_cache, batch.v_cache)
    if impl == "mosaic":  # T = 15: not a multiple of 8 (and fp32 is not a wgmma dtype)
        with pytest.raises(ValueError, match="'mosaic' cannot serve this call"):
            pk.backend_for(fn, *args, **batch.kwargs())
        return
    assert pk.backend_for(fn, *args, **batch.kwargs()) == impl
    jaxpr = str(jax.make_jaxpr(fn)(*args, **batch.kwargs()))
    assert ("pallas_call" in jaxpr) == (impl != "xla")


@pytest.mark.skipif(on_gpu(), reason="the CPU's dispatch rules")
def test_attention_backend_on_cpu():
    """auto runs xla on a CPU; "mosaic" named there raises (no Hopper) instead of running
    Triton; ("mosaic", "triton") takes Triton."""
    batch = case_batch(np.random.default_rng(12), MIXED, head_dim=64, dtype=jnp.bfloat16)
    args = (batch.q, batch.k_cache, batch.v_cache)
    op = pk.masked_tail_attention
    assert pk.backend_for(op, *args, **batch.kwargs()) == "xla"
    with pytest.raises(ValueError, match="Hopper"):
        pk.backend_for(op, *args, **batch.kwargs(), implementation="mosaic")
    with pytest.raises(ValueError, match="Hopper"):
        op(*args, **batch.kwargs(), implementation="mosaic")
    either = ("mosaic", "triton")
    assert pk.backend_for(op, *args, **batch.kwargs(), implementation=either) == "triton"
    config = attention_config.BlockSizes(block_q=16, block_k=16, split_k=32, decode_block_k=16)
    assert (
        pk.backend_for(op, *args, **batch.kwargs(), implementation=either, config=config)
        == "triton"
    )


@pytest.mark.parametrize("impl", ATTENTION)
def test_attention_out_of_range_slot_ids_are_padding(impl):
    """Slot ids >= S and < -1 behave exactly like -1 (DESIGN.md §8): the sequence's rows
    are 0, nothing is read from any slot for it (every slot not named is NaN, including
    those a wrapped or clamped id would hit), other rows are bit-identical to the run with
    -1. ``validate=True`` rejects them."""
    batch = case_batch(np.random.default_rng(13), MIXED, extra_slots=4)
    skip_unless_served(batch, impl)
    num_slots, row = batch.k_cache.shape[0], 2  # 8 slots; the 4-token chunked prefill
    named = np.delete(batch.slot_ids, row)
    batch.k_cache = poison_slots(batch.k_cache, named)
    batch.v_cache = poison_slots(batch.v_cache, named)
    fn = jax.jit(
        lambda slot_ids: pk.masked_tail_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            **(batch.kwargs() | dict(slot_ids=slot_ids)),
            implementation=impl,
        )
    )
    (out,), _ = check_out_of_range_slots_are_padding(
        lambda ids: ((fn(jnp.asarray(ids)),), ()), batch.slot_ids, row, num_slots=num_slots
    )
    padded = dataclasses.replace(
        batch, slot_ids=np.where(np.arange(len(batch.slot_ids)) == row, -1, batch.slot_ids)
    )
    check_attention(padded, out)  # its rows are 0 (dead rows), the others the oracle's
    for bad in out_of_range_slot_ids(num_slots):
        slots = batch.slot_ids.copy()
        slots[row] = bad
        with pytest.raises(ValueError, match="slot_ids must be -1 or in"):
            run_attention(dataclasses.replace(batch, slot_ids=slots), impl, validate=True)


@pytest.mark.parametrize("impl", ATTENTION)
@given(
    q_lens=st.lists(st.sampled_from([0, 1, 2, 5, 8]), min_size=4, max_size=4),
    cached=st.lists(st.sampled_from([0, 1, 7, 16, 31]), min_size=4, max_size=4),
    padding=st.lists(st.sampled_from([False, False, True]), min_size=4, max_size=4),
    causal=st.booleans(),
    window=st.sampled_from([None, 1, 4, 64]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_attention_property_random_batches(
    impl, q_lens, cached, padding, causal, window, dtype, seed
):
    # Fixed T (bucket), B and L: shapes depend on the dtype only.
    kv_lens = [min(q + c, CACHE_LEN) for q, c in zip(q_lens, cached, strict=True)]
    batch = make_batch(
        np.random.default_rng(seed),
        q_lens,
        kv_lens,
        padding=padding,
        pad_rows=32 - sum(q_lens),
        dtype=dtype,
    )
    out = run_attention(batch, impl, causal=causal, sliding_window=window)
    check_attention(batch, out, causal=causal, sliding_window=window)


@pytest.mark.parametrize("impl", ATTENTION)
@given(
    perm=st.permutations(range(4)),
    q_lens=st.lists(st.sampled_from([0, 1, 3, 6]), min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_permuting_sequences_permutes_outputs(impl, perm, q_lens, seed):
    rng = np.random.default_rng(seed)
    kv_lens = [q + int(rng.integers(0, 8)) for q in q_lens]
    batch = make_batch(rng, q_lens, kv_lens, pad_rows=24 - sum(q_lens))
    out = as_f32(run_attention(batch, impl))
    starts = batch.query_start_loc
    rows = [np.arange(starts[b], starts[b + 1]) for b in perm]
    order = np.concatenate([*rows, np.arange(starts[-1], 24)]).astype(int)
    permuted = dataclasses.replace(
        batch,
        q=batch.q[order],
        query_start_loc=query_start_loc([q_lens[b] for b in perm]),
        kv_lens=batch.kv_lens[list(perm)],
        slot_ids=batch.slot_ids[list(perm)],
    )
    out_permuted = as_f32(run_attention(permuted, impl))
    assert_close(out_permuted, out[order], rtol=1e-6, name="permuted out")


# --------------------------------------------------------------------------- write_kv


WRITE_CASES = (
    *CASES,
    # Positions outside [0, L) are dropped: kv_lens > L (the last tokens) and
    # kv_lens < q_len (the first tokens at negative positions; must not wrap around).
    VarlenCase("out_of_range", (4, 3, 2), (CACHE_LEN + 2, 1, 0)),
)


def make_new_kv(rng, batch: AttentionBatch, dtype):
    shape = (batch.q.shape[0], *batch.k_cache.shape[2:])
    return normal(rng, shape, dtype), normal(rng, shape, dtype)


def check_write(batch: AttentionBatch, k, v, k_cache, v_cache) -> None:
    """New caches equal the oracle's bit for bit (values are copied), NaN included: lines
    not written, unnamed slots and slot -1 sequences come back unchanged."""
    k_ref, v_ref = write_kv_oracle(
        as_f32(batch.k_cache), as_f32(batch.v_cache), as_f32(k), as_f32(v), **batch.kwargs()
    )
    for name, new, old, ref in (
        ("k_cache", k_cache, batch.k_cache, k_ref),
        ("v_cache", v_cache, batch.v_cache, v_ref),
    ):
        assert new.dtype == old.dtype and new.shape == old.shape
        expected = np.asarray(jnp.asarray(ref, jnp.float32).astype(old.dtype))
        assert_bit_identical(np.asarray(new), expected, name)
    named = batch.slot_ids[batch.slot_ids >= 0]
    assert_slots_untouched(k_cache, batch.k_cache, named, name="k_cache")
    assert_slots_untouched(v_cache, batch.v_cache, named, name="v_cache")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", WRITE_CASES, ids=[c.name for c in WRITE_CASES])
@pytest.mark.parametrize("impl", WRITE_KV)
def test_write_kv_matches_oracle(impl, case, dtype):
    rng = np.random.default_rng(20)
    batch = case_batch(rng, case, dtype=dtype)
    k, v = make_new_kv(rng, batch, dtype)
    k_cache, v_cache = pk.write_kv(
        batch.k_cache, batch.v_cache, k, v, **batch.kwargs(), implementation=impl
    )
    check_write(batch, k, v, k_cache, v_cache)


@pytest.mark.parametrize("impl", WRITE_KV)
def test_write_kv_padding_writes_nothing(impl):
    """Only padding sequences and bucket rows: the caches come back bit-identical."""
    rng = np.random.default_rng(21)
    batch = make_batch(rng, (2, 3), (5, 3), padding=(True, True), pad_rows=4)
    k, v = make_new_kv(rng, batch, jnp.float32)
    k_cache, v_cache = pk.write_kv(
        batch.k_cache, batch.v_cache, k, v, **batch.kwargs(), implementation=impl
    )
    assert_bit_identical(k_cache, batch.k_cache, "k_cache")
    assert_bit_identical(v_cache, batch.v_cache, "v_cache")


@pytest.mark.parametrize("impl", WRITE_KV)
def test_write_kv_under_jit(impl):
    rng = np.random.default_rng(22)
    batch = case_batch(rng, CASES[4])
    k, v = make_new_kv(rng, batch, jnp.float32)
    fn = jax.jit(functools.partial(pk.write_kv, implementation=impl))
    k_cache, v_cache = fn(batch.k_cache, batch.v_cache, k, v, **batch.kwargs())
    check_write(batch, k, v, k_cache, v_cache)


@pytest.mark.parametrize("impl", WRITE_KV)
def test_write_kv_runs_the_named_implementation(impl):
    rng = np.random.default_rng(23)
    batch = case_batch(rng, MIXED)
    k, v = make_new_kv(rng, batch, jnp.float32)
    fn = functools.partial(pk.write_kv, implementation=impl)
    args = (batch.k_cache, batch.v_cache, k, v)
    assert pk.backend_for(fn, *args, **batch.kwargs()) == impl
    with pytest.raises(ValueError, match="config of type"):  # write_kv takes no block sizes
        pk.backend_for(fn, *args, **batch.kwargs(), config=SMALL_BLOCKS)
    jaxpr = str(jax.make_jaxpr(fn)(*args, **batch.kwargs()))
    assert ("pallas_call" in jaxpr) == (impl != "xla")


@pytest.mark.parametrize("impl", WRITE_KV)
def test_write_kv_out_of_range_slot_ids_are_padding(impl):
    """Slot ids >= S and < -1 behave exactly like -1 (DESIGN.md §8): the sequence writes
    nothing anywhere (a wrapped -2 or a clamped S + 3 would hit slots 6 or 7), the caches
    are bit-identical to the run with -1. ``validate=True`` rejects them."""
    rng = np.random.default_rng(25)
    batch = case_batch(rng, MIXED, extra_slots=4)
    k, v = make_new_kv(rng, batch, jnp.float32)
    num_slots, row = batch.k_cache.shape[0], 0  # the 9-token prefill
    fn = jax.jit(
        lambda slot_ids: pk.write_kv(
            batch.k_cache,
            batch.v_cache,
            k,
            v,
            **(batch.kwargs() | dict(slot_ids=slot_ids)),
            implementation=impl,
        )
    )
    _, (k_cache, v_cache) = check_out_of_range_slots_are_padding(
        lambda ids: ((), fn(jnp.asarray(ids))), batch.slot_ids, row, num_slots=num_slots
    )
    padded = dataclasses.replace(
        batch, slot_ids=np.where(np.arange(len(batch.slot_ids)) == row, -1, batch.slot_ids)
    )
    check_write(padded, k, v, k_cache, v_cache)  # the row's slot is untouched too
    for bad in out_of_range_slot_ids(num_slots):
        slots = batch.slot_ids.copy()
        slots[row] = bad
        with pytest.raises(ValueError, match="slot_ids must be -1 or in"):
            pk.write_kv(
                batch.k_cache,
                batch.v_cache,
                k,
                v,
                **(batch.kwargs() | dict(slot_ids=slots)),
                implementation=impl,
                validate=True,
            )


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("attention_impl", ATTENTION)
@pytest.mark.parametrize("write_impl", WRITE_KV)
def test_write_kv_then_attention_matches_oracle(write_impl, attention_impl, case, dtype):
    """One serving step: the cache holds kv_lens - q_len earlier keys (NaN after them),
    this step's keys are written, then the queries attend. Equals the oracle on the
    oracle-updated cache, and the tails past kv_lens are still NaN (never written)."""
    rng = np.random.default_rng(24)
    history = [kv - q for q, kv in zip(case.q_lens, case.kv_lens, strict=True)]
    batch = case_batch(rng, case, dtype=dtype)
    for name in ("k_cache", "v_cache"):
        poisoned = poison_tail(as_f32(getattr(batch, name)), batch.slot_ids, history)
        setattr(batch, name, jnp.asarray(poisoned).astype(dtype))
    k, v = make_new_kv(rng, batch, dtype)
    k_cache, v_cache = pk.write_kv(
        batch.k_cache, batch.v_cache, k, v, **batch.kwargs(), implementation=write_impl
    )
    check_write(batch, k, v, k_cache, v_cache)
    for slot, kv_len in zip(batch.slot_ids, batch.kv_lens, strict=True):
        if slot >= 0:
            assert np.all(np.isnan(as_f32(k_cache[slot, kv_len:])))
            assert not np.any(np.isnan(as_f32(k_cache[slot, :kv_len])))
    updated = dataclasses.replace(batch, k_cache=k_cache, v_cache=v_cache)
    out = run_attention(updated, attention_impl)
    check_attention(updated, out)


# --------------------------------------------------------------------------- kv_lens_from_mask


# Rows: all visible, all masked, right padding, left padding, holes, only the first key,
# only the last key, alternating.
MASK_PATTERN = np.array(
    [
        [1, 1, 1, 1, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 1, 1, 1, 1, 1],
        [1, 0, 0, 1, 1, 0, 1, 0, 0],
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 1],
        [0, 1, 0, 1, 0, 1, 0, 1, 0],
    ],
    dtype=bool,
)
PATTERN_LENS = np.array([9, 0, 5, 9, 7, 1, 9, 8])


def additive(masked_value, dtype, visible_values=(0.0,)) -> jax.Array:
    """The pattern as an additive mask: ``visible_values`` (cycled) where visible."""
    visible = np.resize(np.asarray(visible_values, np.float32), MASK_PATTERN.shape)
    values = np.where(MASK_PATTERN, visible, np.float32(masked_value))
    return jnp.asarray(values).astype(dtype)


MASKS = {
    "bool": lambda: jnp.asarray(MASK_PATTERN),
    "int32_01": lambda: jnp.asarray(MASK_PATTERN.astype(np.int32)),
    "int8_01": lambda: jnp.asarray(MASK_PATTERN.astype(np.int8)),
    "f32_neg_inf": lambda: additive(-np.inf, jnp.float32),
    "f16_neg_inf": lambda: additive(-np.inf, jnp.float16),
    "bf16_neg_inf": lambda: additive(-np.inf, jnp.bfloat16),
    "f32_finfo_min": lambda: additive(np.finfo(np.float32).min, jnp.float32),
    "f16_finfo_min": lambda: additive(np.finfo(np.float16).min, jnp.float16),
    "bf16_finfo_min": lambda: additive(jnp.finfo(jnp.bfloat16).min, jnp.bfloat16),
    "f32_minus_1e9": lambda: additive(-1e9, jnp.float32),
    "f32_minus_1e4": lambda: additive(-1e4, jnp.float32),
    "f16_minus_1e4": lambda: additive(-1e4, jnp.float16),
    # Visible keys with a (non-zero) bias, e.g. ALiBi: still visible.
    "f32_biased_visible": lambda: additive(-np.inf, jnp.float32, (0.0, -3.5, -100.0, 2.0)),
    "f16_biased_visible": lambda: additive(np.finfo(np.float16).min, jnp.float16, (-0.5, -9000.0)),
}


@pytest.mark.parametrize("kind", list(MASKS))
def test_kv_lens_from_mask_matches_oracle(kind):
    mask = MASKS[kind]()
    lens = pk.kv_lens_from_mask(mask)
    assert lens.dtype == jnp.int32 and lens.shape == (MASK_PATTERN.shape[0],)
    np.testing.assert_array_equal(np.asarray(lens), kv_lens_from_mask_oracle(np.asarray(mask)))
    np.testing.assert_array_equal(np.asarray(lens), PATTERN_LENS)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_kv_lens_from_mask_minus_1e4_masks_in_every_float_dtype(dtype):
    """The documented -1e4 convention masks, also in bfloat16 where -1e4 rounds to -9984."""
    lens = pk.kv_lens_from_mask(additive(-1e4, dtype))
    np.testing.assert_array_equal(np.asarray(lens), PATTERN_LENS)


def test_kv_lens_from_mask_nan_counts_as_masked_and_jit_works():
    mask = additive(np.nan, jnp.float32)
    lens = jax.jit(pk.kv_lens_from_mask)(mask)
    np.testing.assert_array_equal(np.asarray(lens), kv_lens_from_mask_oracle(np.asarray(mask)))
    np.testing.assert_array_equal(np.asarray(lens), PATTERN_LENS)


def test_kv_lens_from_mask_rejects_non_2d_masks():
    for shape in [(9,), (2, 1, 9)]:
        with pytest.raises(ValueError, match="mask"):
            pk.kv_lens_from_mask(jnp.ones(shape, bool))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("impl", ATTENTION)
def test_attention_argument_errors(impl):
    batch = case_batch(np.random.default_rng(30), MIXED)  # Hq=4, Hkv=2, D=16
    call = functools.partial(run_attention, impl=impl)
    bad = {
        "num_kv_heads": dict(q=batch.q[:, :3]),
        "q must have shape": dict(q=batch.q[..., :8]),
        "v_cache": dict(v_cache=batch.v_cache[:, :16]),
        "k_cache": dict(k_cache=batch.k_cache[0], v_cache=batch.v_cache[0]),
        "kv_lens": dict(kv_lens=batch.kv_lens[:2]),
        "slot_ids": dict(slot_ids=batch.slot_ids[:, None]),
        "query_start_loc": dict(query_start_loc=batch.query_start_loc.astype(np.float32)),
    }
    for message, change in bad.items():
        with pytest.raises(ValueError, match=message):
            call(dataclasses.replace(batch, **change))
    for window in (0, -3):
        with pytest.raises(ValueError, match="sliding_window"):
            call(batch, sliding_window=window)


@pytest.mark.parametrize("impl", ATTENTION)
def test_attention_validate_rejects_bad_data(impl):
    batch = case_batch(np.random.default_rng(31), MIXED)  # q_lens (9, 1, 4, 1)
    call = functools.partial(run_attention, impl=impl, validate=True)
    call(batch)  # valid data passes
    bad = {
        "kv_lens": [
            dict(kv_lens=np.array([8, 17, 25, 32], np.int32)),  # kv_lens < q_len
            dict(kv_lens=np.array([9, 17, 25, CACHE_LEN + 1], np.int32)),  # > L
        ],
        "query_start_loc": [
            dict(query_start_loc=np.array([0, 9, 8, 14, 15], np.int32)),
            dict(query_start_loc=np.array([0, 9, 10, 14, 16], np.int32)),  # past T
        ],
        "slot_ids": [
            dict(slot_ids=np.array([0, 1, 2, 6], np.int32)),
            dict(slot_ids=np.array([0, 1, -2, 3], np.int32)),
            dict(slot_ids=np.array([0, 9, 2, 3], np.int32)),
            dict(slot_ids=np.array([-7, 1, 2, 3], np.int32)),
            dict(slot_ids=np.array([0, 1, 1, 3], np.int32)),
        ],
    }
    for message, changes in bad.items():
        for change in changes:
            with pytest.raises(ValueError, match=message):
                call(dataclasses.replace(batch, **change))


@pytest.mark.parametrize("impl", WRITE_KV)
def test_write_kv_argument_errors(impl):
    rng = np.random.default_rng(32)
    batch = case_batch(rng, MIXED)
    k, v = make_new_kv(rng, batch, jnp.float32)
    call = functools.partial(pk.write_kv, implementation=impl)
    kw = batch.kwargs()
    with pytest.raises(ValueError, match="k must have shape"):
        call(batch.k_cache, batch.v_cache, k[..., :8], v, **kw)
    with pytest.raises(ValueError, match="v must have shape"):
        call(batch.k_cache, batch.v_cache, k, v[:-1], **kw)
    with pytest.raises(ValueError, match="v_cache"):
        call(batch.k_cache, batch.v_cache[:, :, :1], k, v, **kw)
    with pytest.raises(ValueError, match="kv_lens"):
        call(batch.k_cache, batch.v_cache, k, v, **{**kw, "kv_lens": batch.kv_lens[:3]})
    with pytest.raises(ValueError, match="kv_lens"):
        bad_lens = np.array([9, 17, 25, CACHE_LEN + 1], np.int32)
        call(batch.k_cache, batch.v_cache, k, v, **{**kw, "kv_lens": bad_lens}, validate=True)
    with pytest.raises(ValueError, match="slot_ids"):
        bad_slots = np.array([0, 1, 2, 9], np.int32)
        call(batch.k_cache, batch.v_cache, k, v, **{**kw, "slot_ids": bad_slots}, validate=True)


# --------------------------------------------------------------------------- Triton kernels

# Small blocks on a longer cache, so each program loops over several KV blocks: window-edge,
# unmasked interior and masked diagonal / kv_len blocks all occur. Group 3 (padded to 4)
# and D = 24 (padded to 32) exercise the padding masks.
SMALL_BLOCKS = attention_config.BlockSizes(block_q=4, block_k=16, split_k=32, decode_block_k=16)
BLOCKS_CASE = VarlenCase(
    "blocks",
    # prefill, chunked prefill, decode, kv_len < q_len, padding, empty, kv_len > L
    (40, 20, 1, 6, 3, 0, 3),
    (40, 100, 128, 3, 9, 50, 128 + 4),
    padding=(False, False, False, False, True, False, False),
    pad_rows=5,
)
BLOCKS_SHAPES = dict(num_q_heads=6, num_kv_heads=2, head_dim=24, cache_len=128)


@jax.jit
def run_decode_path(q, k_cache, v_cache, qsl, kv_lens, slot_ids, causal, window):
    """The Triton decode path with SMALL_BLOCKS on any layout; the mask is traced (one
    compile). Called directly: through the api, only decode-shaped batches (T <= B) take
    this path."""
    return attention_decode.decode_attention(
        q,
        k_cache,
        v_cache,
        query_start_loc=qsl,
        kv_lens=kv_lens,
        slot_ids=slot_ids,
        causal=causal,
        sm_scale=0.3,
        sliding_window=window,
        block_sizes=SMALL_BLOCKS,
        interpret=not on_gpu(),
    )


def run_path(batch: AttentionBatch, path: str, *, causal: bool, window: int | None):
    """One Triton path with SMALL_BLOCKS: the prefill path through the public api (this
    batch is prefill-shaped), the decode path directly."""
    if path == "prefill":
        return run_attention(
            batch,
            "triton",
            causal=causal,
            sm_scale=0.3,
            sliding_window=window,
            config=SMALL_BLOCKS,
        )
    w = attention_layout.NO_WINDOW if window is None else window
    return run_decode_path(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        batch.query_start_loc,
        batch.kv_lens,
        batch.slot_ids,
        np.bool_(causal),
        np.int32(w),
    )


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_triton_paths_over_many_kv_blocks(path, causal):
    """Both Triton paths on any layout (the decode path too: the static T <= B rule can't
    prove q_len == 1), several KV blocks per program, NaN past every kv_len and in unnamed
    slots (a load outside [0, kv_len) shows up as NaN), windows cutting blocks anywhere."""
    batch = case_batch(np.random.default_rng(50), BLOCKS_CASE, **BLOCKS_SHAPES)
    for window in (None, 1, 5, 37):
        out = run_path(batch, path, causal=causal, window=window)
        check_attention(batch, out, causal=causal, sm_scale=0.3, sliding_window=window)


@pytest.mark.parametrize("path", ["prefill", "decode"])
def test_triton_causal_queries_ignore_keys_above_the_diagonal(path):
    """Keys and values above a row's diagonal (still inside kv_len, so loaded in the
    diagonal block) are replaced by huge values: rows before them are bitwise unchanged,
    rows that may see them change."""
    batch = case_batch(np.random.default_rng(51), BLOCKS_CASE, **BLOCKS_SHAPES)
    b, cut = 0, 13  # the 40-token prefill: rows at positions < 13 must not see keys >= 13
    slot = int(batch.slot_ids[b])
    perturbed = dataclasses.replace(
        batch,
        k_cache=batch.k_cache.at[slot, cut : batch.kv_lens[b]].set(1e3),
        v_cache=batch.v_cache.at[slot, cut : batch.kv_lens[b]].set(-1e3),
    )
    base = np.asarray(run_path(batch, path, causal=True, window=None))
    out = np.asarray(run_path(perturbed, path, causal=True, window=None))
    start = batch.query_start_loc[b]
    before = np.ones(batch.q.shape[0], bool)
    before[start + cut : batch.query_start_loc[b + 1]] = False
    assert_bit_identical(out[before], base[before], "rows before the perturbed keys")
    assert not np.any(out[~before] == base[~before]), "perturbed keys had no effect"


def test_internal_prefill_table_worked_example():
    prog_seq, prog_row = attention_layout.prefill_table(
        jnp.array([0, 5, 6, 6, 14], jnp.int32), num_tokens=16, block_q=4, max_q_blocks=8
    )
    np.testing.assert_array_equal(prog_seq, [3, 3, 1, 0, 0, -1, -1, -1])
    np.testing.assert_array_equal(prog_row, [10, 6, 5, 4, 0, 0, 0, 0])


def test_internal_prefill_schedule_worked_example():
    """The docstring's example: longest programs first (stable), unused entries last and
    given the rows past the last sequence end."""
    qsl = jnp.array([0, 5, 6, 6, 14], jnp.int32)
    kv_lens = jnp.array([5, 1, 0, 8], jnp.int32)
    prog_seq, prog_row = attention_layout.prefill_table(
        qsl, num_tokens=16, block_q=4, max_q_blocks=8
    )
    prog_seq, prog_row = attention_layout.prefill_schedule(
        prog_seq,
        prog_row,
        seq_end=qsl[1:],
        seq_offset=kv_lens - jnp.diff(qsl) - qsl[:-1],
        seq_kv_len=kv_lens,
        seq_slot=jnp.arange(4, dtype=jnp.int32),
        band=attention_layout.band_operand(True, None),
        block_q=4,
        block_k=4,
    )
    np.testing.assert_array_equal(prog_seq, [3, 0, 3, 1, 0, -1, -1, -1])
    np.testing.assert_array_equal(prog_row, [10, 4, 6, 5, 0, 14, 18, 22])


def test_block_sizes_are_validated():
    for bad in (
        dict(block_q=3),
        dict(block_k=8),
        dict(block_k=48),
        dict(decode_block_k=64, split_k=32),
        dict(num_warps=0),
        dict(decode_num_stages=0),
    ):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            attention_config.BlockSizes(**bad)
    batch = case_batch(np.random.default_rng(52), MIXED, num_q_heads=2, num_kv_heads=2)
    with pytest.raises(ValueError, match="block_q"):  # 4 rows < 16: too small for a dot
        run_attention(batch, "triton", config=attention_config.BlockSizes(block_q=4))


def _lower_attention(path, *, num_tokens, num_seqs, num_q_heads, num_kv_heads, head_dim, dtype):
    slots, cache_len = 8, 4096

    def fn(q, k_cache, v_cache, qsl, kv_lens, slot_ids):
        kernel = (
            attention_triton.prefill_attention
            if path == "prefill"
            else attention_decode.decode_attention
        )
        blocks = attention_config.default_block_sizes(
            num_tokens=num_tokens,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            cache_len=cache_len,
            dtype=dtype,
        )
        return kernel(
            q,
            k_cache,
            v_cache,
            query_start_loc=qsl,
            kv_lens=kv_lens,
            slot_ids=slot_ids,
            causal=True,
            sm_scale=head_dim**-0.5,
            sliding_window=None,
            block_sizes=blocks,
        )

    cache = spec((slots, cache_len, num_kv_heads, head_dim), dtype)
    return lower_for_cuda(
        fn,
        spec((num_tokens, num_q_heads, head_dim), dtype),
        cache,
        cache,
        spec((num_seqs + 1,), jnp.int32),
        spec((num_seqs,), jnp.int32),
        spec((num_seqs,), jnp.int32),
    )


@pytest.mark.parametrize(
    ("head_dim", "dtype", "num_q_heads", "num_kv_heads"),
    [
        (64, jnp.bfloat16, 32, 8),
        (128, jnp.bfloat16, 32, 8),
        (256, jnp.bfloat16, 8, 8),
        (80, jnp.float32, 24, 8),
    ],
)
def test_prefill_attention_lowers(head_dim, dtype, num_q_heads, num_kv_heads):
    text = _lower_attention(
        "prefill",
        num_tokens=1024,
        num_seqs=4,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
    )
    assert "attention_prefill" in text


@pytest.mark.parametrize(("head_dim", "dtype"), [(128, jnp.bfloat16), (80, jnp.float32)])
def test_decode_attention_lowers(head_dim, dtype):
    text = _lower_attention(
        "decode",
        num_tokens=64,
        num_seqs=64,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=head_dim,
        dtype=dtype,
    )
    assert "attention_decode_split" in text and "attention_decode_combine" in text


def test_internal_write_kv_lowers():
    slots, cache_len, tokens, num_seqs = 8, 4096, 512, 4
    cache = spec((slots, cache_len, 8, 128))
    text = lower_for_cuda(
        lambda kc, vc, k, v, qsl, kv_lens, slot_ids: attention_triton.write_kv(
            kc, vc, k, v, query_start_loc=qsl, kv_lens=kv_lens, slot_ids=slot_ids
        ),
        cache,
        cache,
        spec((tokens, 8, 128)),
        spec((tokens, 8, 128)),
        spec((num_seqs + 1,), jnp.int32),
        spec((num_seqs,), jnp.int32),
        spec((num_seqs,), jnp.int32),
    )
    assert "write_kv" in text


# --------------------------------------------------------------------------- GPU, real sizes


def oracle_on_rows(batch: AttentionBatch, rows: np.ndarray, **options) -> np.ndarray:
    """The causal oracle for a subsample of rows: each row becomes a one-token sequence at
    its own position (same visible keys under the causal mask), so the float64 loops
    only run for those rows."""
    seq = np.searchsorted(batch.query_start_loc[1:], rows, side="right")
    q_len = np.diff(batch.query_start_loc)[seq]
    position = batch.kv_lens[seq] - q_len + rows - batch.query_start_loc[seq]
    return attention_oracle(
        as_f32(batch.q[rows]),
        batch.k_cache,
        batch.v_cache,
        query_start_loc=np.arange(len(rows) + 1),
        kv_lens=position + 1,
        slot_ids=batch.slot_ids[seq],
        causal=True,
        **options,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("sliding_window", [None, 1024])
@pytest.mark.parametrize("impl", ATTENTION)
def test_attention_real_size(impl, sliding_window):
    rng = np.random.default_rng(40)
    q_lens = (2048, 1, 1, 512, 0, 1, 1500, 33)
    kv_lens = (2048, 4000, 4096, 3000, 0, 1, 1500, 4096)
    batch = make_batch(
        rng,
        q_lens,
        kv_lens,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        cache_len=4096,
        dtype=jnp.bfloat16,
        padding=(False, False, False, False, True, False, False, False),
        pad_rows=4096 + 512 - sum(q_lens),
        extra_slots=8,
    )
    out = as_f32(run_attention(batch, impl, sliding_window=sliding_window))
    assert np.all(np.isfinite(out))
    assert np.all(out[batch.dead_rows()] == 0)
    live = np.flatnonzero(~batch.dead_rows())
    rows = np.unique(np.concatenate([live[:4], live[-4:], rng.choice(live, 24, replace=False)]))
    ref = oracle_on_rows(batch, rows, sliding_window=sliding_window)
    assert_close_per_row(
        out[rows], ref, rtol=tolerance_for(jnp.bfloat16), name="out (sampled rows)"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("impl", WRITE_KV)
def test_write_kv_real_size(impl):
    rng = np.random.default_rng(41)
    q_lens = (1024, 1, 1, 300, 7)
    batch = make_batch(
        rng,
        q_lens,
        (1024, 4000, 4096, 3000, 4103),
        num_q_heads=8,
        num_kv_heads=8,
        head_dim=128,
        cache_len=4096,
        dtype=jnp.bfloat16,
        padding=(False, False, True, False, False),
        pad_rows=2048 - sum(q_lens),
        extra_slots=3,
    )
    k, v = make_new_kv(rng, batch, jnp.bfloat16)
    k_cache, v_cache = pk.write_kv(
        batch.k_cache, batch.v_cache, k, v, **batch.kwargs(), implementation=impl
    )
    check_write(batch, k, v, k_cache, v_cache)


# --------------------------------------------------------------------------- Mosaic GPU kernel

# Sequences that end mid-tile (so items hold dead rows), chunked prefill whose KV range
# starts mid-block, decode rows inside a prefill batch, kv_len < q_len, a padding sequence,
# an empty one and bucket rows: every plan column takes several values.
MOSAIC_CASE = VarlenCase(
    "mosaic",
    (200, 1, 64, 130, 3, 0, 70, 2),
    (200, 300, 64, 401, 3, 0, 500, 1),
    padding=(False, False, False, False, True, False, False, False),
    pad_rows=42,  # T = 512: TMA takes the token axis in tiles of 8 rows
)


def _plan_case(case: VarlenCase, *, window, causal, block_q=8, block_k=16, cache_len=512):
    """The plan of ``case`` with small blocks, and the band it was built for."""
    q_lens = np.asarray(case.q_lens)
    num_tokens = int(q_lens.sum()) + case.pad_rows
    slots = np.arange(len(q_lens), dtype=np.int32)
    if case.padding is not None:
        slots[np.asarray(case.padding)] = -1
    qsl = query_start_loc(case.q_lens)
    band = attention_layout.band_operand(causal, window)
    item_plan = attention_mosaic_common.plan(
        jnp.asarray(qsl),
        jnp.asarray(case.kv_lens, jnp.int32),
        jnp.asarray(slots),
        band,
        num_tokens=num_tokens,
        num_slots=len(q_lens),
        cache_len=cache_len,
        block_q=block_q,
        block_k=block_k,
    )
    return jax.tree.map(np.asarray, item_plan), qsl, slots, np.asarray(band), num_tokens


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_internal_mosaic_plan_visits_exactly_the_visible_blocks(causal, window):
    block_q, block_k = 8, 16
    p, qsl, slots, (left, right), num_tokens = _plan_case(
        MOSAIC_CASE, window=window, causal=causal, block_q=block_q, block_k=block_k
    )
    consumers = range(attention_mosaic_common.CONSUMERS)
    written = np.zeros(num_tokens, int)
    for i in range(p.num_items):
        row0, kv_len, pos0 = p.row0[i], p.kv_len[i], p.pos0[i]
        attend = p.slot[i] >= 0
        assert attend or kv_len == 0
        kv_lo, kv_hi = p.kv_lo[i], p.kv_hi[i]
        assert kv_lo <= kv_hi
        assert row0 % 8 == 0  # TMA reads query tiles at tile-aligned rows
        for c in consumers:
            live, first = p.live[i, c], p.first[i, c]
            assert first + live <= block_q
            stored = row0 + c * block_q + first
            written[stored : stored + live] += 1
            lo_blk, mid_lo = p.lo_blk[i, c], p.mid_lo[i, c]
            mid_hi, hi_blk = p.mid_hi[i, c], p.hi_blk[i, c]
            assert kv_lo <= lo_blk <= mid_lo <= mid_hi <= hi_blk <= kv_hi
            pos = pos0 + c * block_q + first + np.arange(live)
            keys = np.arange((kv_hi + 1) * block_k)
            visible = (keys[None] < kv_len) & (keys[None] <= pos[:, None] + right)
            visible &= keys[None] > pos[:, None] - left
            visible &= bool(attend)
            blocks = np.arange(kv_hi + 1)
            seen = visible.reshape(live, len(blocks), block_k)  # [rows, blocks, keys]
            any_visible = seen.any(axis=(0, 2))
            all_visible = seen.all(axis=(0, 2)) if live else np.zeros_like(any_visible)
            computed = (blocks >= lo_blk) & (blocks < hi_blk)
            unmasked = (blocks >= mid_lo) & (blocks < mid_hi)
            # Every block some live row sees is computed; computed blocks lie in the
            # contiguous range that ends at the last such block; unmasked blocks are fully
            # visible to every live row.
            assert np.all(computed[any_visible])
            if any_visible.any():
                assert lo_blk == blocks[any_visible].min()
                assert hi_blk == blocks[any_visible].max() + 1
            else:
                assert lo_blk == hi_blk
            assert np.all(all_visible[unmasked])
        # The producer loads exactly the union of the consumers' blocks.
        working = [(p.lo_blk[i, c], p.hi_blk[i, c]) for c in consumers]
        working = [(lo, hi) for lo, hi in working if lo < hi]
        if working:
            assert kv_lo == min(b[0] for b in working) and kv_hi == max(b[1] for b in working)
        else:
            assert kv_lo == kv_hi
    # Each bucket row is stored by exactly one consumer (live rows and zeroed rows alike).
    assert np.all(written == 1)


@pytest.mark.parametrize("num_q_heads, group", [(32, 1), (32, 4), (28, 4), (6, 3), (8, 8)])
@pytest.mark.parametrize("num_items", [1, 50, 138, 10_000])
def test_internal_mosaic_head_group_divides_heads_and_fills_the_gpu(num_q_heads, group, num_items):
    num_sms = 132
    heads = attention_mosaic_config.default_head_group(
        num_q_heads=num_q_heads, group=group, num_items=num_items, num_sms=num_sms
    )
    assert num_q_heads % heads == 0
    assert heads % group == 0  # query heads sharing a KV head launch together
    waves = attention_mosaic_config._WAVES_PER_HEAD_GROUP
    if heads < num_q_heads:  # a group fills the GPU...
        assert heads * num_items >= waves * num_sms
    # ...with no more heads than it needs.
    for fewer in range(group, heads, group):
        assert num_q_heads % fewer or fewer * num_items < waves * num_sms


def test_internal_mosaic_head_group_must_divide_heads():
    T, L, Hq, D = 64, 64, 6, 64
    q = jnp.zeros((T, Hq, D), jnp.bfloat16)
    cache = jnp.zeros((1, L, 2, D), jnp.bfloat16)
    with pytest.raises(ValueError, match="head_group=4 must divide num_q_heads=6"):
        attention_mosaic.prefill_attention(
            q,
            cache,
            cache,
            query_start_loc=jnp.asarray([0, T], jnp.int32),
            kv_lens=jnp.asarray([T], jnp.int32),
            slot_ids=jnp.asarray([0], jnp.int32),
            causal=True,
            sm_scale=D**-0.5,
            sliding_window=None,
            block_sizes=attention_mosaic_config.BlockSizes(head_group=4),
        )


def _mosaic_batch(rng, dtype, head_dim, num_q_heads, num_kv_heads, case=MOSAIC_CASE):
    return case_batch(
        rng,
        case,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        cache_len=512,
        dtype=dtype,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not supports_mosaic(), reason="needs a Hopper GPU")
# One head per launch group (the head-to-block mapping at its finest) and the default.
@pytest.mark.parametrize("block_k, head_group", [(64, 1), (128, None)])
@pytest.mark.parametrize("window", [None, 70])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(
    "dtype, head_dim, num_q_heads, num_kv_heads",
    [(jnp.bfloat16, 128, 8, 2), (jnp.float16, 64, 3, 3), (jnp.bfloat16, 64, 4, 1)],
)
def test_internal_mosaic_kernel_matches_oracle(
    dtype, head_dim, num_q_heads, num_kv_heads, causal, window, block_k, head_group
):
    rng = np.random.default_rng(50)
    batch = _mosaic_batch(rng, dtype, head_dim, num_q_heads, num_kv_heads)
    blocks = attention_mosaic_config.BlockSizes(block_k=block_k, head_group=head_group)
    out = attention_mosaic.masked_tail_attention(
        batch.q,
        batch.k_cache,
        batch.v_cache,
        **batch.kwargs(),
        causal=causal,
        sm_scale=head_dim**-0.5,
        sliding_window=window,
        config=blocks,
    )
    check_attention(batch, out, causal=causal, sliding_window=window)


@pytest.mark.gpu
@pytest.mark.skipif(not supports_mosaic(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("window", [None, 70])
def test_internal_mosaic_lse_and_gradients_match_triton(window):
    """Under differentiation the Mosaic kernel saves the lse the Triton backward kernels
    read: it is the Triton forward's on every row, and the gradients through the Mosaic
    backend are the Triton backend's."""
    rng = np.random.default_rng(51)
    D = 128
    batch = _mosaic_batch(rng, jnp.bfloat16, D, 8, 2)
    mask = dict(causal=True, sm_scale=D**-0.5, sliding_window=window)
    operands = (batch.q, batch.k_cache, batch.v_cache)
    out, lse = attention_mosaic.prefill_attention(
        *operands,
        **batch.kwargs(),
        **mask,
        block_sizes=attention_mosaic_config.BlockSizes(),
        with_lse=True,
    )
    ref_out, ref_lse = attention_triton.prefill_attention(
        *operands,
        **batch.kwargs(),
        **mask,
        block_sizes=attention_config.BlockSizes(),
        with_lse=True,
    )
    assert_close(as_f32(out), as_f32(ref_out), rtol=tolerance_for(jnp.bfloat16), name="out")
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    # Rows that see no key hold finfo.min + log2(tiny) in both; the others a few units.
    sees = ref_lse > -1e30
    assert sees.sum() > lse.size // 2
    np.testing.assert_array_equal(lse[~sees] < -1e30, True)
    np.testing.assert_allclose(lse[sees], ref_lse[sees], rtol=1e-4, atol=1e-3)

    dout = normal(rng, batch.q.shape, jnp.bfloat16)

    def grads(impl):
        def f(*operands):
            return pk.masked_tail_attention(
                *operands, **batch.kwargs(), **mask, implementation=impl
            )

        return jax.vjp(f, *operands)[1](dout)

    for name, g, ref in zip(("dq", "dk", "dv"), grads("mosaic"), grads("triton"), strict=True):
        assert_close(as_f32(g), as_f32(ref), rtol=tolerance_for(jnp.bfloat16), name=name)


@pytest.mark.parametrize(
    "dtype, head_dim, num_q_heads, num_kv_heads",
    [(jnp.bfloat16, 128, 8, 2), (jnp.float16, 64, 4, 4)],
)
def test_internal_mosaic_kernel_lowers_for_cuda(dtype, head_dim, num_q_heads, num_kv_heads):
    """The Mosaic GPU kernel lowers for Hopper on any machine (CI has no GPU): catches
    unsupported primitives and layouts before a GPU run does."""
    T, S, L, B = 512, 4, 1024, 3

    def forward(q, k, v, qsl, kv_lens, slots):
        return api._mosaic_attention(
            q,
            k,
            v,
            query_start_loc=qsl,
            kv_lens=kv_lens,
            slot_ids=slots,
            causal=True,
            sm_scale=head_dim**-0.5,
            sliding_window=None,
            config=attention_mosaic_config.BlockSizes(),
        )

    def gradients(q, k, v, qsl, kv_lens, slots, dout):
        f = functools.partial(forward, qsl=qsl, kv_lens=kv_lens, slots=slots)
        return jax.vjp(f, q, k, v)[1](dout)

    q = spec((T, num_q_heads, head_dim), dtype)
    cache = spec((S, L, num_kv_heads, head_dim), dtype)
    ints = spec((B,), jnp.int32)
    batch = (spec((B + 1,), jnp.int32), ints, ints)
    assert lower_for_cuda(forward, q, cache, cache, *batch).count("custom_call @mosaic_gpu") == 1
    text = lower_for_cuda(gradients, q, cache, cache, *batch, q)
    # The forward saving lse, dQ and dK/dV are Mosaic kernels.
    assert text.count("custom_call @mosaic_gpu") == 3
