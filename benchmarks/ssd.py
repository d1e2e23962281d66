"""SSD prefill (``ssd_scan``) and decode (``selective_state_update``) benchmarks.

``python -m benchmarks.ssd [--out FILE] [--results-dir DIR] [--quick]``. Problems
are Bamba-9B and Nemotron-H shaped (H=128, P=64, N=128); ``--quick`` shrinks them for a CPU
smoke run.
FLOPs and bytes are counted here from the chunk layout (useful work of real chunks only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from pallas_kernels import chunk_metadata, max_chunks_for, selective_state_update, ssd_scan
from pallas_kernels.ssd import api as ssd_api
from pallas_kernels.state_update import api as state_update_api


@dataclasses.dataclass(frozen=True)
class PrefillProblem:
    name: str
    lengths: tuple[int, ...]
    heads: int = 128
    head_dim: int = 64
    state_dim: int = 128
    groups: int = 1
    chunk_size: int = 256


@dataclasses.dataclass(frozen=True)
class DecodeProblem:
    name: str
    rows: int
    heads: int = 128
    head_dim: int = 64
    state_dim: int = 128
    groups: int = 1


def prefill_problems(quick: bool) -> list[PrefillProblem]:
    rng = np.random.default_rng(0)
    if quick:
        small = dict(heads=4, head_dim=8, state_dim=8, chunk_size=16)
        return [
            PrefillProblem("tiny-uniform", (64, 64), **small),
            PrefillProblem("tiny-ragged", (5, 70, 33), **small),
        ]
    ragged = tuple(int(n) for n in rng.integers(64, 8193, size=8))
    short = tuple(int(n) for n in rng.integers(1, 701, size=64))
    return [
        PrefillProblem("bamba-uniform", (4096,) * 8),
        PrefillProblem("bamba-ragged", ragged),
        PrefillProblem("bamba-short", short),
        PrefillProblem("nemotronh-ragged", ragged, groups=8, chunk_size=128),
    ]


def decode_problems(quick: bool) -> list[DecodeProblem]:
    if quick:
        return [DecodeProblem("tiny-decode-4", 4, heads=4, head_dim=8, state_dim=8)]
    return [DecodeProblem(f"decode-{rows}", rows) for rows in (1, 64, 256)]


def prefill_cost(p: PrefillProblem, cu_chunk_seqlens: np.ndarray) -> tuple[float, float]:
    """(FLOPs, bytes): per chunk of length l, C·Bᵀ and the masked block product (2 l² (GN +
    HP)), chunk state and carried-state output (4 l H P N); bytes read once, written once."""
    lens = np.diff(cu_chunk_seqlens).astype(np.float64)
    H, P, N, G = p.heads, p.head_dim, p.state_dim, p.groups
    flops = np.sum(2 * lens**2 * (G * N + H * P) + 4 * lens * H * P * N)
    T = float(sum(p.lengths))
    bf16, f32 = 2, 4
    bytes_moved = (
        T * (2 * H * P + 2 * G * N + H) * bf16  # x, y, B, C, dt
        + len(p.lengths) * H * P * N * f32
    )  # final states
    return float(flops), float(bytes_moved)


def prefill_inputs(p: PrefillProblem) -> dict:
    """The arrays problem ``p`` runs on (bf16 activations, fixed seed): ``x, dt, A, B, C``,
    ``D``, ``dt_bias``, ``query_start_loc`` and the chunk ``metadata``."""
    rng = np.random.default_rng(1)
    T, H, P, N, G = sum(p.lengths), p.heads, p.head_dim, p.state_dim, p.groups

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale, jnp.bfloat16)

    x, dt = normal(T, H, P), normal(T, H, scale=0.5)
    B, C = normal(T, G, N), normal(T, G, N)
    A = -jnp.asarray(np.exp(rng.uniform(-1, 1, H)), jnp.float32)
    D, dt_bias = jnp.ones((H,), jnp.float32), jnp.zeros((H,), jnp.float32) - 2.0
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(p.lengths)]), jnp.int32)
    md = chunk_metadata(
        qsl,
        jnp.zeros(len(p.lengths), jnp.int32),
        chunk_size=p.chunk_size,
        max_chunks=max_chunks_for(T, len(p.lengths), p.chunk_size),
    )
    return dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, query_start_loc=qsl, metadata=md)


def bench_prefill(p: PrefillProblem, ceilings: harness.Ceilings) -> list[dict]:
    T = sum(p.lengths)
    inputs = prefill_inputs(p)
    x, dt, A, B, C = (inputs[k] for k in ("x", "dt", "A", "B", "C"))
    D, dt_bias, md = inputs["D"], inputs["dt_bias"], inputs["metadata"]
    n = int(md.num_chunks)
    flops, bytes_moved = prefill_cost(p, np.asarray(md.cu_chunk_seqlens)[: n + 1])
    rows = []
    for impl in harness.runnable(ssd_api.SSD_SCAN):
        fn = jax.jit(
            lambda x, dt, B, C, md, impl=impl: ssd_scan(
                x,
                dt,
                A,
                B,
                C,
                metadata=md,
                chunk_size=p.chunk_size,
                D=D,
                dt_bias=dt_bias,
                dt_softplus=True,
                implementation=impl,
            )
        )
        timing = harness.time_fn(lambda fn=fn: fn(x, dt, B, C, md))
        rows.append(
            harness.row(
                p.name,
                impl,
                timing,
                flops=flops,
                bytes_moved=bytes_moved,
                ceilings=ceilings,
                op="ssd_scan",
                tokens=T,
                sequences=len(p.lengths),
                chunks=n,
            )
        )
    return rows


def decode_inputs(p: DecodeProblem) -> tuple[dict, Callable[[], jax.Array]]:
    """The arrays problem ``p`` runs on (fixed seed): ``x, dt, A, B, C``, ``slot_ids``, ``D``,
    ``dt_bias``; and a function that draws a fresh fp32 state cache ``[2 R, H, P, N]``."""
    rng = np.random.default_rng(2)
    H, P, N, G, R = p.heads, p.head_dim, p.state_dim, p.groups, p.rows

    def normal(*shape, dtype=jnp.bfloat16):
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    x, dt, B, C = normal(R, H, P), normal(R, H), normal(R, G, N), normal(R, G, N)
    A = -jnp.asarray(np.exp(rng.uniform(-1, 1, H)), jnp.float32)
    D, dt_bias = jnp.ones((H,), jnp.float32), jnp.zeros((H,), jnp.float32)
    slots = jnp.asarray(rng.permutation(2 * R)[:R], jnp.int32)
    inputs = dict(x=x, dt=dt, A=A, B=B, C=C, slot_ids=slots, D=D, dt_bias=dt_bias)
    return inputs, lambda: normal(2 * R, H, P, N, dtype=jnp.float32)


def bench_decode(p: DecodeProblem, ceilings: harness.Ceilings) -> list[dict]:
    H, P, N, G, R = p.heads, p.head_dim, p.state_dim, p.groups, p.rows
    inputs, make_cache = decode_inputs(p)
    x, dt, A, B, C = (inputs[k] for k in ("x", "dt", "A", "B", "C"))
    slots, D, dt_bias = inputs["slot_ids"], inputs["D"], inputs["dt_bias"]
    state_bytes = 2 * R * H * P * N * 4  # read + write each named fp32 state
    bytes_moved = state_bytes + R * (2 * H * P + 2 * G * N + H) * 2
    flops = 6 * R * H * P * N
    rows = []
    for impl in harness.runnable(state_update_api.SELECTIVE_STATE_UPDATE):
        timing = harness.time_cache_update(
            lambda cache, impl=impl: selective_state_update(
                cache,
                x,
                dt,
                A,
                B,
                C,
                slot_ids=slots,
                D=D,
                dt_bias=dt_bias,
                dt_softplus=True,
                implementation=impl,
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
                op="selective_state_update",
                rows=R,
            )
        )
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = harness.parse_args(argv, "SSD prefill and decode benchmarks", module="ssd")
    ceilings = harness.measure_ceilings(quick=args.quick)
    rows = []
    for p in prefill_problems(args.quick):
        if harness.selected(p.name, args.only):
            rows += bench_prefill(p, ceilings)
    for p in decode_problems(args.quick):
        if harness.selected(p.name, args.only):
            rows += bench_decode(p, ceilings)
    harness.add_speedups(rows)
    harness.report("ssd_scan / selective_state_update", rows, ceilings, args.output)
    return rows


if __name__ == "__main__":
    main()
