"""Compile time and run time of a few Bamba-9B engine step buckets under XLA flag variants
(GPU).

``PYTHONPATH=. python3 tools/step_compile_probe.py [--out FILE] [--bucket ROWS,TOKENS ...]``
``[--variant LABEL=FLAGS ...]``

Each variant runs in a fresh process with ``XLA_FLAGS=FLAGS`` and no compilation cache: the
benchmark's engine (``benchmarks.serving``'s options, random init, bf16) compiles the
buckets with ``Engine.warmup`` (its log gives each program's compile time), then each
bucket's all-padding step runs 3 times to warm and 10 times timed (median). Prints a line
per variant and writes them all to ``--out`` as JSON as it goes. The variants of
docs/notes/2026-12-03-step-compile-time.md: ``default=`` and
``no_triton_gemm=--xla_gpu_enable_triton_gemm=false``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

DEFAULT_BUCKETS = ("1,0", "32,0", "256,0", "256,1024", "256,4096", "256,8192", "16,8192", "0,8192")
DEFAULT_VARIANTS = ("default=", "no_triton_gemm=--xla_gpu_enable_triton_gemm=false")


def probe(buckets: list[tuple[int, int]]) -> dict[str, Any]:
    """In this process: the engine, its warm-up of ``buckets`` and each bucket's step time."""
    import jax
    import jax.numpy as jnp

    from benchmarks import harness
    from benchmarks.serving import _build, engine_options
    from flax_models.config import HybridConfig

    start = time.perf_counter()
    _, engine = _build(HybridConfig.bamba_9b(), jnp.bfloat16, engine_options(False))
    jax.block_until_ready(engine.runner.caches)
    init_s = time.perf_counter() - start
    start = time.perf_counter()
    programs = engine.warmup(buckets=buckets, progress=False)
    warmup_s = time.perf_counter() - start
    step_ms = {}
    for bucket in buckets:
        step = functools.partial(engine._launch, engine.builder.dummy(*bucket))
        # Each timed step waited for on its own (no back-to-back batches).
        timing = harness.time_fn(step, samples=10, min_sample_ms=0)
        step_ms[f"{bucket[0]}+{bucket[1]}"] = timing.median_ms
    return dict(init_s=init_s, warmup_s=warmup_s, programs=programs, step_ms=step_ms)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="JSON of every variant's figures")
    parser.add_argument("--bucket", nargs="+", default=list(DEFAULT_BUCKETS), metavar="R,T",
                        help="(decode rows, prompt tokens) buckets of the engine")  # fmt: skip
    parser.add_argument("--variant", nargs="+", default=list(DEFAULT_VARIANTS),
                        metavar="LABEL=FLAGS", help="XLA_FLAGS of each variant")  # fmt: skip
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    buckets = [tuple(int(n) for n in b.split(",")) for b in args.bucket]
    if args.child is not None:  # one variant, in its own process
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        print("RESULT " + json.dumps(dict(label=args.child) | probe(buckets)), flush=True)
        return
    results = []
    for variant in args.variant:
        label, _, flags = variant.partition("=")
        env = dict(os.environ, XLA_FLAGS=flags, XLA_PYTHON_CLIENT_MEM_FRACTION="0.94")
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        command = [sys.executable, __file__, "--child", label,
                   "--bucket", *args.bucket]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        print("\n".join(line for line in done.stderr.splitlines() if "warmup:" in line))
        if done.returncode:
            print(f"{label}: failed\n{done.stderr[-3000:]}", flush=True)
            continue
        line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
        results.append(json.loads(line.removeprefix("RESULT ")))
        print(results[-1], flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
