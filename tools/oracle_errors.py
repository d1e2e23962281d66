"""Error of every implementation against the float64 oracles, on the benchmark cases.

``PYTHONPATH=. python tools/oracle_errors.py [--scale 8] [--heads 16] [--out errors.json]``

For each SSD prefill problem of ``benchmarks/ssd.py``, each conv1d problem of
``benchmarks/conv1d.py``, the decode updates and the gated norms: the relative error
``||out - oracle||_F / ||oracle||_F`` of every runnable implementation (``triton`` runs in
interpret mode off the GPU) against the token-by-token float64 oracles of
``pallas_kernels.testing``, for the outputs and the states or caches written. The inputs are
the benchmarks' own (``prefill_inputs``, ``conv_inputs``, ...; bf16, fixed seeds). Off the
GPU the cases shrink: sequence lengths and row counts are divided by ``--scale`` (at least
1 token) and SSD problems keep ``--heads`` heads; head dim, state dim, groups, chunk size,
conv dim and width stay as benchmarked.
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
    gated_rms_norm,
    selective_state_update,
    ssd_scan,
)
from pallas_kernels import testing as oracles
from pallas_kernels.conv1d import api as conv_api
from pallas_kernels.norm import api as norm_api
from pallas_kernels.ssd import api as ssd_api
from pallas_kernels.state_update import api as state_update_api


def _shrink(lengths, scale: int) -> tuple[int, ...]:
    return tuple(max(1, n // scale) for n in lengths)


def _row(op, problem, impl, outputs, references, **sizes) -> dict:
    """One table row: the relative error of the output (and of the state or cache written,
    when there is one) against the oracle's."""
    names = ("y", "states")[: len(outputs)]
    errors = {
        name: oracles.relative_error(got, want)
        for name, got, want in zip(names, outputs, references, strict=True)
    }
    return dict(op=op, problem=problem.name, implementation=impl, **sizes, **errors)


def ssd_errors(p: ssd_bench.PrefillProblem) -> list[dict]:
    inputs = ssd_bench.prefill_inputs(p)
    arrays = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
    options = dict(D=inputs["D"], dt_bias=inputs["dt_bias"], dt_softplus=True)
    qsl = np.asarray(inputs["query_start_loc"])
    want = oracles.ssd_oracle(*arrays, query_start_loc=qsl, **options)
    sizes = dict(tokens=int(qsl[-1]), heads=p.heads)
    return [
        _row(
            "ssd_scan",
            p,
            impl,
            ssd_scan(
                *arrays,
                metadata=inputs["metadata"],
                chunk_size=p.chunk_size,
                implementation=impl,
                **options,
            ),
            want,
            **sizes,
        )
        for impl in harness.runnable(ssd_api.SSD_SCAN)
    ]


def state_update_errors(p: ssd_bench.DecodeProblem) -> list[dict]:
    inputs, make_cache = ssd_bench.decode_inputs(p)
    arrays = [inputs[k] for k in ("x", "dt", "A", "B", "C")]
    options = dict(
        slot_ids=inputs["slot_ids"], D=inputs["D"], dt_bias=inputs["dt_bias"], dt_softplus=True
    )
    cache = make_cache()
    want = oracles.selective_state_update_oracle(cache, *arrays, **options)
    return [
        _row(
            "selective_state_update",
            p,
            impl,
            selective_state_update(jnp.copy(cache), *arrays, implementation=impl, **options),
            want,
            rows=p.rows,
            heads=p.heads,
        )
        for impl in harness.runnable(state_update_api.SELECTIVE_STATE_UPDATE)
    ]


def conv_errors(p: conv_bench.ConvProblem) -> list[dict]:
    inputs = conv_bench.conv_inputs(p)
    x, w, bias, cache = (inputs[k] for k in ("x", "weight", "bias", "conv_state_cache"))
    qsl = np.asarray(inputs["query_start_loc"])
    options = dict(
        slot_ids=inputs["slot_ids"],
        has_initial_state=inputs["has_initial_state"],
        activation="silu",
    )
    want = oracles.causal_conv1d_oracle(
        x, w, bias, query_start_loc=qsl, conv_state_cache=cache, **options
    )
    return [
        _row(
            "causal_conv1d",
            p,
            impl,
            causal_conv1d(
                x,
                w,
                bias,
                query_start_loc=inputs["query_start_loc"],
                conv_state_cache=jnp.copy(cache),
                implementation=impl,
                **options,
            ),
            want,
            tokens=int(qsl[-1]),
            dim=p.dim,
        )
        for impl in harness.runnable(conv_api.CAUSAL_CONV1D)
    ]


def conv_update_errors(p: conv_bench.UpdateProblem) -> list[dict]:
    inputs, make_cache = conv_bench.update_inputs(p)
    x, w, bias, slots = (inputs[k] for k in ("x", "weight", "bias", "slot_ids"))
    cache = make_cache()
    options = dict(slot_ids=slots, activation="silu")
    want = oracles.causal_conv1d_update_oracle(x, cache, w, bias, **options)
    return [
        _row(
            "causal_conv1d_update",
            p,
            impl,
            causal_conv1d_update(x, jnp.copy(cache), w, bias, implementation=impl, **options),
            want,
            rows=p.rows,
            dim=p.dim,
        )
        for impl in harness.runnable(conv_api.CAUSAL_CONV1D_UPDATE)
    ]


def norm_errors(p: conv_bench.NormProblem) -> list[dict]:
    x, z, w = conv_bench.norm_inputs(p)
    want = oracles.gated_rms_norm_oracle(x, z, w, group_size=p.group_size)
    return [
        _row(
            "gated_rms_norm",
            p,
            impl,
            (gated_rms_norm(x, z, w, group_size=p.group_size, implementation=impl),),
            (want,),
            rows=p.rows,
        )
        for impl in harness.runnable(norm_api.GATED_RMS_NORM)
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
