"""Forward + backward of the Triton SSD scan against the ``xla`` path, and the backward
kernels' own times, on mamba-ssm's training problem (GPU).

``PYTHONPATH=. python3 tools/profile_ssd_backward.py --out ssd_bwd.json`` (``--quick``: tiny
shapes, a CPU smoke run; ``--sweep``: then the backward launches with each tiling of
:data:`SWEEP`). One packed batch of 8 sequences of 4096 tokens, H 128, P 64, N 128, bf16
inputs, ``D[H]``, ``dt_bias`` with softplus (as ``flax_models/layers/mamba2.py`` calls the
scan), G 1 with chunks of 256 and G 8 with chunks of 128, without and then with the z gate.
For each: the median time of ``jax.vjp`` + applying it (jitted, warmed up, back-to-back
calls, see ``benchmarks.harness.time_fn``) for ``triton`` and ``xla``, the Triton forward
alone, each backward launch alone (``state_pass``, ``chunk_dx``, ``chunk_dbc``) and the
whole backward rule (launches + glue) from saved residuals, the relative error of every
Triton gradient against the ``xla`` path's gradient of the same inputs, and the speedup.
The JSON is rewritten after every row, so a run cut short keeps what finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.ssd import PrefillProblem, prefill_inputs
from pallas_kernels import ssd_scan
from pallas_kernels.ssd import triton as ssd_triton
from pallas_kernels.ssd import triton_backward as ssd_backward
from pallas_kernels.testing import relative_error

NAMES = ("dx", "ddt", "dA", "dB", "dC", "dD", "dz", "ddt_bias")
TARGET_G1_MS = 9.85  # mamba-ssm's forward + backward on this problem (shared/ANCHORS.md)
# Backward tilings tried on the G 1 problem besides the default (fields of
# ssd.triton_backward.BackwardBlockSizes): the neighbours of the default's tiles.
SWEEP = (
    dict(block_k=32),
    dict(block_k=128),
    dict(dbc_block_k=64),
    dict(dbc_block_k=256),
    dict(dbc_block_m=128),
    dict(dbc_num_stages=2),
    dict(dbc_num_stages=4),
    dict(num_stages=3),
    dict(max_heads_per_program=32),
)


def problems(quick: bool) -> list[PrefillProblem]:
    if quick:
        small = dict(heads=4, head_dim=8, state_dim=16, chunk_size=16)
        return [
            PrefillProblem("tiny-g1", (40, 24), **small),
            PrefillProblem("tiny-g2", (40, 24), groups=2, **small),
        ]
    uniform = (4096,) * 8
    return [
        PrefillProblem("g1-chunk256", uniform),
        PrefillProblem("g8-chunk128", uniform, groups=8, chunk_size=128),
    ]


class Results:
    """Rows written to ``path`` (JSON) after every addition."""

    def __init__(self, path: str | None):
        self.path = None if path is None else Path(path)
        self.rows: list[dict] = []
        self.meta = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(dict(meta=self.meta, rows=self.rows), indent=1))


def profile(p: PrefillProblem, gated: bool, results: Results, *, quick: bool) -> None:
    """The rows of one problem: forward + backward of both paths, the Triton forward and
    backward launches, the gradient errors and the speedup."""
    inputs = prefill_inputs(p)
    md = inputs["metadata"]
    x = inputs["x"]
    z = jax.random.normal(jax.random.key(2), x.shape, jnp.bfloat16) if gated else None
    primals = (x, inputs["dt"], inputs["A"], inputs["B"], inputs["C"], inputs["D"], z)
    primals = (*primals, inputs["dt_bias"])
    dy = jax.random.normal(jax.random.key(3), x.shape, jnp.bfloat16)
    live = [i for i, a in enumerate(primals) if a is not None]
    name = f"{p.name}{'-z' if gated else ''}"
    timing_kwargs = dict(warmup=2, samples=5, min_sample_ms=1.0) if quick else dict(samples=11)

    def scan(impl, *args):
        full = list(primals)
        for i, a in zip(live, args, strict=True):
            full[i] = a
        x, dt, A, B, C, D, z, dt_bias = full
        y, _ = ssd_scan(
            x,
            dt,
            A,
            B,
            C,
            metadata=md,
            chunk_size=p.chunk_size,
            D=D,
            z=z,
            dt_bias=dt_bias,
            dt_softplus=True,
            implementation=impl,
        )
        return y

    args = tuple(primals[i] for i in live)
    grads = {}
    for impl in ("triton", "xla"):
        fwd_bwd = jax.jit(
            lambda args, dy, impl=impl: jax.vjp(lambda *a: scan(impl, *a), *args)[1](dy)
        )
        start = time.perf_counter()
        grads[impl] = jax.block_until_ready(fwd_bwd(args, dy))
        compile_s = time.perf_counter() - start
        timing = harness.time_fn(lambda f=fwd_bwd: f(args, dy), **timing_kwargs)
        row = dict(problem=name, impl=impl, what="forward + backward", ms=timing.median_ms)
        row.update(min_ms=timing.min_ms, first_call_s=round(compile_s, 2))
        if impl == "triton" and p.name == "g1-chunk256":
            row["target_ms"] = TARGET_G1_MS
        results.add(row)
        if impl == "triton":
            forward = jax.jit(lambda args: scan("triton", *args))
            timing = harness.time_fn(lambda f=forward: f(args), **timing_kwargs)
            results.add(dict(problem=name, impl=impl, what="forward", ms=timing.median_ms))
            profile_backward(p, md, primals, dy, name, results, timing_kwargs)

    # Gradient errors: every Triton gradient against the xla path's of the same inputs.
    errors = {
        NAMES[i]: relative_error(np.asarray(g, np.float32), np.asarray(r, np.float32))
        for i, g, r in zip(live, grads["triton"], grads["xla"], strict=True)
    }
    results.add(dict(problem=name, what="gradient relative error triton vs xla", **errors))
    fwd_bwd = {
        r["impl"]: r["ms"]
        for r in results.rows
        if r.get("problem") == name and r.get("what") == "forward + backward"
    }
    speedup = fwd_bwd["xla"] / fwd_bwd["triton"]
    results.add(dict(problem=name, what="forward + backward speedup triton vs xla", x=speedup))


def profile_backward(p, md, primals, dy, name, results, timing_kwargs, *, sweep=False) -> None:
    """Each backward launch alone, and the whole backward rule, from saved residuals, with
    the default backward tiles (and, with ``sweep``, each of :data:`SWEEP`)."""
    x, dt, A, B, C, D, z, dt_bias = primals
    s = ssd_triton.ScanShapes.of(x, B, md)
    config = ssd_triton.default_block_sizes(p.chunk_size, p.head_dim, p.state_dim)
    f32 = jnp.float32
    H, P = p.heads, p.head_dim
    _, states, saved = jax.jit(
        lambda x, dt, A, B, C, D, z, dt_bias: ssd_triton._forward(
            x,
            dt,
            A,
            B,
            C,
            D,
            z,
            dt_bias,
            None,
            md,
            dt_softplus=True,
            dt_limit=(0.0, math.inf),
            return_intermediate_states=False,
            state_dtype=f32,
            config=config,
            interpret=jax.default_backend() != "gpu",
            residuals=True,
        )
    )(*primals)
    res = ssd_backward.Residuals(*saved)
    dstates = jnp.zeros(states.shape, f32)
    cu = md.cu_chunk_seqlens
    interpret = jax.default_backend() != "gpu"  # --quick on a CPU
    D_hp = jnp.broadcast_to(D.astype(f32).reshape(H, -1), (H, P))
    default = ssd_backward.default_backward_block_sizes(config)
    candidates = [default]
    if sweep:
        candidates += [dataclasses.replace(default, **c) for c in SWEEP]
    for blocks in candidates:
        opts = dict(blocks=blocks, interpret=interpret)
        stage1 = jax.jit(
            lambda dy, z, C, res, opts=opts: ssd_backward.state_pass(
                s, md, dy, z, C, res, dstates, intermediate=False, **opts
            )
        )
        dyg, ds_out, _, _ = stage1(dy, z, C, res)
        dyg = dy if dyg is None else dyg
        stage2 = jax.jit(
            lambda x, B, res, ds_out, z, dy, dyg, opts=opts: ssd_backward.chunk_dx(
                s, cu, x, B, res, ds_out, D_hp, z, dy, dyg, **opts
            )
        )
        stage3 = jax.jit(
            lambda x, B, C, res, ds_out, dyg, opts=opts: ssd_backward.chunk_dbc(
                s, cu, x, B, C, res, ds_out, dyg, **opts
            )
        )
        whole = jax.jit(
            lambda res, dy, blocks=blocks: ssd_backward.ssd_scan_backward(
                x,
                dt,
                A,
                B,
                C,
                D,
                z,
                dt_bias,
                None,
                res,
                dy,
                dstates,
                metadata=md,
                dt_softplus=True,
                dt_limit=(0.0, math.inf),
                return_intermediate_states=False,
                config=blocks,
                interpret=interpret,
            )
        )
        row = dict(problem=name, impl="triton", blocks=dataclasses.asdict(blocks))
        for what, fn in (
            ("bwd state_pass", functools.partial(stage1, dy, z, C, res)),
            ("bwd chunk_dx", functools.partial(stage2, x, B, res, ds_out, z, dy, dyg)),
            ("bwd chunk_dbc", functools.partial(stage3, x, B, C, res, ds_out, dyg)),
            ("bwd whole rule (kernels + glue)", functools.partial(whole, res, dy)),
        ):
            try:
                timing = harness.time_fn(fn, **timing_kwargs)
            except Exception as e:  # a candidate that does not compile (shared memory)
                results.add(dict(row, what=what, error=f"{type(e).__name__}: {e}"[:300]))
                continue
            results.add(dict(row, what=what, ms=timing.median_ms))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="then time the backward launches with each SWEEP tiling",
    )
    args = parser.parse_args()
    results = Results(args.out)
    if not args.quick:
        harness.spin_up()
    # The ungated problems first (benchmarks/train.py's), the gated ones after.
    for gated in (False, True):
        for p in problems(args.quick):
            profile(p, gated, results, quick=args.quick)
    if args.sweep:  # G 1, ungated: each candidate compiles the three launches again
        p = problems(args.quick)[0]
        inputs = prefill_inputs(p)
        primals = tuple(inputs[k] for k in ("x", "dt", "A", "B", "C", "D"))
        primals = (*primals, None, inputs["dt_bias"])
        dy = jax.random.normal(jax.random.key(3), inputs["x"].shape, jnp.bfloat16)
        kwargs = dict(warmup=2, samples=5, min_sample_ms=1.0) if args.quick else dict(samples=11)
        profile_backward(p, inputs["metadata"], primals, dy, p.name, results, kwargs, sweep=True)


if __name__ == "__main__":
    main()
