"""Chunk-aligned metadata: the DESIGN §4 example, layout properties, buckets."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pallas_kernels as pk
from pallas_kernels.metadata import (
    TOKEN_BUCKET_POLICIES,
    ChunkMetadata,
    bucket_for,
    chunk_metadata,
    max_chunks_for,
    pad_to_bucket,
    sequence_block_table,
    sequence_buckets,
    token_buckets,
)
from tests.helpers import query_start_loc


def _metadata(lengths, computed, chunk_size, max_chunks=None, num_tokens=None):
    qsl = query_start_loc(lengths)
    num_tokens = num_tokens or max(int(qsl[-1]), 1)
    max_chunks = max_chunks or max_chunks_for(num_tokens, len(lengths), chunk_size)
    fn = jax.jit(chunk_metadata, static_argnames=("chunk_size", "max_chunks"))
    md = fn(
        jnp.asarray(qsl),
        jnp.asarray(computed, jnp.int32),
        chunk_size=chunk_size,
        max_chunks=max_chunks,
    )
    return qsl, jax.tree.map(np.asarray, md)


def test_design_example():
    _, md = _metadata([20, 10, 5, 2], [0, 13, 16, 5], chunk_size=8, max_chunks=7)
    np.testing.assert_array_equal(md.cu_chunk_seqlens, [0, 8, 16, 20, 23, 30, 35, 37])
    np.testing.assert_array_equal(md.seq_idx, [0, 0, 0, 1, 1, 2, 3])
    np.testing.assert_array_equal(md.last_chunk_indices, [2, 4, 5, 6])
    assert int(md.num_chunks) == 7


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_metadata_built_from_the_four_arrays(impl):
    """DESIGN §4's constructor, ``ChunkMetadata(cu_chunk_seqlens, seq_idx,
    last_chunk_indices, num_chunks)``, builds metadata ``ssd_scan`` takes with its own
    chunk_size (before: a required keyword ``chunk_size`` made it a TypeError), with the
    results of ``chunk_metadata``'s; another chunk size is still refused."""
    _, md = _metadata([20, 10, 5, 2], [0, 13, 16, 5], chunk_size=8, max_chunks=12)
    by_hand = ChunkMetadata(md.cu_chunk_seqlens, md.seq_idx, md.last_chunk_indices, md.num_chunks)
    assert by_hand.chunk_size is None
    rng = np.random.default_rng(0)
    T, H, P, N = 37, 2, 4, 8
    x, dt = rng.normal(size=(T, H, P)), rng.normal(size=(T, H))
    B, C = rng.normal(size=(T, 1, N)), rng.normal(size=(T, 1, N))
    args = [jnp.asarray(a, jnp.float32) for a in (x, dt, -np.ones(H), B, C)]
    y, states = pk.ssd_scan(*args, metadata=md, chunk_size=8, implementation=impl)
    y2, states2 = pk.ssd_scan(*args, metadata=by_hand, chunk_size=8, implementation=impl)
    np.testing.assert_array_equal(y2, y)
    np.testing.assert_array_equal(states2, states)
    with pytest.raises(ValueError, match="chunk_size"):
        pk.ssd_scan(*args, metadata=md, chunk_size=4, implementation=impl)


def test_padding_chunks_and_empty_sequences():
    _, md = _metadata([3, 0, 2], [0, 4, 7], chunk_size=4, max_chunks=8)
    np.testing.assert_array_equal(md.cu_chunk_seqlens, [0, 3, 4, 5, 5, 5, 5, 5, 5])
    np.testing.assert_array_equal(md.seq_idx, [0, 2, 2, -1, -1, -1, -1, -1])
    np.testing.assert_array_equal(md.last_chunk_indices, [0, -1, 2])
    assert int(md.num_chunks) == 3


def _check_layout(lengths, computed, chunk_size):
    qsl, md = _metadata(lengths, computed, chunk_size)
    total, num_seqs = int(qsl[-1]), len(lengths)
    n = int(md.num_chunks)
    cu, seq = md.cu_chunk_seqlens, md.seq_idx
    assert n <= total // chunk_size + 2 * num_seqs
    assert n <= md.seq_idx.shape[0]
    # Chunks cover all tokens in order, each non-empty; padding chunks are empty.
    assert cu[0] == 0 and cu[n] == total
    assert np.all(np.diff(cu[: n + 1]) > 0)
    assert np.all(cu[n:] == total) and np.all(seq[n:] == -1)
    for c in range(n):
        b = seq[c]
        start, end = cu[c], cu[c + 1]
        # No chunk crosses sequences.
        assert qsl[b] <= start and end <= qsl[b + 1]
        assert end - start <= chunk_size
        # Ends at an absolute multiple of the chunk size or at the sequence's last token;
        # starts at one too, or at the sequence's first new token.
        abs_end = computed[b] + end - qsl[b]
        abs_start = computed[b] + start - qsl[b]
        assert abs_end % chunk_size == 0 or end == qsl[b + 1]
        assert abs_start % chunk_size == 0 or start == qsl[b]
        # A chunk never spans an absolute chunk boundary.
        assert abs_start // chunk_size == (abs_end - 1) // chunk_size
    for b in range(num_seqs):
        last = md.last_chunk_indices[b]
        if lengths[b] == 0:
            assert last == -1
        else:
            assert seq[last] == b and cu[last + 1] == qsl[b + 1]
            assert last == n - 1 or seq[last + 1] != b


