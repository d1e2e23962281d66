"""Tiling sweep of the Triton masked-tail attention kernels on the benchmark problems (GPU).

``PYTHONPATH=. python3 -m benchmarks.tune.attention --out tune_attention.json``
``[--problems dense,decode-64] [--budget-s 165] [--samples 10] [--no-xla] [--quick]``

For each problem of ``benchmarks/attention.py``: the ``xla`` reference (once, for the error
column), cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")``) and a few
candidate :class:`~pallas_kernels.attention.triton_config.BlockSizes`, the heuristic default
first. Each row gives the first-call time (tracing, XLA and Triton compilation, one run),
the median ms from ``benchmarks.harness.time_fn``, TFLOP/s, GB/s of needed bytes (as the
benchmark counts them) and their fraction of the measured copy bandwidth, the speed-up
over cuDNN and the relative error ``||out - ref|| / ||ref||`` (column ``error_vs`` in the
JSON says against what: the ``xla`` reference; cuDNN where that failed or ``--no-xla``
and cuDNN computes the same mask; else the first Triton config that ran, a consistency
check only). A config that fails to compile or run (e.g. shared memory exceeded) is
reported and skipped; one whose error passes the bf16 tolerance (2e-2) or gives
non-finite values is flagged WRONG. Candidates past ``--budget-s`` seconds of wall time
are skipped, so the sweep fits a lease. ``--quick`` runs the tiny problems in interpret
mode (a CPU smoke run of this script).

Targets (from the first H200 measurements): dense-causal at >= 0.7x cuDNN's speed,
ragged-tail >= 1.5x faster than cuDNN, decode at >= 85 % of the measured copy bandwidth
over the needed KV bytes. The summary prints, per problem, the best correct config and
whether it meets its target. A sweep driver only: the defaults live in
``default_block_sizes``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.attention import Problem, cost, dense_queries, problems
from pallas_kernels._pallas import next_power_of_2
from pallas_kernels.attention import _layout as attention_layout
from pallas_kernels.attention import reference as attention_reference
from pallas_kernels.attention import triton as attention_triton
from pallas_kernels.attention import triton_config as attention_config
from pallas_kernels.backend import on_gpu

# Prefill candidates: (Q tile rows = block_q x padded GQA group, block_k, num_warps,
# num_stages). FlashAttention-2 Triton kernels on Hopper at D = 128 sit around 128 x 64 or
# 128 x 128 tiles, 8 warps, 2-3 stages; 64-row tiles with 4 warps are the small option.
PREFILL_CANDIDATES: tuple[tuple[int, int, int, int], ...] = (
    (128, 64, 8, 3),
    (128, 64, 8, 2),  # the defaults before this sweep
    (64, 64, 4, 3),  # small tiles: 3 programs per SM
    (128, 128, 8, 2),
    (64, 128, 4, 2),
    (128, 128, 8, 3),  # ~224 KiB of shared memory: may not fit
    (128, 32, 8, 3),
)
# Decode candidates: (split_k, decode_block_k, decode_num_warps, decode_num_stages).
DECODE_CANDIDATES: tuple[tuple[int, int, int, int], ...] = (
    (1024, 128, 4, 2),  # the defaults before this sweep
    (2048, 64, 4, 3),  # half the splits: fewer idle programs and partials
    (512, 64, 4, 3),
    (1024, 64, 4, 2),  # 64 KiB of shared memory: 3 programs per SM
    (1024, 32, 4, 4),
    (1024, 64, 2, 3),
)
# Relative error above which a config is flagged (DESIGN.md section 7, bf16 inputs).
BF16_TOLERANCE = 2e-2
# Target per problem kind: ("cudnn_speed", x) = at least x times cuDNN's speed;
# ("copy_fraction", x) = at least x of the measured copy bandwidth over needed bytes.
TARGETS: dict[str, tuple[str, float]] = {
    "dense-causal": ("cudnn_speed", 0.7),
    "ragged-tail": ("cudnn_speed", 1.5),
    "decode-64": ("copy_fraction", 0.85),
    "decode-256": ("copy_fraction", 0.85),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--problems", default=None, help="comma-separated name substrings")
    parser.add_argument("--budget-s", type=float, default=165.0, help="wall-time budget")
    parser.add_argument(
        "--no-xla", action="store_true", help="skip the xla reference (errors vs cuDNN)"
    )
    parser.add_argument("--samples", type=int, default=10, help="timing samples per row")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------- candidates


def is_decode(p: Problem) -> bool:
    return attention_layout.is_decode_shaped(p.num_tokens, len(p.q_lens))


def default_blocks(p: Problem) -> attention_config.BlockSizes:
    return attention_config.default_block_sizes(
        num_tokens=p.num_tokens,
        num_q_heads=p.num_q_heads,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        cache_len=p.cache_len,
        dtype=jnp.bfloat16,
    )


def label(p: Problem, b: attention_config.BlockSizes) -> str:
    if is_decode(p):
        return f"split{b.split_k} bk{b.decode_block_k} w{b.decode_num_warps} s{b.decode_num_stages}"
    rows = b.block_q * next_power_of_2(p.num_q_heads // p.num_kv_heads)
    return f"q{rows}(bq{b.block_q}) bk{b.block_k} w{b.num_warps} s{b.num_stages}"


def candidates(p: Problem, quick: bool) -> list[tuple[str, attention_config.BlockSizes | str]]:
    """``(label, BlockSizes)`` for the default and each candidate (duplicates of the default
    dropped), or ``(label, reason)`` for one that is not a valid BlockSizes."""
    base = default_blocks(p)
    out: list[tuple[str, attention_config.BlockSizes | str]] = [(f"default {label(p, base)}", base)]
    seen = {base}
    bg = next_power_of_2(p.num_q_heads // p.num_kv_heads)
    if is_decode(p):
        changes = [
            dict(
                split_k=split,
                decode_block_k=bk,
                decode_num_warps=w,
                decode_num_stages=st,
            )
            for split, bk, w, st in DECODE_CANDIDATES
        ]
    else:
        changes = [
            dict(block_q=max(rows // bg, 1), block_k=bk, num_warps=w, num_stages=st)
            for rows, bk, w, st in PREFILL_CANDIDATES
        ]
    for change in changes[:1] if quick else changes:
        try:
            b = dataclasses.replace(base, **change)
        except ValueError as error:
            out.append((str(change), f"invalid: {error}"))
            continue
        if b not in seen:
            seen.add(b)
            out.append((label(p, b), b))
    return out


# ---------------------------------------------------------------------------- running


@jax.jit
def relative_error(out: jax.Array, ref: jax.Array) -> jax.Array:
    """``||out - ref|| / ||ref||`` in fp32 on the device; inf if ``out`` is not finite."""
    o, r = out.astype(jnp.float32), ref.astype(jnp.float32)
    err = jnp.linalg.norm(o - r) / jnp.maximum(jnp.linalg.norm(r), jnp.finfo(jnp.float32).tiny)
    return jnp.where(jnp.all(jnp.isfinite(o)), err, jnp.inf)


def first_call(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()``'s result and the seconds it took (compilation included)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def short_error(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text[:300]


@dataclasses.dataclass
class Inputs:
    q: jax.Array
    k_cache: jax.Array
    v_cache: jax.Array
    query_start_loc: np.ndarray
    kv_lens: jax.Array
    slot_ids: jax.Array


def make_inputs(p: Problem) -> Inputs:
    """As ``benchmarks.attention.bench``: random bf16 drawn on the device, slot b holds
    sequence b (so the caches double as cuDNN's dense keys)."""
    B, T, L = len(p.q_lens), p.num_tokens, p.cache_len
    keys = iter(jax.random.split(jax.random.key(1), 3))

    def normal(*shape):
        return jax.random.normal(next(keys), shape, jnp.bfloat16)

    q = normal(T, p.num_q_heads, p.head_dim)
    k_cache, v_cache = (normal(B, L, p.num_kv_heads, p.head_dim) for _ in range(2))
    return Inputs(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        query_start_loc=np.concatenate([[0], np.cumsum(p.q_lens)]).astype(np.int32),
        kv_lens=jnp.asarray(p.kv_lens, jnp.int32),
        slot_ids=jnp.arange(B, dtype=jnp.int32),
    )


def attention_fn(p: Problem, x: Inputs, implementation: Callable, **options) -> Callable:
    """``implementation(q, k, v, **batch)`` jitted with the batch closed over (constants,
    as in ``benchmarks.attention``; a ``functools.partial`` would make them traced), as JAX
    arrays, which is what the API hands the implementations."""
    batch = dict(
        query_start_loc=jnp.asarray(x.query_start_loc),
        kv_lens=x.kv_lens,
        slot_ids=x.slot_ids,
        causal=p.causal,
        sm_scale=p.head_dim**-0.5,
        sliding_window=None,
    )
    return jax.jit(lambda q, k, v: implementation(q, k, v, **batch, **options))


def cudnn_same_mask(p: Problem) -> bool:
    """cuDNN's causal mask is top-left aligned: it computes our mask only where every
    sequence has as many queries as keys, or one query (decode, run unmasked)."""
    return (not p.causal) or p.q_lens == p.kv_lens or all(n == 1 for n in p.q_lens)


def cudnn_fn(p: Problem, x: Inputs) -> tuple[Callable, jax.Array, Callable]:
    """cuDNN on the dense ``[B, max q_len, Hq, D]`` layout, its dense queries, and the map
    from its output back to the packed rows."""
    fn = jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=p.causal and p.q_lens == p.kv_lens,
            query_seq_lengths=jnp.asarray(p.q_lens, jnp.int32),
            key_value_seq_lengths=x.kv_lens,
            implementation="cudnn",
        )
    )
    seq = np.repeat(np.arange(len(p.q_lens)), p.q_lens)
    row = np.concatenate([np.arange(n) for n in p.q_lens])
    return fn, dense_queries(p, x.q, x.query_start_loc), jax.jit(lambda out: out[seq, row])


