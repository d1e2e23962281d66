"""``grouped_matmul`` against the float64 expert-by-expert oracle, for every implementation
in the registry (Pallas kernels in interpret mode off-GPU).

Rows of ``x`` past ``sum(group_sizes)`` hold NaN: they must never be read, and their
outputs must be exactly 0. The Triton kernel runs with 16-row tiles (``SMALL_TILES``)
unless a test asks for the heuristic's: row tiles then straddle expert boundaries and M is
no multiple of the tile on these small shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.backend import on_gpu, supports_mosaic
from pallas_kernels.grouped_matmul import api
from pallas_kernels.grouped_matmul import mosaic as gm_mosaic
from pallas_kernels.grouped_matmul import triton as gm_triton
from pallas_kernels.grouped_matmul import triton_config as gm_config
from pallas_kernels.testing import assert_close, grouped_matmul_oracle, tolerance_for
from tests.helpers import as_f32, implementations, lower_for_cuda, normal, spec

IMPLS = implementations(api.GROUPED_MATMUL)
DTYPES = (jnp.float32, jnp.bfloat16)
SMALL_TILES = gm_config.BlockSizes(block_m=16, block_n=16, block_k=16, num_warps=2)


def config_for(impl: str, tiles=SMALL_TILES):
    """``config=`` for ``impl``: the Triton tiles, None for the others (their defaults)."""
    return tiles if impl == "triton" else None


def op_for(impl: str, x, w, group_sizes, *, tiles=SMALL_TILES):
    """``grouped_matmul`` bound to ``impl`` (and its test config). ``mosaic`` (on a Hopper
    GPU) may serve only some calls (dtypes, alignments) and raises on the others: the test
    is skipped with the reason rather than run on another backend."""
    fn = functools.partial(pk.grouped_matmul, implementation=impl, config=config_for(impl, tiles))
    if impl == "mosaic":
        try:
            pk.backend_for(fn, x, w, group_sizes)
        except ValueError as reason:
            pytest.skip(f"the Mosaic kernel does not serve this call: {reason}")
    return fn


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    num_rows: int
    group_sizes: tuple[int, ...]
    K: int = 40
    N: int = 24


CASES = {
    c.name: c
    for c in (
        # sum < M: 5 tail rows; an empty expert; a 17-row expert over two 16-row tiles.
        Case("uneven_with_tail", 37, (10, 0, 17, 5)),
        Case("full", 20, (7, 9, 4)),
        Case("one_expert_holds_all", 21, (0, 21, 0, 0)),
        Case("empty_experts", 23, (0, 0, 9, 0, 11, 0)),
        Case("single_expert_tail", 19, (6,)),
        Case("no_rows_routed", 9, (0, 0)),
        Case("wide", 18, (5, 13), K=64, N=48),
    )
}


# --------------------------------------------------------------------------- helpers


def make_inputs(rng, case: Case, dtype=jnp.float32, *, poison_tail: bool = True):
    """x (NaN in the rows past sum(group_sizes)), w, int32 group_sizes."""
    x = normal(rng, (case.num_rows, case.K), dtype)
    if poison_tail:
        x = x.at[sum(case.group_sizes) :].set(jnp.nan)
    w = normal(rng, (len(case.group_sizes), case.K, case.N), dtype, scale=case.K**-0.5)
    return x, w, jnp.asarray(case.group_sizes, jnp.int32)


def check_output(x, w, group_sizes, y, *, rtol=None) -> None:
    """Owned rows match the oracle; the rows past sum(group_sizes) are exactly 0."""
    total = int(np.sum(group_sizes))
    assert y.shape == (x.shape[0], w.shape[2]) and y.dtype == x.dtype
    y = as_f32(y)
    np.testing.assert_array_equal(y[total:], 0.0, err_msg="rows past sum(group_sizes)")
    x_owned = as_f32(x)[:total]
    ref = grouped_matmul_oracle(x_owned, as_f32(w), group_sizes)
    assert np.all(np.isfinite(y[:total]))
    if total:
        assert_close(y[:total], ref, rtol=rtol or tolerance_for(x.dtype), name="y")


def oracle_grads(x, w, group_sizes, dy):
    """float64 dx = dy w[e]ᵀ and dw[e] = x_eᵀ dy_e, expert by expert."""
    x, w, dy = (np.float64(as_f32(a)) for a in (x, w, dy))
    dx, dw, offset = np.zeros_like(x), np.zeros_like(w), 0
    for e, size in enumerate(np.asarray(group_sizes)):
        rows = slice(offset, offset + size)
        dx[rows] = dy[rows] @ w[e].T
        dw[e] = x[rows].T @ dy[rows]
        offset += size
    return dx, dw


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_oracle(impl, case, dtype):
    c = CASES[case]
    x, w, group_sizes = make_inputs(np.random.default_rng(0), c, dtype)
    y = op_for(impl, x, w, group_sizes)(x, w, group_sizes)
    check_output(x, w, c.group_sizes, y)


@pytest.mark.parametrize("impl", IMPLS)
def test_default_config(impl):
    """The heuristic's tiling (32-column blocks, 64-deep K steps masked at K = 40)."""
    c = CASES["uneven_with_tail"]
    x, w, group_sizes = make_inputs(np.random.default_rng(1), c, jnp.bfloat16)
    y = op_for(impl, x, w, group_sizes, tiles=None)(x, w, group_sizes)
    check_output(x, w, c.group_sizes, y)


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_follow_their_expert(impl):
    """Moving one row from expert 0 to expert 1 (group sizes [4, 6] -> [3, 7]) changes that
    row's output only, to its product with the other expert's weights."""
    c = Case("moved", 10, (4, 6))
    x, w, group_sizes = make_inputs(np.random.default_rng(2), c, poison_tail=False)
    run = op_for(impl, x, w, group_sizes)
    before = as_f32(run(x, w, jnp.array([4, 6])))
    after = as_f32(run(x, w, jnp.array([3, 7])))
    np.testing.assert_array_equal(np.delete(after, 3, 0), np.delete(before, 3, 0))
    np.testing.assert_allclose(after[3], as_f32(x)[3] @ as_f32(w)[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_traced_group_sizes_are_clamped(impl):
    """Under jax.jit group_sizes are data: sums past M and negative sizes are clamped
    (expert e owns rows [min(c[e-1], M), min(c[e], M)) of c = cumsum(max(g, 0))), so
    nothing is read or written out of bounds; valid sizes give the oracle's result."""
    c = CASES["uneven_with_tail"]
    x, w, group_sizes = make_inputs(np.random.default_rng(3), c)
    run = jax.jit(op_for(impl, x, w, group_sizes))
    check_output(x, w, c.group_sizes, run(x, w, group_sizes))
    x = x.at[32:].set(1.0)  # no NaN: every row is owned below
    clamped = run(x, w, jnp.array([-3, 30, 50, 4], jnp.int32))
    check_output(x, w, (0, 30, 7, 0), clamped)
    # Run again with other sizes: the same compiled program.
    check_output(x, w, (1, 2, 3, 4), run(x, w, jnp.array([1, 2, 3, 4], jnp.int32)))


@pytest.mark.parametrize("impl", IMPLS)
def test_deterministic(impl):
    c = CASES["uneven_with_tail"]
    x, w, group_sizes = make_inputs(np.random.default_rng(4), c, jnp.bfloat16)
    run = op_for(impl, x, w, group_sizes)
    assert np.asarray(run(x, w, group_sizes)).tobytes() == (
        np.asarray(run(x, w, group_sizes)).tobytes()
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_gradients(impl, dtype):
    """jax.grad in x and w matches the float64 dx = dy w[e]ᵀ, dw[e] = x_eᵀ dy_e: rows past
    sum(group_sizes) get dx = 0 and experts without rows dw = 0."""
    c = Case("grads", 29, (9, 0, 17), K=24, N=40)
    x, w, group_sizes = make_inputs(np.random.default_rng(5), c, dtype, poison_tail=False)
    dy = normal(np.random.default_rng(6), (c.num_rows, c.N), dtype)
    run = op_for(impl, x, w, group_sizes)
    _, vjp = jax.vjp(lambda x, w: run(x, w, group_sizes), x, w)
    dx, dw = vjp(dy)
    dx_ref, dw_ref = oracle_grads(x, w, c.group_sizes, dy)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    rtol = tolerance_for(dtype)
    assert_close(as_f32(dx), dx_ref, rtol=rtol, name="dx")
    np.testing.assert_array_equal(as_f32(dx)[26:], 0.0)
    np.testing.assert_array_equal(as_f32(dw)[1], 0.0)
    assert_close(as_f32(dw), dw_ref, rtol=rtol, name="dw")


def test_triton_backward_runs_its_own_kernels():
    """The Triton backend differentiates through its Pallas backward kernels (dx: the tile
    kernel with wᵀ; dw: the per-expert kernel), not through the reference."""
    c = CASES["full"]
    x, w, group_sizes = make_inputs(np.random.default_rng(7), c)

    def loss(x, w):
        y = pk.grouped_matmul(x, w, group_sizes, implementation="triton", config=SMALL_TILES)
        return jnp.sum(y * y)

    jaxpr = str(jax.make_jaxpr(jax.grad(loss, (0, 1)))(x, w))
    assert "grouped_matmul_dx_bm16" in jaxpr and "grouped_matmul_dw_bm16" in jaxpr
    assert "ragged_dot" not in jaxpr


@pytest.mark.parametrize("impl", IMPLS)
def test_under_x64(impl):
    """With jax_enable_x64, int64 group sizes and fp32 inputs run every implementation;
    float64 inputs run xla (Pallas backends refuse them by name, ValueError)."""
    c = CASES["uneven_with_tail"]
    with jax.enable_x64(True):
        x, w, _ = make_inputs(np.random.default_rng(8), c)
        group_sizes = jnp.asarray(c.group_sizes, jnp.int64)
        y = op_for(impl, x, w, group_sizes)(x, w, group_sizes)
        check_output(x, w, c.group_sizes, y)
        x64, w64 = x.astype(jnp.float64), w.astype(jnp.float64)
        if impl == "xla":
            y = pk.grouped_matmul(x64, w64, group_sizes, implementation=impl)
            assert y.dtype == jnp.float64
            check_output(x64, w64, c.group_sizes, y, rtol=1e-6)  # as_f32 rounds y
        else:
            with pytest.raises(ValueError, match="float64"):
                pk.grouped_matmul(x64, w64, group_sizes, implementation=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_calls(impl):
    """No rows, no experts or no columns: zeros of the right shape, nothing runs."""
    rng = np.random.default_rng(9)
    for x, w, group_sizes in (
        (jnp.zeros((0, 8)), normal(rng, (3, 8, 16)), jnp.zeros((3,), jnp.int32)),
        (normal(rng, (5, 8)), jnp.zeros((0, 8, 16)), jnp.zeros((0,), jnp.int32)),
    ):
        y = op_for(impl, x, w, group_sizes, tiles=None)(x, w, group_sizes)
        assert y.shape == (x.shape[0], 16) and y.dtype == x.dtype
        assert not np.any(np.asarray(y))


# --------------------------------------------------------------------------- dispatch and config


@pytest.mark.parametrize("impl", IMPLS)
def test_runs_the_named_implementation(impl):
    c = CASES["full"]
    x, w, group_sizes = make_inputs(np.random.default_rng(10), c)
    fn = op_for(impl, x, w, group_sizes, tiles=None)
    assert pk.backend_for(fn, x, w, group_sizes) == impl
    if not on_gpu():
        assert pk.backend_for(pk.grouped_matmul, x, w, group_sizes) == "xla"
    jaxpr = str(jax.make_jaxpr(fn)(x, w, group_sizes))
    assert ("pallas_call" in jaxpr) == (impl != "xla")


@pytest.mark.parametrize(
    "tiles",
    [
        gm_config.BlockSizes(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1),
        gm_config.BlockSizes(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2),
    ],
)
def test_triton_config_is_used(tiles):
    """An explicit config reaches the kernel (its name carries the tiling) and gives the
    oracle's numbers; without one the heuristic's config does."""
    c = CASES["uneven_with_tail"]
    x, w, group_sizes = make_inputs(np.random.default_rng(11), c)
    fn = functools.partial(pk.grouped_matmul, implementation="triton")

    def kernel_names(**kw):
        jaxpr = jax.make_jaxpr(functools.partial(fn, **kw))(x, w, group_sizes)
        return set(re.findall(r"grouped_matmul_bm\d+_bn\d+_bk\d+_w\d+_s\d+", str(jaxpr)))

    t = tiles
    name = (
        f"grouped_matmul_bm{t.block_m}_bn{t.block_n}_bk{t.block_k}_w{t.num_warps}_s{t.num_stages}"
    )
    assert kernel_names(config=tiles) == {name}
    d = gm_config.default_block_sizes(c.num_rows, c.K, c.N, len(c.group_sizes), x.dtype)
    assert d != tiles
    assert kernel_names() == {
        f"grouped_matmul_bm{d.block_m}_bn{d.block_n}_bk{d.block_k}_w{d.num_warps}_s{d.num_stages}"
    }
    check_output(x, w, c.group_sizes, fn(x, w, group_sizes, config=tiles))


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(block_m=24), "block_m"),
        (dict(block_m=8), "block_m"),
        (dict(block_n=0), "block_n"),
        (dict(block_k=48), "block_k"),
        (dict(num_warps=3), "num_warps"),
        (dict(num_stages=0), "num_stages"),
        (dict(block_m=16, narrow_m=16), "narrow_m"),
        (dict(narrow_m=8), "narrow_m"),
    ],
)
def test_invalid_block_sizes(fields, match):
    with pytest.raises(ValueError, match=match):
        gm_config.BlockSizes(**fields)


def test_narrow_tiles():
    """With ``narrow_m``, tiles of at most 16 live rows take the 16-row dot and fuller ones
    the 32-row dot: both give the oracle's rows and gradients (groups of 3, 16 and 17 rows
    sit on either side of the switch; a 40-row group spans a full and a partial tile)."""
    c = Case("narrow", 90, (3, 0, 40, 16, 17, 7), K=24, N=40)
    tiles = gm_config.BlockSizes(block_m=32, narrow_m=16, block_n=16, block_k=16, num_warps=2)
    x, w, group_sizes = make_inputs(np.random.default_rng(15), c, poison_tail=False)
    run = functools.partial(pk.grouped_matmul, implementation="triton", config=tiles)
    y, vjp = jax.vjp(lambda x, w: run(x, w, group_sizes), x, w)
    check_output(x, w, c.group_sizes, y)
    dy = normal(np.random.default_rng(16), (c.num_rows, c.N), jnp.float32)
    dx, dw = vjp(dy)
    dx_ref, dw_ref = oracle_grads(x, w, c.group_sizes, dy)
    assert_close(as_f32(dx), dx_ref, rtol=tolerance_for(jnp.float32), name="dx")
    assert_close(as_f32(dw), dw_ref, rtol=tolerance_for(jnp.float32), name="dw")


def test_decode_heuristic_has_a_narrow_path():
    """Weight-streaming calls get 64-row tiles with a narrow path of the mean rows per
    expert; a call no larger than one narrow tile, and prefill calls, get one tile size."""
    decode = gm_config.default_block_sizes(1536, 2688, 1856, 128, jnp.bfloat16)
    assert (decode.block_m, decode.narrow_m) == (64, 16)
    one_token = gm_config.default_block_sizes(6, 2688, 1856, 128, jnp.bfloat16)
    assert (one_token.block_m, one_token.narrow_m) == (16, None)
    busy = gm_config.default_block_sizes(2560, 768, 4096, 72, jnp.bfloat16)
    assert (busy.block_m, busy.narrow_m) == (64, None)
    prefill = gm_config.default_block_sizes(81920, 4096, 1536, 72, jnp.bfloat16)
    assert (prefill.block_m, prefill.narrow_m) == (128, None)


def test_config_of_another_backend_is_refused():
    c = CASES["full"]
    x, w, group_sizes = make_inputs(np.random.default_rng(12), c)
    with pytest.raises(ValueError, match="config"):
        pk.grouped_matmul(x, w, group_sizes, implementation="xla", config=SMALL_TILES)


def test_internal_tile_schedule_worked_example():
    """The module docstring's example: tiles never straddle experts; the tail has its own
    (expert E) tiles; padding tiles are empty."""
    expert, start, end = gm_triton.tile_schedule(jnp.array([6, 0, 3], jnp.int32), 12, 4)
    np.testing.assert_array_equal(expert[:4], [0, 0, 2, 3])
    np.testing.assert_array_equal(start[:4], [0, 4, 6, 9])
    np.testing.assert_array_equal(end[:4], [4, 6, 9, 12])
    assert expert.shape == (gm_triton.num_row_tiles(12, 3, 4),) == (6,)
    assert np.all(np.asarray(end[4:]) <= np.asarray(start[4:]))


@pytest.mark.parametrize("seed", range(4))
def test_internal_tile_schedule_covers_every_row_once(seed):
    """Random group sizes: the live tiles cover [0, M) exactly once, each within one group,
    within the static bound."""
    rng = np.random.default_rng(seed)
    E, M, block_m = int(rng.integers(1, 9)), int(rng.integers(1, 80)), 16
    sizes = rng.multinomial(int(rng.integers(0, M + 1)), np.ones(E) / E)
    expert, start, end = (
        np.asarray(a) for a in gm_triton.tile_schedule(jnp.asarray(sizes, jnp.int32), M, block_m)
    )
    bounds = np.concatenate([[0], np.cumsum(sizes), [M]])
    covered = np.zeros(M, int)
    for e, s, t in zip(expert, start, end, strict=True):
        if t > s:
            assert t - s <= block_m and bounds[e] <= s and t <= bounds[e + 1]
            covered[s:t] += 1
    np.testing.assert_array_equal(covered, 1)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("impl", IMPLS)
def test_argument_errors_name_the_argument(impl):
    c = CASES["full"]
    x, w, group_sizes = make_inputs(np.random.default_rng(13), c)
    run = functools.partial(pk.grouped_matmul, implementation=impl)
    with pytest.raises(ValueError, match=r"x must have shape \[M, K\]"):
        run(x[None], w, group_sizes)
    with pytest.raises(ValueError, match=r"w must have shape \[E, K, N\]"):
        run(x, w[0], group_sizes)
    with pytest.raises(ValueError, match=r"w must have shape \[E, K, N\] with K=40"):
        run(x, w[:, :32], group_sizes)
    with pytest.raises(ValueError, match=r"group_sizes must have shape \[E\] = \(3,\)"):
        run(x, w, group_sizes[:2])
    with pytest.raises(ValueError, match=r"group_sizes must have shape \[E\]"):
        run(x, w, group_sizes[None])
    with pytest.raises(ValueError, match="group_sizes must be an integer array"):
        run(x, w, group_sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match="x must be a floating-point array"):
        run(x.astype(jnp.int32), w, group_sizes)
    with pytest.raises(ValueError, match="w must have x's dtype"):
        run(x, w.astype(jnp.bfloat16), group_sizes)
    with pytest.raises(ValueError, match="group_sizes must be non-negative"):
        run(x, w, jnp.array([-1, 5, 4]))
    with pytest.raises(ValueError, match=r"sum\(group_sizes\)=21 exceeds the M=20 rows"):
        run(x, w, jnp.array([8, 9, 4]))


# --------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tokens, top_k, K, N, E",
    [(8192, 10, 4096, 1536, 72), (256, 10, 768, 4096, 72), (256, 6, 2688, 1856, 128)],
)
@pytest.mark.parametrize("impl", IMPLS)
def test_real_size(impl, tokens, top_k, K, N, E):
    rng = np.random.default_rng(14)
    M = tokens * top_k
    sizes = rng.multinomial(M - 100, rng.dirichlet(np.ones(E) * 2.0))
    x = normal(rng, (M, K), jnp.bfloat16)
    w = normal(rng, (E, K, N), jnp.bfloat16, scale=K**-0.5)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    y = as_f32(op_for(impl, x, w, group_sizes, tiles=None)(x, w, group_sizes))
    np.testing.assert_array_equal(y[M - 100 :], 0.0)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    rows = np.unique(np.concatenate([offsets[:-1], offsets[1:] - 1, rng.choice(M - 100, 64)]))
    rows = rows[(rows >= 0) & (rows < M - 100)]
    experts = np.searchsorted(offsets, rows, side="right") - 1
    x32, w32 = as_f32(x[rows]), as_f32(w)  # once: converting w per row took minutes
    ref = np.stack([x32[i] @ w32[e] for i, e in enumerate(experts)])
    assert_close(y[rows], ref, rtol=2e-2, name="y")