@given(
    chunk_size=st.sampled_from([1, 4, 8, 16]),
    layout=st.lists(
        st.tuples(
            st.sampled_from([0, 1, 2, 3, 5, 7, 8, 9, 16, 17, 31]),
            st.sampled_from([0, 1, 2, 3, 7, 8, 15, 16, 33]),
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_layout_properties(chunk_size, layout):
    lengths = [n for n, _ in layout]
    computed = [nc for _, nc in layout]
    _check_layout(lengths, computed, chunk_size)


@pytest.mark.parametrize("chunk_size", [1, 4, 8, 16])
def test_layout_edge_cases(chunk_size):
    _check_layout([1], [0], chunk_size)
    _check_layout([0, 0, 1], [0, 5, 0], chunk_size)
    _check_layout([chunk_size, 1, chunk_size + 1], [chunk_size - 1, 1, 0], chunk_size)


def test_max_chunks_for():
    assert max_chunks_for(37, 4, 8) == 12  # 37 // 8 + 2 * 4
    assert max_chunks_for(5, 4, 8) == 5  # never more chunks than tokens
    assert max_chunks_for(0, 1, 8) == 1
    with pytest.raises(ValueError, match="chunk_size"):
        max_chunks_for(8, 1, 0)


def test_buckets():
    assert token_buckets(100, min_tokens=16) == (16, 32, 64, 128)
    assert sequence_buckets(8) == (1, 2, 4, 8)
    assert bucket_for(33, token_buckets(100)) == 64
    with pytest.raises(ValueError, match="exceeds"):
        bucket_for(129, token_buckets(100))
    qsl = pad_to_bucket(np.array([0, 3, 5]), 5, mode="edge")
    np.testing.assert_array_equal(qsl, [0, 3, 5, 5, 5])
    slots = pad_to_bucket(np.array([2, 0]), 4, fill=-1)
    np.testing.assert_array_equal(slots, [2, 0, -1, -1])
    with pytest.raises(ValueError, match="exceeds bucket"):
        pad_to_bucket(np.arange(5), 4)


def test_token_bucket_policies_exact():
    """The sizes of each policy (the docstring's table), and pow2 as the default."""
    pow2 = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    assert token_buckets(8192) == token_buckets(8192, policy="pow2") == pow2
    assert token_buckets(8192, policy="sqrt2") == (
        *(16, 32, 48, 64, 96, 128, 192, 256, 368, 512, 736, 1024),
        *(1456, 2048, 2912, 4096, 5808, 8192),
    )
    assert token_buckets(8192, policy="linear", step=2048) == (*pow2[:-2], 4096, 6144, 8192)
    assert token_buckets(8192, policy="linear") == pow2  # step 4096: 8192 is 2 x 4096
    # The 22.5k-token step of the module comment: 24576 under linear, 32768 under pow2.
    big = token_buckets(24576, policy="linear")
    assert big[-6:] == (4096, 8192, 12288, 16384, 20480, 24576)
    assert bucket_for(22_500, big) == 24576
    assert bucket_for(22_500, token_buckets(24576)) == 32768
    # min_tokens and a max_tokens below it, as pow2 has always done.
    assert token_buckets(100, min_tokens=20, policy="sqrt2") == (32, 48, 64, 96, 128)
    assert token_buckets(10) == (16,)
    assert token_buckets(10, policy="sqrt2", min_tokens=1) == (16,)
    linear = token_buckets(20, min_tokens=1, policy="linear", step=3)
    assert linear == (1, 2, 3, 6, 9, 12, 15, 18, 21)
    assert token_buckets(5, min_tokens=2, policy="linear", step=8) == (2, 4, 8)


def _padding_bound(policy: str, size: int, step: int | None) -> int:
    """The largest bucket ``policy`` may give ``size`` (for sizes >= its smallest bucket's
    bound; the docstring's padding bound)."""
    if policy == "pow2":
        return 2 * size - 1
    if policy == "sqrt2":
        return 16 * math.ceil(math.sqrt(2) * size / 16)
    return min(2 * size, size + (step or 4096)) - 1


@pytest.mark.parametrize("policy", TOKEN_BUCKET_POLICIES)
@pytest.mark.parametrize(
    "max_tokens,min_tokens,step",
    [(8192, 16, None), (8192, 16, 1024), (6000, 16, 1536), (100, 1, 24), (1, 1, None)],
)
def test_token_bucket_policy_properties(policy, max_tokens, min_tokens, step):
    """Increasing, the largest covers ``max_tokens``, none below ``min_tokens``, and every
    size from ``min_tokens`` to ``max_tokens`` pads within the policy's bound."""
    if policy != "linear":
        step = None
    buckets = token_buckets(max_tokens, min_tokens=min_tokens, policy=policy, step=step)
    assert all(a < b for a, b in zip(buckets, buckets[1:], strict=False)), buckets
    assert buckets[-1] >= max_tokens
    assert len(buckets) == 1 or buckets[-2] < max_tokens  # stops at the first that covers
    assert buckets[0] >= min(min_tokens, max_tokens)
    if policy == "sqrt2":
        assert all(b % 16 == 0 for b in buckets)
    low = min(min_tokens, max_tokens)
    for size in range(1, max_tokens + 1):
        bucket = bucket_for(size, buckets)
        assert bucket >= size
        if size >= low:
            assert bucket <= _padding_bound(policy, size, step), (size, bucket)


def test_token_bucket_sqrt2_pads_less_than_pow2():
    """Large sizes: worst-case padding near 1 - 1/√2 (29%) against pow2's 50%."""
    sizes = range(1024, 8193)
    for policy, worst in (("pow2", 0.5), ("sqrt2", 0.30)):
        buckets = token_buckets(8192, policy=policy)
        padding = max(1 - s / bucket_for(s, buckets) for s in sizes)
        assert padding < worst, (policy, padding)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_tokens=0), "max_tokens=0"),
        (dict(max_tokens=8.0), "max_tokens=8.0"),
        (dict(max_tokens=True), "max_tokens=True"),
        (dict(max_tokens=64, min_tokens=0), "min_tokens=0"),
        (dict(max_tokens=64, policy="pow3"), "policy='pow3'"),
        (dict(max_tokens=64, step=32), "step=32 is only for policy='linear'"),
        (dict(max_tokens=64, policy="sqrt2", step=32), "step=32"),
        (dict(max_tokens=64, policy="linear", step=8), "step=8 must be >= min"),
        (dict(max_tokens=64, policy="linear", step=0), "step=0"),
        (dict(max_tokens=64, policy="linear", step="4"), "step='4' must be an int"),
    ],
)
def test_token_bucket_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        token_buckets(**kwargs)


