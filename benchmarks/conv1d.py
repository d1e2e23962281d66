"""Causal conv1d (prefill and decode) and gated RMSNorm benchmarks (memory-bound ops).

``python -m benchmarks.conv1d [--out FILE] [--results-dir DIR] [--quick]``. Bamba-9B shapes
(conv dim 8448 = d_inner 8192 + 2·N 128, width 4; norm over d_inner 8192); ``--quick`` shrinks them
for a CPU smoke run. Each row reports achieved bytes/s against the copy bandwidth measured
in the same run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from pallas_kernels import causal_conv1d, causal_conv1d_update, gated_rms_norm
from pallas_kernels.conv1d import api as conv_api
from pallas_kernels.norm import api as norm_api

BF16 = 2


@dataclasses.dataclass(frozen=True)
class ConvProblem:
    name: str
    lengths: tuple[int, ...]
    dim: int = 8448
    width: int = 4


@dataclasses.dataclass(frozen=True)
class UpdateProblem:
    name: str
    rows: int
    dim: int = 8448
    width: int = 4


@dataclasses.dataclass(frozen=True)
class NormProblem:
    name: str
    rows: int
    dim: int = 8192
    group_size: int = 8192


def problems(quick: bool):
    rng = np.random.default_rng(0)
    if quick:
        return (
            [ConvProblem("tiny-conv", (40, 1, 23), dim=64)],
            [UpdateProblem("tiny-update-4", 4, dim=64)],
            [NormProblem("tiny-norm", 64, dim=256, group_size=128)],
        )
    short = tuple(int(n) for n in rng.integers(1, 701, size=64))
    return (
        [ConvProblem("bamba-conv", (4096,) * 8), ConvProblem("bamba-conv-short", short)],
        [UpdateProblem(f"conv-update-{rows}", rows) for rows in (1, 64, 256)],
        [
            NormProblem("gated-norm-32k", 32768),
            NormProblem("gated-norm-32k-g8", 32768, group_size=1024),
        ],
    )


def _normal(rng, shape, dtype=jnp.bfloat16):
    return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)


def conv_inputs(p: ConvProblem) -> dict:
    """The arrays problem ``p`` runs on (bf16, fixed seed), as ``causal_conv1d`` takes them:
    ``x, weight, bias`` and ``query_start_loc``, ``conv_state_cache`` (2 B slots),
    ``slot_ids``, ``has_initial_state``."""
    rng = np.random.default_rng(1)
    T, B = sum(p.lengths), len(p.lengths)
    x, w, bias = _normal(rng, (T, p.dim)), _normal(rng, (p.dim, p.width)), _normal(rng, (p.dim,))
    cache = _normal(rng, (2 * B, p.width - 1, p.dim))
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(p.lengths)]), jnp.int32)
    slots = jnp.asarray(rng.permutation(2 * B)[:B], jnp.int32)
    has_state = jnp.asarray(rng.random(B) < 0.5)
    return dict(
        x=x,
        weight=w,
        bias=bias,
        query_start_loc=qsl,
        conv_state_cache=cache,
        slot_ids=slots,
        has_initial_state=has_state,
    )


def bench_conv(p: ConvProblem, ceilings: harness.Ceilings) -> list[dict]:
    T, B = sum(p.lengths), len(p.lengths)
    inputs = conv_inputs(p)
    x, w, bias, cache = (inputs[k] for k in ("x", "weight", "bias", "conv_state_cache"))
    qsl, slots = inputs["query_start_loc"], inputs["slot_ids"]
    has_state = inputs["has_initial_state"]
    state_bytes = 2 * B * (p.width - 1) * p.dim * BF16
    bytes_moved = 2 * T * p.dim * BF16 + state_bytes
    flops = 2 * T * p.dim * p.width
    rows = []
    for impl in harness.runnable(conv_api.CAUSAL_CONV1D):
        fn = jax.jit(
            lambda x, cache, impl=impl: causal_conv1d(
                x,
                w,
                bias,
                query_start_loc=qsl,
                conv_state_cache=cache,
                slot_ids=slots,
                has_initial_state=has_state,
                implementation=impl,
            )
        )
        timing = harness.time_fn(lambda fn=fn: fn(x, cache))
        rows.append(
            harness.row(
                p.name,
                impl,
                timing,
                flops=flops,
                bytes_moved=bytes_moved,
                ceilings=ceilings,
                op="causal_conv1d",
                tokens=T,
                sequences=B,
            )
        )
    return rows


def update_inputs(p: UpdateProblem) -> tuple[dict, Callable[[], jax.Array]]:
    """The arrays problem ``p`` runs on (bf16, fixed seed): ``x, weight, bias, slot_ids``;
    and a function that draws a fresh conv state cache ``[2 R, K - 1, dim]``."""
    rng = np.random.default_rng(2)
    R = p.rows
    x, w, bias = _normal(rng, (R, p.dim)), _normal(rng, (p.dim, p.width)), _normal(rng, (p.dim,))
    slots = jnp.asarray(rng.permutation(2 * R)[:R], jnp.int32)
    inputs = dict(x=x, weight=w, bias=bias, slot_ids=slots)
    return inputs, lambda: _normal(rng, (2 * R, p.width - 1, p.dim))


def bench_update(p: UpdateProblem, ceilings: harness.Ceilings) -> list[dict]:
    R = p.rows
    inputs, make_cache = update_inputs(p)
    x, w, bias, slots = (inputs[k] for k in ("x", "weight", "bias", "slot_ids"))
    bytes_moved = 2 * R * p.dim * BF16 + 2 * R * (p.width - 1) * p.dim * BF16
    flops = 2 * R * p.dim * p.width
    rows = []
    for impl in harness.runnable(conv_api.CAUSAL_CONV1D_UPDATE):
        timing = harness.time_cache_update(
            lambda cache, impl=impl: causal_conv1d_update(
                x, cache, w, bias, slot_ids=slots, implementation=impl
            ),
            make_cache,
        )
        rows.append(
            harness.row(
                p.name,
                impl,
                timing,
                flops=flops,
                bytes_moved=bytes_moved,
                ceilings=ceilings,
                op="causal_conv1d_update",
                rows=R,
            )
        )
    return rows


def norm_inputs(p: NormProblem) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(x, z, weight)`` of problem ``p`` (bf16, fixed seed)."""
    rng = np.random.default_rng(3)
    return _normal(rng, (p.rows, p.dim)), _normal(rng, (p.rows, p.dim)), _normal(rng, (p.dim,))