@pytest.mark.parametrize(
    "M, K, N, E",
    [
        (81920, 4096, 1536, 72),
        (49152, 1856, 2688, 128),
        (2560, 768, 4096, 72),
        (1536, 2688, 1856, 128),  # decode: 64-row tiles with the 16-row narrow path
        (37, 40, 24, 4),
    ],
)
def test_internal_triton_kernels_lower_for_cuda(M, K, N, E):
    """Forward and backward kernels lower for CUDA with the heuristic's tiles (interpret
    mode does not enforce Triton's rules)."""
    config = gm_config.default_block_sizes(M, K, N, E, jnp.bfloat16)

    def fn(x, w, group_sizes, dy):
        y, vjp = jax.vjp(
            lambda x, w: gm_triton.grouped_matmul(x, w, group_sizes, config=config), x, w
        )
        return y, vjp(dy)

    text = lower_for_cuda(fn, spec((M, K)), spec((E, K, N)), spec((E,), jnp.int32), spec((M, N)))
    for name in ("grouped_matmul_bm", "grouped_matmul_dx_bm", "grouped_matmul_dw_bm"):
        assert name in text


# --------------------------------------------------------------------------- Mosaic GPU


def test_internal_mosaic_plan_worked_example():
    """The Mosaic module docstring's example: items start at multiples of 8, hold one
    expert's stored rows (leading rows of the previous expert are computed, not stored)
    and the rows past sum(group_sizes) form zero-storing items (group -1)."""
    p = gm_mosaic.plan(jnp.array([20, 0, 5], jnp.int32), num_rows=32, block_m=16)
    n = int(p.num_items[0])
    assert n == 4 and p.max_items == gm_mosaic.max_items(32, 3, 16)
    np.testing.assert_array_equal(p.row0[:n], [0, 16, 16, 24])
    np.testing.assert_array_equal(p.first[:n], [0, 0, 4, 1])
    np.testing.assert_array_equal(p.live[:n], [16, 4, 5, 7])
    np.testing.assert_array_equal(p.group[:n], [0, 0, 2, -1])
    np.testing.assert_array_equal(p.live[n:], 0)


