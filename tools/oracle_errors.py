"""Error of every implementation against the float64 oracles, on the benchmark cases.

``PYTHONPATH=. python tools/oracle_errors.py [--scale 8] [--heads 16] [--out errors.json]``

For each SSD prefill problem of ``benchmarks/ssd.py``, each conv1d problem of
``benchmarks/conv1d.py``, the decode updates and the gated norms: the relative error
``||out - oracle||_F / ||oracle||_F`` of every runnable implementation (``triton`` runs in
interpret mode off the GPU) against the token-by-token float64 oracles of
``pallas_kernels.testing``, for the outputs and the states or caches written. The inputs are
drawn as the benchmarks draw them (bf16). Off the GPU the cases shrink: sequence lengths and
row counts are divided by ``--scale`` (at least 1 token) and SSD problems keep ``--heads``
heads; head dim, state dim, groups, chunk size, conv dim and width stay as benchmarked.
``--scale 1 --heads 128`` gives the benchmarks' own sizes (the oracle then takes minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import conv1d as conv_bench
from benchmarks import harness
from benchmarks import ssd as ssd_bench
from pallas_kernels import (
    causal_conv1d,
    causal_conv1d_update,
    chunk_metadata,
    gated_rms_norm,
    max_chunks_for,
    selective_state_update,
    ssd_scan,
)
from pallas_kernels import testing as oracles
from pallas_kernels.conv1d import api as conv_api
from pallas_kernels.norm import api as norm_api
from pallas_kernels.ssd import api as ssd_api
from pallas_kernels.state_update import api as state_update_api


def _normal(rng, shape, dtype=jnp.bfloat16, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape, np.float32) * scale, dtype)


def _shrink(lengths, scale: int) -> tuple[int, ...]:
    return tuple(max(1, n // scale) for n in lengths)


def ssd_errors(p: ssd_bench.PrefillProblem) -> list[dict]:
    rng = np.random.default_rng(1)
    T, H, P, N, G = sum(p.lengths), p.heads, p.head_dim, p.state_dim, p.groups
    x, dt = _normal(rng, (T, H, P)), _normal(rng, (T, H), scale=0.5)
    B, C = _normal(rng, (T, G, N)), _normal(rng, (T, G, N))
    A = -jnp.asarray(np.exp(rng.uniform(-1, 1, H)), jnp.float32)
    D, dt_bias = jnp.ones((H,), jnp.float32), jnp.zeros((H,), jnp.float32) - 2.0
    qsl = np.concatenate([[0], np.cumsum(p.lengths)]).astype(np.int32)
    md = chunk_metadata(
        jnp.asarray(qsl),
        jnp.zeros(len(p.lengths), jnp.int32),
        chunk_size=p.chunk_size,
        max_chunks=max_chunks_for(T, len(p.lengths), p.chunk_size),
    )
    options = dict(D=D, dt_bias=dt_bias, dt_softplus=True)
    y_ref, states_ref = oracles.ssd_oracle(x, dt, A, B, C, query_start_loc=qsl, **options)
    rows = []
    for impl in harness.runnable(ssd_api.IMPLEMENTATIONS):
        y, states = ssd_scan(
            x, dt, A, B, C, metadata=md, chunk_size=p.chunk_size, implementation=impl, **options
        )
        rows.append(
            dict(
                op="ssd_scan",
                problem=p.name,
                implementation=impl,
                tokens=T,
                heads=H,
                y=oracles.relative_error(y, y_ref),
                states=oracles.relative_error(states, states_ref),
            )
        )
    return rows


def state_update_errors(p: ssd_bench.DecodeProblem) -> list[dict]:
    rng = np.random.default_rng(2)
    H, P, N, G, R = p.heads, p.head_dim, p.state_dim, p.groups, p.rows
    x, dt = _normal(rng, (R, H, P)), _normal(rng, (R, H))
    B, C = _normal(rng, (R, G, N)), _normal(rng, (R, G, N))
    A = -jnp.asarray(np.exp(rng.uniform(-1, 1, H)), jnp.float32)
    D, dt_bias = jnp.ones((H,), jnp.float32), jnp.zeros((H,), jnp.float32)
    slots = jnp.asarray(rng.permutation(2 * R)[:R], jnp.int32)
    cache = _normal(rng, (2 * R, H, P, N), jnp.float32)
    options = dict(slot_ids=slots, D=D, dt_bias=dt_bias, dt_softplus=True)
    y_ref, cache_ref = oracles.selective_state_update_oracle(cache, x, dt, A, B, C, **options)
    rows = []
    for impl in harness.runnable(state_update_api.IMPLEMENTATIONS):
        y, new_cache = selective_state_update(
            jnp.copy(cache), x, dt, A, B, C, implementation=impl, **options
        )
        rows.append(
            dict(
                op="selective_state_update",
                problem=p.name,
                implementation=impl,
                rows=R,
                heads=H,
                y=oracles.relative_error(y, y_ref),
                states=oracles.relative_error(new_cache, cache_ref),
            )
        )
    return rows


def conv_errors(p: conv_bench.ConvProblem) -> list[dict]:
    rng = np.random.default_rng(1)
    T, B = sum(p.lengths), len(p.lengths)
    x, w, bias = _normal(rng, (T, p.dim)), _normal(rng, (p.dim, p.width)), _normal(rng, (p.dim,))
    cache = _normal(rng, (2 * B, p.width - 1, p.dim))
    qsl = np.concatenate([[0], np.cumsum(p.lengths)]).astype(np.int32)
    slots = jnp.asarray(rng.permutation(2 * B)[:B], jnp.int32)
    has_state = jnp.asarray(rng.random(B) < 0.5)
    options = dict(slot_ids=slots, has_initial_state=has_state, activation="silu")
    y_ref, cache_ref = oracles.causal_conv1d_oracle(
        x, w, bias, query_start_loc=qsl, conv_state_cache=cache, **options
    )
    rows = []
    for impl in harness.runnable(conv_api.PREFILL_IMPLEMENTATIONS):
        y, new_cache = causal_conv1d(
            x,
            w,
            bias,
            query_start_loc=jnp.asarray(qsl),
            conv_state_cache=jnp.copy(cache),
            implementation=impl,
            **options,
        )
        rows.append(
            dict(
                op="causal_conv1d",
                problem=p.name,
                implementation=impl,
                tokens=T,
                dim=p.dim,
                y=oracles.relative_error(y, y_ref),
                states=oracles.relative_error(new_cache, cache_ref),
            )
        )
    return rows


def conv_update_errors(p: conv_bench.UpdateProblem) -> list[dict]:
    rng = np.random.default_rng(2)
    x, w = _normal(rng, (p.rows, p.dim)), _normal(rng, (p.dim, p.width))
    bias = _normal(rng, (p.dim,))
    cache = _normal(rng, (2 * p.rows, p.width - 1, p.dim))
    slots = jnp.asarray(rng.permutation(2 * p.rows)[: p.rows], jnp.int32)
    y_ref, cache_ref = oracles.causal_conv1d_update_oracle(
        x, cache, w, bias, slot_ids=slots, activation="silu"
    )
    rows = []
    for impl in harness.runnable(conv_api.UPDATE_IMPLEMENTATIONS):
        y, new_cache = causal_conv1d_update(
            x, jnp.copy(cache), w, bias, slot_ids=slots, activation="silu", implementation=impl
        )
        rows.append(
            dict(
                op="causal_conv1d_update",
                problem=p.name,
                implementation=impl,
                rows=p.rows,
                dim=p.dim,
                y=oracles.relative_error(y, y_ref),
                states=oracles.relative_error(new_cache, cache_ref),
            )
        )
    return rows


def norm_errors(p: conv_bench.NormProblem) -> list[dict]:
    rng = np.random.default_rng(3)
    x, z = _normal(rng, (p.rows, p.dim)), _normal(rng, (p.rows, p.dim))
    w = _normal(rng, (p.dim,))
    want = oracles.gated_rms_norm_oracle(x, z, w, group_size=p.group_size)
    return [
        dict(
            op="gated_rms_norm",
            problem=p.name,
            implementation=impl,
            rows=p.rows,
            y=oracles.relative_error(
                gated_rms_norm(x, z, w, group_size=p.group_size, implementation=impl), want
            ),
        )
        for impl in harness.runnable(norm_api.IMPLEMENTATIONS)
    ]


def _print(row: dict) -> None:
    size = row.get("tokens", row.get("rows"))
    state = f"{row['states']:.2e}" if "states" in row else ""
    print(
        f"{row['op']:<24}{row['problem']:<20}{row['implementation']:<8}{size:>8}"
        f"{row['y']:>11.2e}{state:>11}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=int, default=8, help="divide lengths and rows by this")
    parser.add_argument("--heads", type=int, default=16, help="SSD heads")
    parser.add_argument("--ops", default="ssd,state_update,conv,conv_update,norm")
    parser.add_argument("--out", default=None, help="write the JSON here")
    args = parser.parse_args()
    ops = set(args.ops.split(","))
    shrink = lambda p, **kw: dataclasses.replace(p, **kw)  # noqa: E731
    rows_of = lambda n: max(1, n // args.scale)  # noqa: E731
    conv, update, norm = conv_bench.problems(False)
    cases = []
    if "ssd" in ops:
        cases += [
            (ssd_errors, shrink(p, lengths=_shrink(p.lengths, args.scale), heads=args.heads))
            for p in ssd_bench.prefill_problems(False)
        ]
    if "state_update" in ops:
        cases += [
            (state_update_errors, shrink(p, rows=rows_of(p.rows), heads=args.heads))
            for p in ssd_bench.decode_problems(False)
        ]
    if "conv" in ops:
        cases += [(conv_errors, shrink(p, lengths=_shrink(p.lengths, args.scale))) for p in conv]
    if "conv_update" in ops:
        cases += [(conv_update_errors, shrink(p, rows=rows_of(p.rows))) for p in update]
    if "norm" in ops:
        cases += [(norm_errors, shrink(p, rows=rows_of(p.rows))) for p in norm]

    device = jax.devices()[0].device_kind
    print(f"## relative error against the float64 oracles ({device}, scale 1/{args.scale})")
    print(f"{'op':<24}{'problem':<20}{'impl':<8}{'size':>8}{'output':>11}{'state':>11}")
    rows: list[dict] = []
    for errors, problem in cases:
        for row in errors(problem):
            _print(row)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=device, scale=args.scale, heads=args.heads, rows=rows), f)


if __name__ == "__main__":
    main()
