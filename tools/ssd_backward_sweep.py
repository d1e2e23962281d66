"""Heads per thread block of the Mosaic SSD kernels, swept on ``benchmarks/train.py``'s
problems: ``ssd_scan`` forward + backward with ``implementation="mosaic"`` (GPU).

``PYTHONPATH=. python3 tools/ssd_backward_sweep.py [--out FILE] [--config HB,DBC_HB ...]``

Each ``--config`` is ``heads_per_block,dbc_heads_per_block`` (the chunk scans' and
chunk_dx's heads, then chunk_dbc's; a value that does not divide a problem's heads per group
skips that problem). Prints the median ms of ``benchmarks.harness.time_fn`` per (problem,
config) and writes them to ``--out`` as JSON as it goes. The sweep of
docs/notes/2026-12-03-mosaic-ssd-backward.md.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

from benchmarks import harness
from benchmarks import ssd as ssd_benchmark
from benchmarks.train import ssd_problems
from pallas_kernels import ssd_scan
from pallas_kernels.ssd import mosaic_config

DEFAULT_CONFIGS = ("16,16", "16,8", "16,32", "16,64", "8,8", "32,32")


def fwd_bwd_ms(p: ssd_benchmark.PrefillProblem, config: mosaic_config.BlockSizes) -> float:
    inputs = ssd_benchmark.prefill_inputs(p)
    args = tuple(inputs[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias"))
    dy = jax.random.normal(jax.random.key(3), inputs["x"].shape, jnp.bfloat16)

    def scan(x, dt, A, B, C, D, dt_bias):
        return ssd_scan(
            x,
            dt,
            A,
            B,
            C,
            metadata=inputs["metadata"],
            chunk_size=p.chunk_size,
            D=D,
            dt_bias=dt_bias,
            dt_softplus=True,
            implementation="mosaic",
            config=config,
        )[0]

    step = jax.jit(lambda args, dy: jax.vjp(scan, *args)[1](dy))
    return harness.time_fn(functools.partial(step, args, dy)).median_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--config", nargs="+", default=list(DEFAULT_CONFIGS))
    args = parser.parse_args()
    rows = []
    for p in ssd_problems(quick=False):
        per_group = p.heads // p.groups
        for text in args.config:
            hb, dbc_hb = (int(v) for v in text.split(","))
            if per_group % hb or per_group % dbc_hb:
                continue
            config = mosaic_config.BlockSizes(heads_per_block=hb, dbc_heads_per_block=dbc_hb)
            ms = fwd_bwd_ms(p, config)
            rows.append(dict(problem=p.name, heads_per_block=hb, dbc_heads_per_block=dbc_hb, ms=ms))
            print(f"{p.name} heads_per_block={hb} dbc_heads_per_block={dbc_hb}: {ms:.3f} ms")
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