def rate_columns(p: Problem, median_ms: float, ceilings: harness.Ceilings) -> dict[str, float]:
    flops, bytes_moved = cost(p)
    seconds = median_ms * 1e-3
    gbps = bytes_moved / seconds / 1e9
    return dict(
        tflops=flops / seconds / 1e12,
        gbps=gbps,
        copy_fraction=gbps / ceilings.copy_gbps,
        roofline_fraction=harness.roofline_ms(flops, bytes_moved, ceilings) / median_ms,
    )


def run_problem(
    p: Problem, ceilings: harness.Ceilings, args: argparse.Namespace, deadline: float
) -> list[dict]:
    gpu = on_gpu()
    x = make_inputs(p)
    args_qkv = (x.q, x.k_cache, x.v_cache)
    rows: list[dict] = []
    timing_kw = dict(samples=2, warmup=1) if args.quick else dict(samples=args.samples)

    # What the errors are measured against: the xla reference, else cuDNN where it computes
    # the same mask, else the first Triton config that runs (a consistency check only).
    ref, ref_source = None, None
    try:
        if args.no_xla:
            raise RuntimeError("skipped (--no-xla)")
        reference = attention_fn(p, x, attention_reference.masked_tail_attention)
        ref, ref_s = first_call(lambda: reference(*args_qkv))
        ref_source = "xla"
        print(f"  xla reference: {ref_s:.1f} s")
    except Exception as error:  # noqa: BLE001 - the sweep goes on without it
        print(f"  xla reference failed: {short_error(error)}")

    cudnn_ms = None
    if gpu:
        try:
            fn, q_dense, to_packed = cudnn_fn(p, x)
            out, first_s = first_call(lambda: to_packed(fn(q_dense, x.k_cache, x.v_cache)))
            err = None  # none against itself, nor where its mask differs
            if ref is None and cudnn_same_mask(p):
                ref, ref_source = out, "cudnn"
            elif ref is not None and cudnn_same_mask(p):
                err = float(relative_error(out, ref))
            t = harness.time_fn(lambda: fn(q_dense, x.k_cache, x.v_cache), **timing_kw)
            cudnn_ms = t.median_ms
            rows.append(
                dict(
                    problem=p.name,
                    config="cudnn" + ("" if cudnn_same_mask(p) else " (unmasked, not same)"),
                    implementation="cudnn",
                    status="ok",
                    median_ms=t.median_ms,
                    min_ms=t.min_ms,
                    max_ms=t.max_ms,
                    first_call_s=first_s,
                    rel_error=err,
                    error_vs=ref_source if err is not None else None,
                    **rate_columns(p, t.median_ms, ceilings),
                )
            )
            del out
        except Exception as error:  # noqa: BLE001
            print(f"  cudnn failed: {short_error(error)}")

    for name, blocks in candidates(p, args.quick):
        row: dict[str, Any] = dict(problem=p.name, config=name, implementation="triton")
        rows.append(row)
        if isinstance(blocks, str):
            row["status"] = blocks
            continue
        row["block_sizes"] = dataclasses.asdict(blocks)
        if time.perf_counter() > deadline:
            row["status"] = "skipped (budget)"
            continue
        fn = attention_fn(
            p,
            x,
            attention_triton.masked_tail_attention,
            config=blocks,
            interpret=not gpu,
        )
        try:
            out, row["first_call_s"] = first_call(functools.partial(fn, *args_qkv))
        except Exception as error:  # noqa: BLE001 - e.g. shared memory exceeded
            row["status"] = f"failed to compile/run: {short_error(error)}"
            if args.quick:
                traceback.print_exc()
            continue
        if ref is None:
            ref, ref_source = out, f"triton {name}"
            print(f"  no reference: errors are against triton {name}")
        err = float(relative_error(out, ref))
        del out
        row.update(rel_error=err, error_vs=ref_source)
        wrong = err is not None and not err <= BF16_TOLERANCE
        try:
            t = harness.time_fn(functools.partial(fn, *args_qkv), **timing_kw)
        except Exception as error:  # noqa: BLE001
            row["status"] = f"failed while timing: {short_error(error)}"
            continue
        row.update(
            status="WRONG" if wrong else "ok",
            median_ms=t.median_ms,
            min_ms=t.min_ms,
            max_ms=t.max_ms,
            **rate_columns(p, t.median_ms, ceilings),
        )
        if cudnn_ms is not None:
            row["speedup_vs_cudnn"] = cudnn_ms / t.median_ms
    return rows