def bench_norm(p: NormProblem, ceilings: harness.Ceilings) -> list[dict]:
    x, z, w = norm_inputs(p)
    bytes_moved = 3 * p.rows * p.dim * BF16
    flops = 8 * p.rows * p.dim
    rows = []
    for impl in harness.runnable(norm_api.GATED_RMS_NORM):
        fn = jax.jit(
            lambda x, z, impl=impl: gated_rms_norm(
                x, z, w, group_size=p.group_size, implementation=impl
            )
        )
        timing = harness.time_fn(lambda fn=fn: fn(x, z))
        rows.append(
            harness.row(
                p.name,
                impl,
                timing,
                flops=flops,
                bytes_moved=bytes_moved,
                ceilings=ceilings,
                op="gated_rms_norm",
                rows=p.rows,
                group_size=p.group_size,
            )
        )
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = harness.parse_args(argv, "conv1d and gated norm benchmarks", module="conv1d")
    ceilings = harness.measure_ceilings(quick=args.quick)
    conv, update, norm = problems(args.quick)
    rows = []
    for p in conv:
        rows += bench_conv(p, ceilings)
    for p in update:
        rows += bench_update(p, ceilings)
    for p in norm:
        rows += bench_norm(p, ceilings)
    harness.add_speedups(rows)
    harness.report(
        "causal_conv1d / causal_conv1d_update / gated_rms_norm", rows, ceilings, args.output
    )
    return rows


if __name__ == "__main__":
    main()