@pytest.mark.parametrize("seed", range(4))
def test_internal_mosaic_plan_stores_every_row_once(seed):
    """Random group sizes: the items' stored rows cover [0, M) exactly once, each inside
    its expert's rows (or the tail for group -1), reads starting at multiples of 8."""
    rng = np.random.default_rng(seed)
    E, block_m = int(rng.integers(1, 9)), 64
    M = 8 * int(rng.integers(1, 40))
    sizes = rng.multinomial(int(rng.integers(0, M + 1)), np.ones(E) / E)
    p = gm_mosaic.plan(jnp.asarray(sizes, jnp.int32), num_rows=M, block_m=block_m)
    bounds = np.concatenate([[0], np.cumsum(sizes), [M]])
    stored = np.zeros(M, int)
    items = (np.asarray(a) for a in (p.row0, p.group, p.first, p.live))
    for row0, group, first, live in zip(*items, strict=True):
        if live:
            lo, hi = row0 + first, row0 + first + live
            seg = E if group < 0 else group
            assert row0 % 8 == 0 and first < 8 and hi - row0 <= block_m
            assert bounds[seg] <= lo and hi <= bounds[seg + 1]
            stored[lo:hi] += 1
    np.testing.assert_array_equal(stored, 1)


@pytest.mark.parametrize(
    ("M", "K", "N", "E", "dtype", "reason"),
    [
        (1024, 128, 128, 4, jnp.float32, "bf16 or fp16"),
        (1024, 96, 128, 4, jnp.bfloat16, "K=96"),
        (1024, 128, 96, 4, jnp.bfloat16, "N=96"),
        (1028, 128, 128, 4, jnp.bfloat16, "M=1028"),
        (256, 128, 128, 4, jnp.bfloat16, "weight-streaming"),
        (1024, 128, 128, 4, jnp.bfloat16, None),
    ],
)
def test_internal_mosaic_supports(M, K, N, E, dtype, reason):
    """What the Mosaic kernel leaves to Triton, said in the reason (static facts only)."""
    got = gm_mosaic.supports(spec((M, K), dtype), spec((E, K, N), dtype), spec((E,), jnp.int32))
    assert got is None if reason is None else reason in got


