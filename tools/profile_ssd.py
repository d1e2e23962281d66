"""Per-stage timings and a block-size sweep of the Triton SSD scan on one problem.

``python tools/profile_ssd.py [--problem bamba-uniform]`` (GPU). Prints the median time of
each of the three launches with the default block sizes, then the whole scan for each
candidate ``BlockSizes``; the fastest candidate informs ``default_block_sizes``.
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp

from benchmarks import harness
from benchmarks.ssd import prefill_inputs, prefill_problems
from pallas_kernels.ssd import triton as ssd_triton

CANDIDATES = [
    dict(block_m=64, block_k=32, block_t=64, num_warps=4, num_stages=2),  # the defaults
    dict(block_m=64, block_k=32, block_t=128, num_warps=4, num_stages=2),
    dict(block_m=64, block_k=32, block_t=32, num_warps=4, num_stages=2),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--problem", default="bamba-uniform")
    args = parser.parse_args()
    p = next(q for q in prefill_problems(False) if q.name == args.problem)
    T, H, P, N = sum(p.lengths), p.heads, p.head_dim, p.state_dim
    inputs = prefill_inputs(p)  # the benchmark's own arrays
    x, dt, A, B, C = (inputs[k] for k in ("x", "dt", "A", "B", "C"))
    D, dt_bias, md = inputs["D"], inputs["dt_bias"], inputs["metadata"]
    s = ssd_triton.ScanShapes.of(x, B, md)
    blocks = ssd_triton.default_block_sizes(p.chunk_size, P, N)
    cu = md.cu_chunk_seqlens
    Dp = jnp.broadcast_to(D[:, None], (H, P))
    harness.spin_up()

    stage1 = jax.jit(
        lambda x, dt, B: ssd_triton.state_scan(
            s,
            md,
            x,
            dt,
            A,
            B,
            dt_bias,
            None,
            dt_softplus=True,
            dt_limit=(0.0, math.inf),
            intermediate=False,
            state_dtype=jnp.float32,
            carried_dtype=C.dtype,
            blocks=blocks,
            interpret=False,
        )
    )
    dt_chunks, cum, carried, _ = stage1(x, dt, B)
    stage3a = jax.jit(lambda C, B: ssd_triton.chunk_cb(s, cu, C, B, blocks=blocks, interpret=False))
    cb = stage3a(C, B)
    stage3b = jax.jit(
        lambda x, C, cb, d, c, carried: ssd_triton.chunk_scan(
            s, cu, x, C, cb, d, c, carried, Dp, None, blocks=blocks, interpret=False
        )
    )
    print(f"{p.name}: T={T} chunks={int(md.num_chunks)} default {blocks}")
    for name, fn in (
        ("state_scan", lambda: stage1(x, dt, B)),
        ("chunk_cb", lambda: stage3a(C, B)),
        ("chunk_scan", lambda: stage3b(x, C, cb, dt_chunks, cum, carried)),
    ):
        print(f"  {name:<14}{harness.time_fn(fn).median_ms:8.3f} ms")

    for candidate in CANDIDATES:
        cand = ssd_triton.BlockSizes(**candidate)
        fn = jax.jit(
            lambda x, dt, B, C, cand=cand: ssd_triton.ssd_scan(
                x,
                dt,
                A,
                B,
                C,
                metadata=md,
                chunk_size=p.chunk_size,
                D=D,
                z=None,
                dt_bias=dt_bias,
                dt_softplus=True,
                dt_limit=(0.0, math.inf),
                initial_states=None,
                return_intermediate_states=False,
                state_dtype=jnp.float32,
                config=cand,
            )
        )
        try:
            t = harness.time_fn(lambda fn=fn: fn(x, dt, B, C)).median_ms
            print(f"  total {candidate}: {t:.3f} ms")
        except Exception as e:  # noqa: BLE001 - report resource failures, keep sweeping
            print(f"  total {candidate}: failed: {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
