"""Paged KV caches (``block_table``): ``masked_tail_attention`` and ``write_kv`` against the
float64 oracles.

Every page pool is built so that a read it should not make shows up: the sequences' pages
are shuffled through the pool, every pool entry no sequence may read (pages no table names,
rows at or past ``kv_lens`` in a sequence's last page) is NaN, and table entries past a
sequence's last needed page are -1 or name an all-NaN page. The paged oracle itself is
checked against the contiguous oracle on the same keys and values.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.attention import api
from pallas_kernels.attention import mosaic_config as attention_mosaic_config
from pallas_kernels.attention import triton as attention_triton
from pallas_kernels.attention import triton_config as attention_config
from pallas_kernels.backend import supports_mosaic
from pallas_kernels.testing import (
    assert_close,
    attention_oracle,
    tolerance_for,
    vjp_errors,
    write_kv_oracle,
)
from tests.helpers import (
    as_f32,
    assert_bit_identical,
    dead_rows,
    lower_for_cuda,
    normal,
    query_start_loc,
    spec,
)

# The backends that serve paged calls (Pallas kernels in interpret mode off-GPU).
PAGED_IMPLS = ("triton", "xla")
WRITE_KV_IMPLS = ("triton", "xla")
HQ, HKV, HEAD_DIM = 4, 2, 16
# Small Triton tiles: 8-row Q tiles of the 2-head GQA group, 16-key KV blocks (a 32-key
# page holds two of them), 16-key decode splits.
TRITON_CONFIG = attention_config.BlockSizes(block_q=8, block_k=16, split_k=16, decode_block_k=16)


@dataclasses.dataclass(frozen=True)
class PagedCase:
    """Per-sequence query and KV lengths, padding sequences, bucket rows past the last
    sequence and the table's width (``max_blocks``)."""

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    max_blocks: int
    padding: tuple[bool, ...] | None = None
    pad_rows: int = 0


CASES = (
    PagedCase("prefill", (5, 12, 3), (5, 12, 3), max_blocks=2),
    PagedCase("chunked_prefill", (3, 8, 6), (35, 24, 64), max_blocks=4),
    PagedCase("decode", (1, 1, 1, 1), (1, 16, 17, 64), max_blocks=4),
    PagedCase(
        "mixed_padded",
        (9, 1, 0, 4, 1),
        (9, 40, 7, 25, 33),
        max_blocks=3,
        padding=(False, False, True, False, False),
        pad_rows=3,
    ),
)
CASE_IDS = [c.name for c in CASES]


@dataclasses.dataclass
class PagedBatch:
    q: jax.Array
    k_pool: jax.Array  # [num_blocks, block_size, Hkv, D]
    v_pool: jax.Array
    k_seq: np.ndarray  # [B, max_blocks * block_size, Hkv, D]: the same keys, contiguous
    v_seq: np.ndarray
    query_start_loc: np.ndarray
    kv_lens: np.ndarray
    slot_ids: np.ndarray
    block_table: np.ndarray

    def kwargs(self, *, paged: bool = True) -> dict:
        batch = dict(query_start_loc=self.query_start_loc, kv_lens=self.kv_lens)
        if paged:
            return batch | dict(slot_ids=self.slot_ids, block_table=self.block_table)
        # Contiguous view: sequence b in line b of k_seq.
        slots = np.where(self.slot_ids >= 0, np.arange(len(self.slot_ids)), -1)
        return batch | dict(slot_ids=slots.astype(np.int32))


