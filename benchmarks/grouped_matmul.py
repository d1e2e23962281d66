"""MoE expert matmul (``grouped_matmul``) benchmarks.

``python -m benchmarks.grouped_matmul [--out FILE] [--results-dir DIR] [--quick]
[--only PROBLEM ...] [--sweep]``. Problems are the expert layers of Granite-4.0-H-Small
(hidden 4096, 72 experts, top-10, expert width 768; SwiGLU, so the gate-up projection is fused to
N = 2 × 768) and Nemotron-3-Nano (hidden 2688, 128 experts, top-6, width 1856; relu², no
gate), for 8192 routed tokens (prefill, compute-bound) and 256 (decode, weight-streaming);
M = tokens × top_k rows, sorted by expert.

Routing: seeded top-k of random logits with a per-expert bias (sd 0.5), so the load is
balanced-ish and some experts get few or no rows, as in a trained router. The
``-skewed`` 256-token problems use a bias of sd 3: a few experts draw most rows, as a
random-init model routes (``benchmarks/model.py`` measures 22–61% of the experts touched
by a 256-row decode step).

Rooflines, measured in this run: for 8192-token problems the FLOPs over the rate of a dense
bf16 matmul with the same total FLOPs (``[M, K] @ [K, N]``, also a ``dense`` row); for
256-token problems the bytes of the experts touched (weights of experts with at least one
row, plus x and y) over the measured copy bandwidth. ``--sweep`` adds Triton rows for a
set of block sizes around the heuristic's (``sweep: true``, ``config_name`` names each).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from pallas_kernels import backend_for, grouped_matmul
from pallas_kernels.grouped_matmul import api as grouped_matmul_api
from pallas_kernels.grouped_matmul import triton_config as gm_config

# Routed tokens from which a problem is compute-bound (its roofline the matmul rate).
_PREFILL_TOKENS = 8192


@dataclasses.dataclass(frozen=True)
class Problem:
    name: str
    tokens: int  # routed tokens; M = tokens * top_k rows
    top_k: int
    num_experts: int  # E
    K: int
    N: int
    skew: float = 0.5  # sd of the per-expert router bias

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k


def problems(quick: bool) -> list[Problem]:
    if quick:
        return [
            Problem("tiny-prefill", 64, 2, 4, 64, 32),
            Problem("tiny-decode", 8, 2, 8, 32, 64),
        ]
    models = {
        # (experts, top_k, hidden, width, gate-up N)
        "granite-small": (72, 10, 4096, 768, 2 * 768),
        "nemotron3-nano": (128, 6, 2688, 1856, 1856),
    }
    out = []
    for model, (E, top_k, hidden, width, gate_up_n) in models.items():
        for tokens in (8192, 256):
            out.append(Problem(f"{model}-up-{tokens}", tokens, top_k, E, hidden, gate_up_n))
            out.append(Problem(f"{model}-down-{tokens}", tokens, top_k, E, width, hidden))
        for name, K, N in (("up", hidden, gate_up_n), ("down", width, hidden)):
            out.append(Problem(f"{model}-{name}-256-skewed", 256, top_k, E, K, N, skew=3.0))
    return out


def routed_group_sizes(p: Problem, seed: int = 0) -> np.ndarray:
    """Rows per expert from a seeded top-k of random router logits (with a per-expert bias
    so the load is uneven)."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((p.tokens, p.num_experts))
    logits = logits + rng.normal(0.0, p.skew, p.num_experts)  # after: the seed's old draws
    chosen = np.argsort(-logits, axis=1)[:, : p.top_k]
    return np.bincount(chosen.reshape(-1), minlength=p.num_experts).astype(np.int32)


def cost(p: Problem, group_sizes: np.ndarray) -> tuple[float, float]:
    """(FLOPs, bytes): 2 M K N; weights of the experts with rows, x and y in bf16."""
    bf16 = 2
    touched = int(np.count_nonzero(group_sizes))
    flops = 2.0 * p.rows * p.K * p.N
    bytes_moved = (touched * p.K * p.N + p.rows * (p.K + p.N)) * bf16
    return flops, float(bytes_moved)