@pytest.mark.parametrize(("M", "K", "N", "E"), [(81920, 4096, 1536, 72), (49152, 1856, 2688, 128)])
def test_internal_mosaic_kernel_lowers_for_cuda(M, K, N, E):
    """The Mosaic kernel lowers for CUDA with the heuristic's tiles (its backward is the
    Triton kernels', lowered above)."""
    config = gm_mosaic.default_block_sizes(M, K, N, E, jnp.bfloat16)

    def fn(x, w, group_sizes):
        return gm_mosaic.grouped_matmul(x, w, group_sizes, config=config)

    lower_for_cuda(fn, spec((M, K)), spec((E, K, N)), spec((E,), jnp.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not supports_mosaic(), reason="needs a Hopper GPU")
@pytest.mark.parametrize("sizes", [(600, 0, 424, 0), (0, 1024, 0, 0), (300, 200, 0, 100)])
def test_mosaic_compute_bound_calls(sizes):
    """Compute-bound calls (>= 128 rows per expert) run the Mosaic kernel: empty experts,
    one expert holding every row, zero tail rows (NaN in x there), and its gradients
    (through the Triton backward kernels) against float64."""
    rng = np.random.default_rng(sum(sizes))
    c = Case("mosaic", 1024, sizes, K=256, N=192)
    x, w, group_sizes = make_inputs(rng, c, jnp.bfloat16)
    assert pk.backend_for(pk.grouped_matmul, x, w, group_sizes) == "mosaic"
    check_output(x, w, group_sizes, pk.grouped_matmul(x, w, group_sizes))
    x = jnp.nan_to_num(x)
    dy = normal(rng, (c.num_rows, c.N), jnp.bfloat16)
    _, vjp = jax.vjp(lambda x, w: pk.grouped_matmul(x, w, group_sizes), x, w)
    dx, dw = vjp(dy)
    dx_ref, dw_ref = oracle_grads(x, w, sizes, dy)
    assert_close(as_f32(dx), dx_ref, rtol=2e-2, name="dx")
    assert_close(as_f32(dw), dw_ref, rtol=2e-2, name="dw")
