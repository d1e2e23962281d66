"""What a tensor-parallel decode step cannot go below: the all-reduce, and the MLP (GPUs).

``PYTHONPATH=. python3 tools/tp_floor.py [--tp 2] [--rows 1 64 256] [--out floor.json]``:
in one run,

- ``all-reduce``: 64 chained all-reduces of ``x[rows, 4096]`` bf16 over ``tp`` devices under
  ``shard_map`` (as a layer's row-parallel ``out_proj`` or ``down`` ends), time per
  all-reduce, through ``pallas_kernels.all_reduce`` with each ``--all-reduce``
  implementation: ``xla`` (``psum``, NCCL) and, on Hopper GPUs, ``mosaic`` (the one-shot
  kernel). A Bamba-9B-shaped step has two per layer (64); at tp = 2 the one-row step cannot
  be faster than its per-GPU bytes at the copy rate plus 64 of these.
- ``mlp``: eight chained Bamba-9B-shaped SwiGLU MLPs (hidden 4096, intermediate 14336,
  gate/up column- and down row-split over the devices, bf16), time per MLP, with gate and
  up as XLA merges them and kept apart by a barrier on up's operand (the model's MLP, which
  now stores them as one ``gate_up`` weight, kept them apart from 128 rows on before), at
  tp = 1 and ``--tp``.

On two H200s (2026-11-27): 22.4 / 22.5 / 26.8 µs per all-reduce at 1 / 64 / 256 rows;
at 256 rows tp = 2 an MLP took 137.7 µs merged and 110.8 µs apart (tp = 1: 153 µs), at one
row 66.5 and 69.1 µs. On one device (CPU included) it runs the MLP rows of tp = 1 only.
The one-shot kernel's prototype, chained the same way on two H200s (2026-11-27), took
35.4 µs at one row against psum's 18.8 (XLA's barrier and collective metadata before each
launch).
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from benchmarks import harness
from pallas_kernels.backend import supports_mosaic

HIDDEN, INTERMEDIATE = 4096, 14336  # Bamba-9B
CHAINED_MLPS, CHAINED_ALL_REDUCES = 8, 64


def mlp_chain(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, *, apart: bool):
    """``CHAINED_MLPS`` residual SwiGLU MLPs on x[T, D] with one set of weights."""
    for _ in range(CHAINED_MLPS):
        x_up = lax.optimization_barrier(x) if apart else x
        x = x + (jax.nn.silu(x @ gate) * (x_up @ up)) @ down
    return x


def time_mlps(tp: int, rows: tuple[int, ...], hidden: int, intermediate: int) -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",))
    column, row, replicated = (NamedSharding(mesh, s) for s in (P(None, "tp"), P("tp"), P()))
    keys = jax.random.split(jax.random.key(0), 3)
    weight = lambda key, shape, sharding: jax.device_put(  # noqa: E731
        jax.random.normal(key, shape, jnp.bfloat16) * 0.01, sharding
    )
    gate = weight(keys[0], (hidden, intermediate), column)
    up = weight(keys[1], (hidden, intermediate), column)
    down = weight(keys[2], (intermediate, hidden), row)
    results = {}
    for count in rows:
        x = jax.device_put(jnp.ones((count, hidden), jnp.bfloat16), replicated)
        for apart in (False, True):
            chain = jax.jit(
                lambda x, g, u, d, apart=apart: mlp_chain(x, g, u, d, apart=apart),
                out_shardings=replicated,
            )
            run = functools.partial(chain, x, gate, up, down)
            timing = harness.time_fn(run, warmup=3, samples=15)
            name = f"mlp tp={tp} rows={count} {'apart' if apart else 'merged'}"
            results[name] = timing.median_ms / CHAINED_MLPS * 1e3
            print(f"{name}: {results[name]:.1f} µs per MLP", flush=True)
    return results


def time_all_reduces(
    tp: int, rows: tuple[int, ...], hidden: int, implementation: str = "xla"
) -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",))

    def chain(x):
        for _ in range(CHAINED_ALL_REDUCES):
            total = pk.all_reduce(x, "tp", implementation=implementation)
            x = (total * (1.0 / tp)).astype(x.dtype)
        return x

    # check_vma=False: the kernel's outputs carry no per-device type of their own.
    reduce = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    results = {}
    for count in rows:
        x = jnp.ones((count, hidden), jnp.bfloat16)
        timing = harness.time_fn(functools.partial(reduce, x), warmup=3, samples=15)
        name = f"all-reduce {implementation} tp={tp} rows={count}"
        results[name] = timing.median_ms / CHAINED_ALL_REDUCES * 1e3
        print(f"{name}: {results[name]:.1f} µs each", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--intermediate", type=int, default=INTERMEDIATE)
    parser.add_argument(
        "--all-reduce",
        nargs="+",
        default=["xla", "mosaic"],
        choices=["xla", "mosaic"],
        help="all-reduce implementations to time (mosaic on Hopper GPUs only)",
    )
    parser.add_argument("--out", help="write the µs figures as JSON here")
    args = parser.parse_args()
    rows = tuple(args.rows)
    results = time_mlps(1, rows, args.hidden, args.intermediate)
    if jax.device_count() >= args.tp > 1:
        results |= time_mlps(args.tp, rows, args.hidden, args.intermediate)
        for implementation in args.all_reduce:
            if implementation == "mosaic" and not supports_mosaic():
                continue
            results |= time_all_reduces(args.tp, rows, args.hidden, implementation)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "us": results}, f, indent=1)


if __name__ == "__main__":
    main()