# ---------------------------------------------------------------------------- reporting


def print_rows(rows: list[dict]) -> None:
    header = (
        f"{'problem':<16}{'config':<40}{'ms':>8}{'TFLOP/s':>9}{'GB/s':>7}{'%copy':>7}"
        f"{'vs cuDNN':>9}{'rel err':>9}{'1st s':>7}  status"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        if "median_ms" not in r:
            print(f"{r['problem']:<16}{r['config'][:39]:<40}  {r['status']}")
            continue
        speed = r.get("speedup_vs_cudnn")
        err = r.get("rel_error")
        print(
            f"{r['problem']:<16}{r['config'][:39]:<40}{r['median_ms']:>8.3f}"
            f"{r['tflops']:>9.1f}{r['gbps']:>7.0f}{100 * r['copy_fraction']:>6.0f}%"
            f"{'' if speed is None else f'{speed:.2f}x':>9}"
            f"{'' if err is None else f'{err:.1e}':>9}"
            f"{r.get('first_call_s', 0.0):>7.1f}  {r['status']}"
        )


def summary(rows: list[dict]) -> dict[str, dict]:
    """Best correct Triton config per problem and its target check."""
    best: dict[str, dict] = {}
    for r in rows:
        if r["implementation"] != "triton" or r.get("status") != "ok":
            continue
        if r["problem"] not in best or r["median_ms"] < best[r["problem"]]["median_ms"]:
            best[r["problem"]] = r
    out = {}
    print("\nbest correct triton config per problem:")
    for problem, r in best.items():
        kind, value = TARGETS.get(problem, (None, None))
        met = None
        if kind == "cudnn_speed" and "speedup_vs_cudnn" in r:
            met = r["speedup_vs_cudnn"] >= value
        elif kind == "copy_fraction":
            met = r["copy_fraction"] >= value
        target = "" if kind is None else f"target {kind} >= {value}: {'met' if met else 'NOT met'}"
        print(f"  {problem:<16}{r['config']:<40}{r['median_ms']:8.3f} ms  {target}")
        out[problem] = dict(
            config=r["config"],
            block_sizes=r.get("block_sizes"),
            median_ms=r["median_ms"],
            target=kind,
            target_value=value,
            target_met=met,
        )
    return out


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.budget_s
    selected = problems(args.quick)
    if args.problems:
        wanted = [w.strip() for w in args.problems.split(",") if w.strip()]
        selected = [p for p in selected if any(w in p.name for w in wanted)]
    device = jax.devices()[0]
    print(f"# tune_attention on {device.device_kind} (jax {jax.__version__})")
    ceilings = harness.measure_ceilings(quick=args.quick)
    print(
        f"copy {ceilings.copy_gbps:.0f} GB/s, bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s "
        f"({time.perf_counter() - start:.0f} s)"
    )
    rows: list[dict] = []
    for p in selected:
        print(f"\n{p.name}: T={p.num_tokens} B={len(p.q_lens)} L={p.cache_len} ", end="")
        print(f"Hq={p.num_q_heads} Hkv={p.num_kv_heads} D={p.head_dim}")
        problem_rows = run_problem(p, ceilings, args, deadline)
        gc.collect()  # the problem's caches (32 GiB for decode-256) go before the next
        print_rows(problem_rows)
        rows += problem_rows
        print(f"  ({time.perf_counter() - start:.0f} s elapsed)")
    print(f"\n## all problems ({time.perf_counter() - start:.0f} s)")
    print_rows(rows)
    best = summary(rows)
    if args.out:
        payload = dict(
            title="tune_attention",
            device=device.device_kind,
            platform=device.platform,
            jax=jax.__version__,
            ceilings=dataclasses.asdict(ceilings),
            wall_s=time.perf_counter() - start,
            rows=rows,
            best=best,
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(payload, indent=2, default=str))
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