def sweep_configs(p: Problem) -> list[gm_config.BlockSizes]:
    """Block sizes around the heuristic's, for ``--sweep``."""
    B = gm_config.BlockSizes
    if p.tokens >= _PREFILL_TOKENS:
        return [
            B(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
            B(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4),
            B(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4),
            B(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4),
            B(block_m=64, block_n=256, block_k=64, num_warps=4, num_stages=4),
            B(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
        ]
    return [
        B(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s, narrow_m=nm)
        for bm, nm in ((16, None), (32, None), (64, None), (64, 16), (64, 32))
        for bn, bk in ((64, 128), (128, 128))
        for w, s in ((4, 4),)
    ]


def bench(p: Problem, ceilings: harness.Ceilings, *, quick: bool, sweep: bool) -> list[dict]:
    rng = np.random.default_rng(1)
    group_sizes = routed_group_sizes(p)
    x = jnp.asarray(rng.standard_normal((p.rows, p.K), np.float32), jnp.bfloat16)
    w = jnp.asarray(
        rng.standard_normal((p.num_experts, p.K, p.N), np.float32) * p.K**-0.5, jnp.bfloat16
    )
    gs = jnp.asarray(group_sizes)
    flops, bytes_moved = cost(p, group_sizes)
    extra = dict(
        op="grouped_matmul",
        tokens=p.tokens,
        top_k=p.top_k,
        experts=p.num_experts,
        M=p.rows,
        K=p.K,
        N=p.N,
        experts_touched=int(np.count_nonzero(group_sizes)),
        max_group=int(group_sizes.max()),
    )
    rows = []

    # The dense matmul of the same total size: the compute ceiling of a prefill problem.
    a = jax.random.normal(jax.random.key(3), (p.rows, p.K), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(4), (p.K, p.N), jnp.bfloat16)
    dense = jax.jit(lambda u, v: jnp.dot(u, v, preferred_element_type=jnp.bfloat16))
    dense_timing = harness.time_fn(lambda: dense(a, b))
    dense_tflops = flops / (dense_timing.median_ms * 1e-3) / 1e12
    if p.tokens >= _PREFILL_TOKENS and not quick:
        ceilings = dataclasses.replace(ceilings, matmul_tflops=dense_tflops)
    rows.append(
        harness.row(
            p.name,
            "dense",
            dense_timing,
            flops=flops,
            bytes_moved=bytes_moved,
            ceilings=ceilings,
            **extra,
        )
    )

    def add(impl: str, config=None, **more):
        call = jax.jit(
            lambda x, w, gs: grouped_matmul(x, w, gs, implementation=impl, config=config)
        )
        timing = harness.time_fn(lambda: call(x, w, gs))
        rows.append(
            harness.row(
                p.name,
                impl,
                timing,
                flops=flops,
                bytes_moved=bytes_moved,
                ceilings=ceilings,
                dense_tflops=dense_tflops,
                **extra,
                **more,
            )
        )

    for impl in harness.runnable(grouped_matmul_api.GROUPED_MATMUL):
        try:
            backend_for(grouped_matmul, x, w, gs, implementation=impl)
        except ValueError as error:  # a backend that cannot serve this problem
            print(f"note: {p.name}: no {impl} row ({error})")
            continue
        config = None
        if impl == "triton":
            config = gm_config.default_block_sizes(p.rows, p.K, p.N, p.num_experts, x.dtype)
        add(impl, config=config, config_name=None if config is None else str(config))
    if sweep and "triton" in harness.runnable(grouped_matmul_api.GROUPED_MATMUL):
        for config in sweep_configs(p):
            try:
                add("triton", config=config, config_name=str(config), sweep=True)
            except jax.errors.JaxRuntimeError as error:  # e.g. over the shared memory
                print(f"note: {p.name}: {config} does not run ({harness.failure_reason(error)})")
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    # ``--sweep`` is this module's own flag; the rest are the harness's.
    command = list(sys.argv[1:] if argv is None else argv)
    sweep = "--sweep" in command
    args = harness.parse_args(
        [a for a in command if a != "--sweep"],
        "grouped_matmul benchmarks",
        module="grouped_matmul",
        command=command,
    )
    ceilings = harness.measure_ceilings(quick=args.quick)
    rows = []
    for p in problems(args.quick):
        if harness.selected(p.name, args.only):
            rows += bench(p, ceilings, quick=args.quick, sweep=sweep)
    main_rows = [r for r in rows if not r.get("sweep")]
    swept = [r for r in rows if r.get("sweep")]
    harness.add_speedups(main_rows)
    # The sweep's rows (``sweep: true``, each named by its ``config_name``) follow the
    # others in the JSON; the table prints them apart.
    harness.report("grouped_matmul (MoE experts)", main_rows, ceilings, None)
    harness.write_report(main_rows + swept, ceilings, args.output)
    if sweep:
        print("\nTriton sweep (median ms, % of roofline):")
        for r in swept:
            print(
                f"{r['problem']:<28}{r['median_ms']:>9.3f}"
                f"{100 * r['roofline_fraction']:>7.1f}%  {r['config_name']}"
            )
    return rows


if __name__ == "__main__":
    main()