def make_paged_batch(
    rng: np.random.Generator,
    case: PagedCase,
    *,
    block_size: int,
    dtype=jnp.float32,
    shared: tuple[int, int, int] | None = None,
    unused_entries: str = "minus_one",
    num_q_heads: int = HQ,
    num_kv_heads: int = HKV,
    head_dim: int = HEAD_DIM,
) -> PagedBatch:
    """Random queries, keys and values in a shuffled page pool.

    ``shared = (src, dst, n)``: sequence ``dst``'s first ``n`` pages are ``src``'s (same
    keys and values: a cached prefix). ``unused_entries``: table entries past a sequence's
    needed pages (and every entry of a padding sequence) hold ``"minus_one"`` or
    ``"nan_page"`` (an all-NaN page of the pool).
    """
    num_seqs = len(case.q_lens)
    kv_lens = np.asarray(case.kv_lens, np.int32)
    live = np.ones(num_seqs, bool) if case.padding is None else ~np.asarray(case.padding)
    # Slot ids index other caches; any id >= 0 is live, -1 marks padding.
    slot_ids = np.where(live, rng.permutation(num_seqs) + 3, -1).astype(np.int32)
    max_len = case.max_blocks * block_size
    assert np.all(kv_lens <= max_len), "case does not fit its table"
    needed = np.where(live, -(-kv_lens // block_size), 0)
    shape = (num_seqs, max_len, num_kv_heads, head_dim)
    k_seq = rng.normal(size=shape).astype(np.float32)
    v_seq = rng.normal(size=shape).astype(np.float32)
    if shared is not None:
        src, dst, n = shared
        assert n <= min(needed[src], needed[dst]) and n * block_size <= kv_lens[src]
        k_seq[dst, : n * block_size] = k_seq[src, : n * block_size]
        v_seq[dst, : n * block_size] = v_seq[src, : n * block_size]
    for b in range(num_seqs):  # never read: NaN
        k_seq[b, kv_lens[b] :] = np.nan
        v_seq[b, kv_lens[b] :] = np.nan

    # Distinct pages for every (sequence, block) but the shared ones, plus 3 unused pages.
    own = [(b, j) for b in range(num_seqs) for j in range(needed[b])]
    if shared is not None:
        own = [(b, j) for b, j in own if not (b == shared[1] and j < shared[2])]
    num_blocks = len(own) + 3
    pages = rng.permutation(num_blocks)
    nan_page = int(pages[-1])
    fill = -1 if unused_entries == "minus_one" else nan_page
    table = np.full((num_seqs, case.max_blocks), fill, np.int32)
    for (b, j), page in zip(own, pages, strict=False):
        table[b, j] = page
    if shared is not None:
        src, dst, n = shared
        table[dst, :n] = table[src, :n]
    k_pool = np.full((num_blocks, block_size, num_kv_heads, head_dim), np.nan, np.float32)
    v_pool = k_pool.copy()
    for b in range(num_seqs):
        for j in range(needed[b]):
            rows = slice(j * block_size, (j + 1) * block_size)
            k_pool[table[b, j]] = k_seq[b, rows]
            v_pool[table[b, j]] = v_seq[b, rows]
    num_tokens = int(sum(case.q_lens)) + case.pad_rows
    return PagedBatch(
        q=normal(rng, (num_tokens, num_q_heads, head_dim), dtype),
        k_pool=jnp.asarray(k_pool).astype(dtype),
        v_pool=jnp.asarray(v_pool).astype(dtype),
        k_seq=k_seq,
        v_seq=v_seq,
        query_start_loc=query_start_loc(case.q_lens),
        kv_lens=kv_lens,
        slot_ids=slot_ids,
        block_table=table,
    )


def _attention(impl, batch: PagedBatch, **options):
    config = TRITON_CONFIG if impl == "triton" else None
    return pk.masked_tail_attention(
        batch.q,
        batch.k_pool,
        batch.v_pool,
        **batch.kwargs(),
        **options,
        implementation=impl,
        config=config,
    )


def _check_attention(impl, batch: PagedBatch, dtype, **options):
    out = _attention(impl, batch, **options)
    expected = attention_oracle(batch.q, batch.k_pool, batch.v_pool, **batch.kwargs(), **options)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert_close(as_f32(out), expected, rtol=tolerance_for(dtype), name=f"{impl} {options}")
    dead = dead_rows(batch.q.shape[0], batch.query_start_loc, batch.slot_ids)
    np.testing.assert_array_equal(as_f32(out)[dead], 0.0)


# ------------------------------------------------------------------------------- oracles


@pytest.mark.parametrize(("case", "shared"), [(CASES[1], (0, 1, 1)), (CASES[2], (2, 3, 1))])
def test_paged_oracles_match_the_contiguous_ones(case, shared):
    """The paged oracles read and write exactly what the contiguous ones do on the same
    keys and values, shared pages included (a check of the oracles themselves)."""
    rng = np.random.default_rng(0)
    batch = make_paged_batch(rng, case, block_size=16, shared=shared)
    for options in (dict(), dict(causal=False), dict(sliding_window=5)):
        paged = attention_oracle(batch.q, batch.k_pool, batch.v_pool, **batch.kwargs(), **options)
        contiguous = attention_oracle(
            batch.q, batch.k_seq, batch.v_seq, **batch.kwargs(paged=False), **options
        )
        np.testing.assert_array_equal(paged, contiguous)
    k = normal(rng, (batch.q.shape[0], HKV, HEAD_DIM))
    k_pool, _ = write_kv_oracle(batch.k_pool, batch.v_pool, k, k, **batch.kwargs())
    k_seq, _ = write_kv_oracle(batch.k_seq, batch.v_seq, k, k, **batch.kwargs(paged=False))
    block_size = batch.k_pool.shape[1]
    for b in range(len(case.q_lens)):
        for j in range(-(-case.kv_lens[b] // block_size)):
            rows = slice(j * block_size, (j + 1) * block_size)
            np.testing.assert_array_equal(k_pool[batch.block_table[b, j]], k_seq[b, rows])


# ------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("impl", PAGED_IMPLS)
def test_paged_attention(impl, case):
    """Shuffled pages, NaN everywhere a sequence may not read, GQA. Block size 16 (unused
    entries -1): causal, bidirectional and sliding-window masks; block size 32 (unused
    entries name a NaN page; two 16-key Triton KV blocks per page): causal."""
    masks = (dict(), dict(causal=False), dict(sliding_window=6))
    for block_size, unused, options in ((16, "minus_one", masks), (32, "nan_page", masks[:1])):
        rng = np.random.default_rng(block_size)
        batch = make_paged_batch(rng, case, block_size=block_size, unused_entries=unused)
        for mask in options:
            _check_attention(impl, batch, jnp.float32, **mask)


@pytest.mark.parametrize("impl", PAGED_IMPLS)
def test_paged_attention_shared_pages_bf16(impl):
    """Two sequences read the same two prefix pages (prefix caching), in bf16."""
    case = PagedCase("shared", (6, 1, 3), (38, 40, 3), max_blocks=3)
    batch = make_paged_batch(
        np.random.default_rng(1), case, block_size=16, dtype=jnp.bfloat16, shared=(0, 1, 2)
    )
    assert np.array_equal(batch.block_table[0, :2], batch.block_table[1, :2])
    _check_attention(impl, batch, jnp.bfloat16)


@pytest.mark.parametrize("impl", PAGED_IMPLS)
def test_paged_attention_equals_contiguous(impl):
    """The paged call gives the contiguous call's output on the same keys and values (the
    kernels walk the same KV blocks)."""
    batch = make_paged_batch(np.random.default_rng(2), CASES[1], block_size=16)
    config = TRITON_CONFIG if impl == "triton" else None
    paged = _attention(impl, batch)
    contiguous = pk.masked_tail_attention(
        batch.q,
        jnp.asarray(batch.k_seq),
        jnp.asarray(batch.v_seq),
        **batch.kwargs(paged=False),
        implementation=impl,
        config=config,
    )
    np.testing.assert_allclose(as_f32(paged), as_f32(contiguous), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("impl", PAGED_IMPLS)
def test_paged_attention_needed_entry_out_of_the_pool_stays_in_bounds(impl):
    """A needed table entry outside ``[0, num_blocks)`` is a caller bug: ``validate=True``
    names it; without validation the kernels clamp the page (finite output, no fault)."""
    batch = make_paged_batch(np.random.default_rng(3), CASES[0], block_size=16)
    batch.block_table[1, 0] = batch.k_pool.shape[0] + 5
    with pytest.raises(ValueError, match="block_table entries"):
        pk.masked_tail_attention(
            batch.q, batch.k_pool, batch.v_pool, **batch.kwargs(), validate=True
        )
    nan_free = dataclasses.replace(
        batch, k_pool=jnp.nan_to_num(batch.k_pool), v_pool=jnp.nan_to_num(batch.v_pool)
    )
    out = _attention(impl, nan_free)
    assert np.all(np.isfinite(as_f32(out)))


@pytest.mark.skipif(not supports_mosaic(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("block_size", [64, 128])
def test_paged_mosaic_kernel_matches_oracle(block_size):
    """The Mosaic GPU kernel on a shuffled page pool (bf16, D = 64, GQA): prefill, a
    continued prefix, a shared prefix page, a padding sequence, bucket rows; causal and
    windowed."""
    case = PagedCase(
        "mosaic",
        (70, 9, 0, 40, 33),
        (70, 200, 5, 40 + 128, 33 + 64),
        max_blocks=256 // block_size + 1,
        padding=(False, False, True, False, False),
        pad_rows=8,
    )
    batch = make_paged_batch(
        np.random.default_rng(11),
        case,
        block_size=block_size,
        dtype=jnp.bfloat16,
        shared=(1, 3, 1),
        head_dim=64,
    )
    assert batch.q.shape[0] % 8 == 0
    assert (
        pk.backend_for(
            pk.masked_tail_attention, batch.q, batch.k_pool, batch.v_pool, **batch.kwargs()
        )
        == "mosaic"
    )
    for options in (dict(), dict(sliding_window=50)):
        _check_attention("mosaic", batch, jnp.bfloat16, **options)


@pytest.mark.skipif(not supports_mosaic(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("window", [None, 50])
def test_paged_mosaic_gradients(window):
    """Gradients through the Mosaic backend on a shuffled page pool (its dK/dV kernel reads
    the pages through the block table; a shared prefix page gets both readers' sum) match
    the xla path's fp32 gradients; pool entries nobody reads (NaN) get 0."""
    case = PagedCase(
        "mosaic",
        (70, 9, 0, 40, 33),
        (70, 200, 5, 40 + 128, 33 + 64),
        max_blocks=5,
        padding=(False, False, True, False, False),
        pad_rows=8,
    )
    rng = np.random.default_rng(12)
    batch = make_paged_batch(
        rng, case, block_size=64, dtype=jnp.bfloat16, shared=(1, 3, 1), head_dim=128
    )
    dout = normal(rng, batch.q.shape, jnp.bfloat16)

    def grads(impl, *operands):
        def f(*operands):
            return pk.masked_tail_attention(
                *operands, **batch.kwargs(), sliding_window=window, implementation=impl
            )

        return jax.vjp(f, *operands)[1](dout.astype(operands[0].dtype))

    operands = (batch.q, batch.k_pool, batch.v_pool)
    ref = grads("xla", *(a.astype(jnp.float32) for a in operands))
    unread = ~_read_pages(batch)
    for name, g, r in zip(("dq", "dk", "dv"), grads("mosaic", *operands), ref, strict=True):
        assert_close(as_f32(g), as_f32(r), rtol=tolerance_for(jnp.bfloat16), name=name)
        if name != "dq":
            np.testing.assert_array_equal(as_f32(g)[unread], 0.0, err_msg=name)


# ---------------------------------------------------------------------------- gradients

# Gradient error against the float64 finite differences (see test_gradients.py).
FD_TOL = 1e-5


def _read_pages(batch: PagedBatch) -> np.ndarray:
    """bool[num_blocks, block_size]: the pool entries some sequence reads."""
    read = np.zeros(batch.k_pool.shape[:2], bool)
    block_size = read.shape[1]
    for b, kv_len in enumerate(batch.kv_lens):
        if batch.slot_ids[b] >= 0:
            for j in range(kv_len):
                read[batch.block_table[b, j // block_size], j % block_size] = True
    return read


@pytest.mark.parametrize("impl", PAGED_IMPLS)
def test_paged_attention_gradients(impl):
    """dq and the page pools' dk, dv against finite differences of the float64 paged
    oracle: two sequences share a prefix page (its gradient sums both), a padding sequence,
    bucket rows; pool entries nobody reads (NaN) get exactly 0. The Triton kernels'
    gradients also match the xla path's."""
    case = PagedCase(
        "grad", (5, 3, 0, 2), (21, 19, 4, 2), max_blocks=2, padding=(False, False, True, False)
    )
    batch = make_paged_batch(np.random.default_rng(7), case, block_size=16, shared=(0, 1, 1))
    dout = normal(np.random.default_rng(8), batch.q.shape)
    names = ("dq", "dk_pool", "dv_pool")

    def grads_of(impl, **mask):
        def f(q, k, v):
            b = dataclasses.replace(batch, q=q, k_pool=k, v_pool=v)
            return _attention(impl, b, **mask)

        return jax.vjp(f, batch.q, batch.k_pool, batch.v_pool)[1](dout)

    read = _read_pages(batch)
    for mask in (dict(), dict(sliding_window=4)):
        grads = grads_of(impl, **mask)
        for name, g in zip(names[1:], grads[1:], strict=True):
            np.testing.assert_array_equal(as_f32(g)[~read], 0.0, err_msg=name)

        def oracle(q, k, v, mask=mask):
            return attention_oracle(q, k, v, **batch.kwargs(), **mask)

        primals = tuple(as_f32(p) for p in (batch.q, batch.k_pool, batch.v_pool))
        errors = vjp_errors(oracle, primals, as_f32(dout), [as_f32(g) for g in grads])
        for i, name in enumerate(names):
            assert errors[i] <= FD_TOL, f"{name} {mask}: finite-difference error {errors[i]:.2e}"
        if impl != "xla":
            for name, g, ref in zip(names, grads, grads_of("xla", **mask), strict=True):
                assert_close(as_f32(g), as_f32(ref), rtol=1e-5, name=f"{name} vs xla")


# ---------------------------------------------------------------------------- validation


def test_paged_arguments_are_checked():
    batch = make_paged_batch(np.random.default_rng(4), CASES[0], block_size=16)
    call = functools.partial(pk.masked_tail_attention, batch.q, batch.k_pool, batch.v_pool)
    kwargs = batch.kwargs()
    with pytest.raises(ValueError, match="block_table must have shape"):
        call(**kwargs | dict(block_table=batch.block_table[:2]))
    with pytest.raises(ValueError, match="block_table must be an integer"):
        call(**kwargs | dict(block_table=batch.block_table.astype(np.float32)))
    # kv_lens past the table's capacity (2 pages of 16).
    with pytest.raises(ValueError, match="max_blocks \\* block_size=32"):
        call(**kwargs | dict(kv_lens=np.array([5, 33, 3], np.int32)), validate=True)
    with pytest.raises(ValueError, match="slot_ids must be -1"):
        call(**kwargs | dict(slot_ids=np.array([0, -2, 1], np.int32)), validate=True)
    # A Triton KV block must lie in one page of 16 keys.
    with pytest.raises(ValueError, match="block_k=32 must divide the paged cache's block_size=16"):
        call(
            **kwargs,
            implementation="triton",
            config=attention_config.BlockSizes(block_q=8, block_k=32, decode_block_k=16),
        )
    # Entries past the needed pages may hold anything; slot ids >= 0 may repeat.
    table = batch.block_table.copy()
    table[:, 1][batch.kv_lens <= 16] = 10**6
    call(**kwargs | dict(block_table=table, slot_ids=np.array([7, 7, 0])), validate=True)
    k = normal(np.random.default_rng(0), (batch.q.shape[0], HKV, HEAD_DIM))
    with pytest.raises(ValueError, match="num_blocks"):
        pk.write_kv(
            batch.k_pool,
            batch.v_pool,
            k,
            k,
            **kwargs | dict(block_table=np.full_like(batch.block_table, -1)),
            validate=True,
        )
    # Two sequences may read one page but not write it: the GPU writes would race.
    shared = batch.block_table.copy()
    shared[1] = shared[0]
    pk.masked_tail_attention(
        batch.q, batch.k_pool, batch.v_pool, **kwargs | dict(block_table=shared), validate=True
    )
    with pytest.raises(ValueError, match="both write page"):
        pk.write_kv(
            batch.k_pool, batch.v_pool, k, k, **kwargs | dict(block_table=shared), validate=True
        )


# ------------------------------------------------------------------------------ write_kv


@pytest.mark.parametrize("impl", WRITE_KV_IMPLS)
def test_paged_write_kv(impl):
    """Each token lands in its page's row; pages of padding sequences and pages no
    sequence writes come back bit-identical; a position past the table's capacity and a
    page outside the pool drop."""
    case = CASES[3]  # mixed lengths, a padding sequence, bucket rows
    block_size = 16
    batch = make_paged_batch(np.random.default_rng(5), case, block_size=block_size)
    k_pool = jnp.nan_to_num(batch.k_pool, nan=7.0)
    v_pool = jnp.nan_to_num(batch.v_pool, nan=-7.0)
    num_tokens = batch.q.shape[0]
    rng = np.random.default_rng(6)
    k = normal(rng, (num_tokens, HKV, HEAD_DIM))
    v = normal(rng, (num_tokens, HKV, HEAD_DIM))
    kwargs = batch.kwargs()
    # Sequence 4's one token sits at position 48, past its table's 3 pages of 16; sequence
    # 0's tokens (positions 0-8) go to a page outside the pool. Both drop.
    kwargs["kv_lens"] = batch.kv_lens.copy()
    kwargs["kv_lens"][4] = case.max_blocks * block_size + 1
    kwargs["block_table"] = batch.block_table.copy()
    kwargs["block_table"][0, 0] = k_pool.shape[0] + 2
    new_k, new_v = pk.write_kv(k_pool, v_pool, k, v, **kwargs, implementation=impl)
    want_k, want_v = write_kv_oracle(k_pool, v_pool, k, v, **kwargs)
    assert new_k.dtype == k_pool.dtype
    np.testing.assert_array_equal(as_f32(new_k), want_k)
    np.testing.assert_array_equal(as_f32(new_v), want_v)
    # The oracle's drops and keeps, spelled out: only the live in-pool pages of
    # sequences 1 and 3 changed.
    written = set()
    for b in (1, 3):
        q_len = case.q_lens[b]
        for pos in range(kwargs["kv_lens"][b] - q_len, kwargs["kv_lens"][b]):
            written.add(int(kwargs["block_table"][b, pos // block_size]))
    for page in set(range(k_pool.shape[0])) - written:
        assert_bit_identical(new_k[page], k_pool[page], f"page {page}")
        assert_bit_identical(new_v[page], v_pool[page], f"page {page}")


# ------------------------------------------------------------------------------ lowering


def _paged_specs(T, Hq, Hkv, D, num_blocks, block_size, B, max_blocks, dtype=jnp.bfloat16):
    pool = spec((num_blocks, block_size, Hkv, D), dtype)
    ints = spec((B,), jnp.int32)
    return (
        spec((T, Hq, D), dtype),
        pool,
        pool,
        spec((B + 1,), jnp.int32),
        ints,
        ints,
        spec((B, max_blocks), jnp.int32),
    )


@pytest.mark.parametrize(("T", "B"), [(512, 3), (8, 8)], ids=["prefill", "decode"])
def test_internal_paged_triton_kernels_lower_for_cuda(T, B):
    """The paged Triton kernels (forward, and the backward kernels for prefill) lower for
    CUDA at real sizes with the default tiles (interpret mode does not check Triton's
    rules), page size 256."""
    Hq, Hkv, D, block_size, max_blocks = 32, 8, 128, 256, 8
    args = _paged_specs(T, Hq, Hkv, D, 64, block_size, B, max_blocks)
    config = api._triton_default_config(args[0], args[1], block_table=args[-1])
    assert block_size % config.block_k == 0 and block_size % config.decode_block_k == 0

    def forward(q, k, v, qsl, kv_lens, slots, table):
        return attention_triton.masked_tail_attention(
            q,
            k,
            v,
            query_start_loc=qsl,
            kv_lens=kv_lens,
            slot_ids=slots,
            block_table=table,
            causal=True,
            sm_scale=D**-0.5,
            sliding_window=None,
            config=config,
        )

    kernel = "attention_decode" if T <= B else "attention_prefill"
    text = lower_for_cuda(forward, *args)
    assert kernel in text and f"_paged{block_size}" in text
    if T > B:

        def backward(q, k, v, qsl, kv_lens, slots, table, dout):
            f = functools.partial(forward, qsl=qsl, kv_lens=kv_lens, slots=slots, table=table)
            return jax.vjp(f, q, k, v)[1](dout)

        text = lower_for_cuda(backward, *args, args[0])
        assert "attention_bwd_dq" in text and "attention_bwd_dkv" in text


def _bamba_blocks(num_tokens, cache_len, page_size, dtype=jnp.bfloat16, num_sms=None):
    """The Triton attention's default tiles for Bamba-9B's heads (32 / 8, D = 128)."""
    return attention_config.default_block_sizes(
        num_tokens=num_tokens,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        cache_len=cache_len,
        dtype=dtype,
        page_size=page_size,
        num_sms=num_sms,
    )


def test_paged_long_context_prefill_takes_wider_kv_steps():
    """Paged prefill behind a long cached context (chunked prefill: cache_len >= 4 T) steps
    over 128 keys, three stages deep; calls shaped like self-attention, contiguous caches,
    pages of 64 keys and fp32 keep 64-key steps (or fewer), and the dQ kernel keeps 64."""
    chunked = _bamba_blocks(4096, 32768, 256)
    assert (chunked.block_k, chunked.num_stages) == (128, 3)
    backward = attention_config.default_backward_block_sizes(
        chunked, group=4, head_dim=128, dtype=jnp.bfloat16, page_size=256
    )
    assert (backward.dq_block_k, backward.dkv_block_k) == (64, 128)
    for other in (
        _bamba_blocks(16384, 4096, 256),  # dense causal
        _bamba_blocks(7680, 4096, 256),  # ragged tail
        _bamba_blocks(4096, 32768, None),  # contiguous
        _bamba_blocks(4096, 32768, 64),  # the page holds 64 keys
    ):
        assert (other.block_k, other.num_stages) == (64, 3)
    assert _bamba_blocks(4096, 32768, 256, jnp.float32).block_k == 32


def test_decode_splits_give_one_program_per_sm():
    """Flash-decoding splits the keys into as few splits as still give every SM a program:
    one row of Bamba-9B's attention (8 KV heads, 4k keys in pages of 256) on 132 SMs takes
    256 keys a split (136 programs; the combine merges a token's splits in sequence), 64
    rows and a 32k context keep 1024."""
    for rows, cache_len, split_k in ((1, 4352, 256), (64, 4352, 1024), (1, 32768, 1024)):
        assert _bamba_blocks(rows, cache_len, 256, num_sms=132).split_k == split_k


@pytest.mark.gpu
def test_internal_paged_triton_long_context_real_size():
    """Chunked prefill on a long paged context with the default tiles (128-key steps) at
    real size, bf16: the contiguous Triton kernel's output (64-key steps) and the xla
    path's, within bf16 tolerance; NaN past every sequence's keys is never read."""
    case = PagedCase("long", (512, 300, 512, 17), (8704, 2348, 6000, 8000), max_blocks=36)
    batch = make_paged_batch(
        np.random.default_rng(9),
        case,
        block_size=256,
        dtype=jnp.bfloat16,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
    )
    config = api._triton_default_config(batch.q, batch.k_pool, block_table=batch.block_table)
    assert config.block_k == 128
    paged = pk.masked_tail_attention(
        batch.q, batch.k_pool, batch.v_pool, **batch.kwargs(), implementation="triton"
    )
    contiguous = pk.masked_tail_attention(
        batch.q,
        jnp.asarray(batch.k_seq, jnp.bfloat16),
        jnp.asarray(batch.v_seq, jnp.bfloat16),
        **batch.kwargs(paged=False),
        implementation="triton",
    )
    reference = pk.masked_tail_attention(
        batch.q.astype(jnp.float32),
        batch.k_pool.astype(jnp.float32),
        batch.v_pool.astype(jnp.float32),
        **batch.kwargs(),
        implementation="xla",
    )
    assert np.all(np.isfinite(as_f32(paged)))
    assert_close(as_f32(paged), as_f32(contiguous), rtol=1e-2, name="paged vs contiguous")
    assert_close(as_f32(paged), as_f32(reference), rtol=tolerance_for(jnp.bfloat16), name="xla")


@pytest.mark.parametrize(("block_size", "block_k"), [(256, 128), (64, 64)])
def test_internal_paged_mosaic_kernel_lowers_for_cuda(block_size, block_k):
    """The Mosaic GPU backend with the page read from the block table lowers for Hopper on
    any machine (it runs only on a Hopper GPU): the forward kernel, and its gradient (the
    Mosaic dQ and dK/dV kernels reading pages); the default tiles fit the page."""
    Hq, Hkv, D, T, B = 8, 2, 128, 512, 3
    args = _paged_specs(T, Hq, Hkv, D, 40, block_size, B, 1024 // block_size)
    q, k_pool, _, qsl, _, _, table = args
    assert (
        attention_mosaic_config.supports(q, k_pool, k_pool, query_start_loc=qsl, block_table=table)
        is None
    )
    small_pages = spec((40, 32, Hkv, D))
    reason = attention_mosaic_config.supports(
        q, small_pages, small_pages, query_start_loc=qsl, block_table=table
    )
    assert "block_size=32 is not a multiple of 64" in reason
    blocks = api.MASKED_TAIL_ATTENTION.backend("mosaic").default_config(
        q, k_pool, k_pool, block_table=table
    )
    assert blocks.block_k == block_k

    def forward(q, k, v, qsl, kv_lens, slots, table):
        return api._mosaic_attention(
            q,
            k,
            v,
            query_start_loc=qsl,
            kv_lens=kv_lens,
            slot_ids=slots,
            block_table=table,
            causal=True,
            sm_scale=D**-0.5,
            sliding_window=None,
            config=blocks,
        )

    def backward(q, k, v, qsl, kv_lens, slots, table, dout):
        f = functools.partial(forward, qsl=qsl, kv_lens=kv_lens, slots=slots, table=table)
        return jax.vjp(f, q, k, v)[1](dout)

    assert "mosaic_gpu" in lower_for_cuda(forward, *args)
    text = lower_for_cuda(backward, *args, q)
    assert text.count("custom_call @mosaic_gpu") == 3 and "attention_bwd_dq_bq" not in text
    with pytest.raises(ValueError, match="must divide the paged cache's block_size=64"):
        attention_mosaic_config.check_block_sizes(
            attention_mosaic_config.BlockSizes(block_k=128), num_q_heads=Hq, page_size=64
        )
