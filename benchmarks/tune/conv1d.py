"""Block-size sweep of the Triton conv1d prefill and gated-norm kernels (GPU).

``python -m benchmarks.tune.conv1d [--out sweep.json]``: for the bamba-conv problems and the
32k × 8192 gated norm, times each candidate tiling with the harness and checks it against
the ``xla`` result, so a fast but wrong tiling shows up. Informs ``default_block_sizes``.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.conv1d import problems
from pallas_kernels.conv1d import reference as conv_reference
from pallas_kernels.conv1d import triton as conv_triton
from pallas_kernels.conv1d import triton_config as conv_config
from pallas_kernels.norm import reference as norm_reference
from pallas_kernels.norm import triton as norm_triton
from pallas_kernels.norm import triton_config as norm_config
from pallas_kernels.testing import relative_error

CONV_CANDIDATES = [
    dict(block_t=bt, unroll_t=ut, block_d=bd, num_warps=w)
    for bt, ut, bd, w in [
        (128, 8, 256, 2),  # the defaults
        (128, 4, 256, 2),
        (128, 16, 256, 2),
        (256, 8, 256, 2),
        (64, 8, 256, 2),
        (128, 8, 256, 1),  # 8 channels (16 bytes) per thread per row
        (128, 8, 512, 4),
    ]
]
NORM_CANDIDATES = [dict(block_rows=r, num_warps=w) for r, w in [(1, 8), (1, 16)]]


def _time_candidates(op, problem, candidates, make_fn, args, want, bytes_moved, results):
    """Times ``make_fn(candidate)(*args)`` for each candidate; checks it against ``want``."""
    for c in candidates:
        fn = make_fn(c)
        try:
            got = fn(*args)
            if isinstance(got, tuple):
                err = max(relative_error(g, r) for g, r in zip(got, want, strict=True))
            else:
                err = relative_error(got, want)
            t = harness.time_fn(lambda fn=fn: fn(*args)).median_ms
        except Exception as e:  # noqa: BLE001 - a tiling that does not compile is skipped
            print(f"{problem} {c}: FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        gbps = bytes_moved / t / 1e6
        results.append(dict(op=op, problem=problem, **c, ms=t, err=err, gbps=gbps))
        print(f"{problem:<18}{str(c):<48}{t:8.3f} ms {gbps:7.0f} GB/s err {err:.1e}")


def sweep_conv(p, rng, results) -> None:
    T, B = sum(p.lengths), len(p.lengths)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)

    x, w, bias = normal(T, p.dim), normal(p.dim, p.width), normal(p.dim)
    kw = dict(
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(p.lengths)]), jnp.int32),
        conv_state_cache=normal(2 * B, p.width - 1, p.dim),
        slot_ids=jnp.asarray(rng.permutation(2 * B)[:B], jnp.int32),
        has_initial_state=jnp.asarray(rng.random(B) < 0.5),
        activation="silu",
    )
    want = jax.jit(lambda x: conv_reference.causal_conv1d(x, w, bias, **kw))(x)

    def make_fn(c):
        blocks = conv_config.BlockSizes(**c)
        return jax.jit(lambda x: conv_triton.causal_conv1d(x, w, bias, config=blocks, **kw))

    _time_candidates("conv", p.name, CONV_CANDIDATES, make_fn, (x,), want, 2 * x.nbytes, results)


def sweep_norm(p, rng, results) -> None:
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)

    x, z, weight = normal(p.rows, p.dim), normal(p.rows, p.dim), normal(p.dim)
    kw = dict(group_size=p.group_size, eps=1e-5, norm_before_gate=False)
    want = jax.jit(lambda x, z: norm_reference.gated_rms_norm(x, z, weight, **kw))(x, z)

    def make_fn(c):
        blocks = norm_config.BlockSizes(**c)
        return jax.jit(lambda x, z: norm_triton.gated_rms_norm(x, z, weight, config=blocks, **kw))

    _time_candidates("norm", p.name, NORM_CANDIDATES, make_fn, (x, z), want, 3 * x.nbytes, results)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    conv_problems, _, norm_problems = problems(False)
    rng = np.random.default_rng(0)
    harness.spin_up()
    results: list[dict] = []
    for p in conv_problems:
        sweep_conv(p, rng, results)
    for p in norm_problems[:1]:
        sweep_norm(p, rng, results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
