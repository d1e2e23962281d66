"""Prefix caching benchmark: Bamba-9B's shape (random init, bf16) served with and without
a prefix cache.

``PYTHONPATH=. python3 -m benchmarks.prefix [--out FILE] [--results-dir DIR] [--quick]``. Two
traces, each run twice on one engine (``Engine(prefix_caching=True)``; the uncached run switches
lookups and publishing off with ``use_prefix_cache(False)``, same compiled programs, so
both runs time the same kernels and only the work skipped differs). The uncached run is a
baseline of the lookups, not an engine built without prefix caching: its Mamba prefill
still runs the snapshot path (every chunk's state kept, the snapshot gathers and scatters
run, writing no entry), which a ``prefix_caching=False`` engine's plain scan does not:

- ``shared-prefix``: 64 requests arriving together, one 4096-token prefix (16 blocks of
  256) and a unique 128-token suffix each, one generated token (time to first token is
  the prefill). Targets: total prefill time with caching ≤ 1/8 of without; every request
  after the first hits ≥ 3840 of its 4096 prefix tokens.
- ``chat``: 16 conversations × 4 turns over a shared 512-token system prompt; each turn
  appends ~200 user tokens (random lengths 150-250) to the conversation so far and
  generates a 64-token reply (greedy), so turn t's prompt is turn t-1's prompt, reply and
  the new user message. One generation per turn for all conversations.

Rows: total prefill time (the engine's ``prefill_seconds``: step time shared by tokens,
decode excluded), prompt tokens and those computed, hit rate (prompt tokens taken from the
cache / prompt tokens), TTFT p50/p99 (from the generation's start to each request's first
token, queueing included) and wall time, one per trace and run (``bamba-9b/chat/cached``);
the JSON (the harness's schema, no ceilings) is rewritten after each trace.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import harness
from flax_models.config import HybridConfig
from flax_models.model import HybridLM
from flax_models.serving.engine import Engine
from flax_models.serving.sampling import SamplingParams

# Trace sizes: (full run, --quick CPU smoke run).
SHARED = dict(
    full=dict(requests=64, prefix=4096, suffix=128), quick=dict(requests=8, prefix=64, suffix=8)
)
CHAT = dict(
    full=dict(conversations=16, turns=4, system=512, user=(150, 250), reply=64),
    quick=dict(conversations=3, turns=3, system=32, user=(6, 12), reply=4),
)


def engine_options(quick: bool) -> dict:
    """One engine for both traces. Buckets: prefill steps of up to 4096 tokens (a 2048
    bucket for the cached steps' short suffixes) and 16 decode rows, five programs in all
    (compiled by ``warmup``). The pool holds every block of both traces (no eviction);
    96 snapshots hold the shared prefix's 16 and the chat's ~80 block ends."""
    if quick:
        return dict(
            max_slots=4,
            max_len=256,
            token_budget=64,
            token_buckets=(32, 64),
            decode_buckets=(4,),
            prefix_caching=True,
            num_prefix_snapshots=32,
        )
    return dict(
        max_slots=16,
        max_len=4352,
        token_budget=4096,
        token_buckets=(2048, 4096),
        decode_buckets=(16,),
        num_kv_blocks=1024,
        prefix_caching=True,
        num_prefix_snapshots=96,
    )


def run_trace(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Generates for ``prompts`` (all arriving at once); the run's measurements and its
    tokens."""
    before = dict(engine.stats)
    start = time.perf_counter()
    events = engine.stream(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    ttft: dict[int, float] = {}
    generated: list[list[int]] = [[] for _ in prompts]
    for event in events:
        ttft.setdefault(event.index, time.perf_counter() - start)
        generated[event.index].append(event.token)
    wall = time.perf_counter() - start
    delta = {k: engine.stats[k] - before[k] for k in before}
    return dict(
        wall_s=wall,
        prefill_s=delta["prefill_seconds"],
        prompt_tokens=sum(len(p) for p in prompts),
        computed_prompt_tokens=delta["prefill_tokens"],
        hit_tokens=delta["prefix_hit_tokens"],
        ttft_s=[ttft[i] for i in range(len(prompts))],
        request_hits=[events.prefix_hits.get(i, 0) for i in range(len(prompts))],
        tokens=generated,
    )


def summarize(runs: list[dict]) -> dict:
    """One row from the runs of a trace (the chat's turns)."""
    ttft = np.concatenate([r["ttft_s"] for r in runs]) * 1e3
    prompt = sum(r["prompt_tokens"] for r in runs)
    hits = sum(r["hit_tokens"] for r in runs)
    return dict(
        prefill_s=sum(r["prefill_s"] for r in runs),
        wall_s=sum(r["wall_s"] for r in runs),
        prompt_tokens=prompt,
        computed_prompt_tokens=sum(r["computed_prompt_tokens"] for r in runs),
        hit_tokens=hits,
        hit_rate=hits / prompt,
        ttft_p50_ms=float(np.percentile(ttft, 50)),
        ttft_p99_ms=float(np.percentile(ttft, 99)),
    )


def shared_prefix(engine: Engine, rng: np.random.Generator, sizes: dict) -> dict:
    vocab = engine.cfg.vocab_size
    prefix = rng.integers(0, vocab, sizes["prefix"]).tolist()
    prompts = [
        prefix + rng.integers(0, vocab, sizes["suffix"]).tolist() for _ in range(sizes["requests"])
    ]
    rows = {}
    for cached in (False, True):
        engine.use_prefix_cache(cached)
        run = run_trace(engine, prompts, 1)
        row = summarize([run])
        later = run["request_hits"][1:]  # the requests after the first (admitted first)
        row |= dict(
            min_later_prefix_hit=min(later), later_hits_ge_3840=int(sum(h >= 3840 for h in later))
        )
        rows["cached" if cached else "uncached"] = row | dict(tokens=run["tokens"])
    return rows


def chat(engine: Engine, rng: np.random.Generator, sizes: dict) -> dict:
    vocab = engine.cfg.vocab_size
    system = rng.integers(0, vocab, sizes["system"]).tolist()
    users = [
        [
            rng.integers(0, vocab, int(rng.integers(*sizes["user"]))).tolist()
            for _ in range(sizes["turns"])
        ]
        for _ in range(sizes["conversations"])
    ]
    rows = {}
    for cached in (False, True):
        engine.use_prefix_cache(cached)
        history = [list(system) for _ in users]
        runs = []
        for turn in range(sizes["turns"]):
            prompts = [h + u[turn] for h, u in zip(history, users, strict=True)]
            run = run_trace(engine, prompts, sizes["reply"])
            history = [p + t for p, t in zip(prompts, run["tokens"], strict=True)]
            runs.append(run)
        rows["cached" if cached else "uncached"] = summarize(runs) | dict(
            turn_hit_rates=[r["hit_tokens"] / r["prompt_tokens"] for r in runs],
            tokens=[r["tokens"] for r in runs],
        )
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict]:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
    args = harness.parse_args(argv, "prefix caching benchmark", module="prefix")
    mode = "quick" if args.quick else "full"
    model = "tiny" if args.quick else "bamba-9b"
    cfg = HybridConfig.tiny() if args.quick else HybridConfig.bamba_9b()
    dtype = jnp.float32 if args.quick else jnp.bfloat16
    # What every row carries: the engine (one for both traces) and its start-up.
    setup: dict = dict(
        model=model,
        dtype=jnp.dtype(dtype).name,
        engine={
            k: list(v) if isinstance(v, tuple) else v for k, v in engine_options(args.quick).items()
        },
    )
    rows: list[dict] = []

    start = time.perf_counter()
    hybrid = HybridLM(cfg, dtype=dtype, implementation="auto", rngs=nnx.Rngs(0))
    engine = Engine(hybrid, **engine_options(args.quick))
    setup["block_size"] = engine.block_size
    setup["init_s"] = time.perf_counter() - start
    start = time.perf_counter()
    setup["programs"] = engine.warmup()
    setup["compile_s"] = time.perf_counter() - start
    init, programs, compile_s = setup["init_s"], setup["programs"], setup["compile_s"]
    print(f"init {init:.1f} s, {programs} programs in {compile_s:.1f} s", flush=True)

    # One row per trace and run (``<model>/<trace>/uncached``, ``.../cached``); the cached
    # row also compares the two. The JSON is rewritten after each trace.
    rng = np.random.default_rng(0)
    for name, trace, sizes in (("shared-prefix", shared_prefix, SHARED), ("chat", chat, CHAT)):
        runs = trace(engine, rng, sizes[mode])
        tokens = [runs[k].pop("tokens") for k in ("uncached", "cached")]
        cached = runs["cached"]
        cached["same_tokens"] = tokens[0] == tokens[1]
        cached["prefill_speedup"] = runs["uncached"]["prefill_s"] / cached["prefill_s"]
        if name == "shared-prefix":
            cached["targets"] = dict(
                prefill_ratio=1 / cached["prefill_speedup"],
                prefill_ratio_ok=cached["prefill_speedup"] >= 8,
                later_hits_ok=cached["min_later_prefix_hit"] >= (3840 if not args.quick else 0),
            )
        for run in ("uncached", "cached"):
            rows.append(
                dict(
                    problem=f"{model}/{name}/{run}",
                    implementation="auto",
                    trace=name,
                    prefix_cache=run == "cached",
                    **runs[run],
                    **setup,
                    peak_bytes=harness.peak_bytes(),
                )
            )
        harness.write_report(rows, None, args.output)
        _print(name, runs)
    print(json.dumps(rows[1].get("targets"), indent=1))
    return rows


def _print(name: str, rows: dict) -> None:
    speedup = rows["cached"]["prefill_speedup"]
    same = rows["cached"]["same_tokens"]
    print(f"\n## {name} (same tokens: {same}, prefill speedup {speedup:.1f}x)")
    print(
        f"{'run':<10}{'prefill s':>10}{'computed':>10}{'prompt':>10}{'hit rate':>10}"
        f"{'TTFT p50 ms':>13}{'p99 ms':>10}{'wall s':>8}"
    )
    for run in ("uncached", "cached"):
        r = rows[run]
        print(
            f"{run:<10}{r['prefill_s']:>10.3f}{r['computed_prompt_tokens']:>10}{r['prompt_tokens']:>10}"
            f"{r['hit_rate']:>10.1%}{r['ttft_p50_ms']:>13.1f}{r['ttft_p99_ms']:>10.1f}{r['wall_s']:>8.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