def test_token_buckets_take_numpy_ints():
    assert token_buckets(np.int64(100), min_tokens=np.int32(16)) == (16, 32, 64, 128)


def test_metadata_argument_errors():
    with pytest.raises(ValueError, match="num_computed_tokens"):
        chunk_metadata(jnp.array([0, 3]), jnp.array([0, 0]), chunk_size=4, max_chunks=2)
    with pytest.raises(ValueError, match="max_chunks"):
        chunk_metadata(jnp.array([0, 3]), jnp.array([0]), chunk_size=4, max_chunks=0)


def test_internal_step_layouts_lower_without_loops():
    """A step's layouts (the chunk metadata, its sequences' chunks, the block and token
    layouts, the forward batch) are straight-line programs: a binary search would be a
    loop whose every iteration the host launches as its own kernels."""
    from flax_models.batch import make_forward_batch
    from pallas_kernels.attention._layout import token_layout
    from pallas_kernels.ssd import triton_config as ssd_config

    qsl, computed = jnp.array([0, 5, 70, 103], jnp.int32), jnp.array([0, 3, 0], jnp.int32)
    x, B = jnp.zeros((128, 2, 4)), jnp.zeros((128, 1, 8))

    def layouts(qsl, computed):
        md = chunk_metadata(qsl, computed, chunk_size=16, max_chunks=16)
        shapes = ssd_config.ScanShapes.of(x, B, md)
        return (
            md,
            ssd_config.sequence_chunks(shapes, md),
            sequence_block_table(qsl, block_size=16, num_blocks=12),
            dataclasses.astuple(
                token_layout(128, qsl, computed + qsl[1:] - qsl[:-1], jnp.arange(3))
            ),
            make_forward_batch(qsl, computed, jnp.arange(3), num_tokens=128, chunk_size=16),
        )

    text = jax.jit(layouts).lower(qsl, computed).as_text()
    assert "stablehlo.while" not in text
