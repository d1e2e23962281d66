"""Where one serving step's device time goes, kernel by kernel (GPU).

``PYTHONPATH=. python3 tools/profile_step.py [--model bamba-9b] [--pattern MMMM*] [--rows 256]``
``[--context 4096] [--prompt 0] [--prompts N,N,...] [--bucket-policy P] [--impl auto]``
``[--tp 1] [--top 25] [--trace-dir DIR] [--timeline] [--host]``

Builds a model of one of ``benchmarks.model``'s shapes (Bamba-9B by default) with the given
layer pattern (random init, bf16; a few
layers stand for the 32, each layer kind costing the same per layer), one engine step of
``rows`` sequences (decode rows with ``context`` cached tokens, or ``--prompt N`` new tokens
per sequence, or ``--prompts`` of the given lengths in the engine's default token buckets),
times it, then runs it under ``jax.profiler`` with a Perfetto trace and sums
the device ops' time by name. Nsight Systems does not run on the GPU machines; this does.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels as pk
from benchmarks import harness
from benchmarks.model import MODELS, _mesh
from flax_models.model import HybridLM
from flax_models.serving.batching import Request
from flax_models.serving.engine import Engine
from pallas_kernels.metadata import TOKEN_BUCKET_POLICIES


def trace_events(trace_dir: Path) -> tuple[list[dict], list[dict]]:
    """(device, host) complete events of the Perfetto trace, each in time order. Device
    events are the GPU tracks' (every track on a machine without GPU tracks, so a CPU run
    still says something); host events the rest."""
    path = next(trace_dir.rglob("perfetto_trace.json.gz"))
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    processes = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    device = {pid for pid, name in processes.items() if "GPU" in name or "/device:" in name}
    if not device:
        device = set(processes)
    spans = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    return (
        [e for e in spans if e["pid"] in device],
        [e for e in spans if e["pid"] not in device],
    )


def host_thread_times(events: list[dict]) -> list[str]:
    """Per host thread: its busy span (the union of its top-level events) and the events
    that took the most time on it, inclusive of what they call (ms over the whole trace)."""
    lines = []
    for thread in sorted({(e["pid"], e["tid"]) for e in events}):
        track = [e for e in events if (e["pid"], e["tid"]) == thread]
        busy, end = 0.0, float("-inf")
        for e in track:  # time order: an event inside the previous one adds nothing
            start, stop = e["ts"], e["ts"] + e.get("dur", 0)
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
        if busy < 100:
            continue
        total, calls = device_op_times(track)
        lines.append(f"host thread {thread}: {busy / 1e3:.3f} ms busy")
        lines += [
            f"  {us / 1e3:9.3f} ms {calls[name]:6d}x  {name[:100]}"
            for name, us in total.most_common(12)
        ]
    return lines


def device_op_times(events: list[dict]) -> tuple[collections.Counter, collections.Counter]:
    """(total µs, calls) per op name."""
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        total[e["name"]] += e.get("dur", 0)
        calls[e["name"]] += 1
    return total, calls


def step_timeline(events: list[dict], steps: int) -> list[str]:
    """One line per kernel of the middle profiled step on the busiest device track: start
    and idle gap before it (µs from the step's first kernel), duration and name. The gaps
    are what a back-to-back step loses between kernels."""
    tracks = collections.Counter((e["pid"], e["tid"]) for e in events)
    busiest = tracks.most_common(1)[0][0]
    track = [e for e in events if (e["pid"], e["tid"]) == busiest]
    per_step = len(track) // steps
    step = track[per_step * (steps // 2) : per_step * (steps // 2 + 1)]
    lines, end = [], step[0]["ts"]
    for e in step:
        start, dur = e["ts"] - step[0]["ts"], e.get("dur", 0)
        lines.append(f"{start:9.1f} gap {e['ts'] - end:6.1f} dur {dur:7.1f}  {e['name'][:90]}")
        end = max(end, e["ts"] + dur)
    busy = sum(e.get("dur", 0) for e in step)
    lines.append(f"step: {end - step[0]['ts']:.1f} µs from first to last kernel, {busy:.1f} busy")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bamba-9b", choices=sorted(MODELS))
    parser.add_argument("--pattern", default="MMMM*", help="layer kinds (M * - E P)")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=0, help="new tokens per sequence")
    parser.add_argument(
        "--prompts",
        type=lambda text: [int(n) for n in text.split(",")],
        default=None,
        help="a ragged prefill: comma-separated prompt lengths (overrides --rows, --prompt)",
    )
    parser.add_argument(
        "--bucket-policy",
        choices=TOKEN_BUCKET_POLICIES,
        default=None,
        help="--prompts' token buckets (pk.token_buckets' policy; the engine's by default)",
    )
    parser.add_argument("--impl", default="auto")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel over N devices")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--trace-dir", default="/tmp", help="the trace goes in a new folder here")
    parser.add_argument(
        "--timeline", action="store_true", help="also list one step's kernels in order, with gaps"
    )
    parser.add_argument(
        "--host", action="store_true", help="also list each host thread's busiest events"
    )
    args = parser.parse_args()

    cfg = MODELS[args.model](layer_pattern=args.pattern)
    model = HybridLM(
        cfg, dtype=jnp.bfloat16, implementation=args.impl, rngs=nnx.Rngs(0), mesh=_mesh(args.tp)
    )
    rng = np.random.default_rng(0)
    if args.prompts:
        args.rows, args.prompt = len(args.prompts), max(args.prompts)
        engine = Engine(
            model,
            max_slots=args.rows,
            max_len=args.prompt,
            token_budget=sum(args.prompts),
            decode_buckets=(args.rows,),
            max_prefill_seqs=args.rows,
            token_buckets=(
                None
                if args.bucket_policy is None
                else pk.token_buckets(sum(args.prompts), policy=args.bucket_policy)
            ),
        )
        prompts = [list(rng.integers(0, cfg.vocab_size, n)) for n in args.prompts]
        arrays = engine.builder.build([], [Request(s, p, 0) for s, p in enumerate(prompts)])
    elif args.prompt:
        tokens = args.rows * args.prompt
        engine = Engine(
            model,
            max_slots=args.rows,
            max_len=args.prompt,
            token_budget=tokens,
            decode_buckets=(args.rows,),
            max_prefill_seqs=args.rows,
            token_buckets=(tokens,),
        )
        prompts = [list(rng.integers(0, cfg.vocab_size, args.prompt)) for _ in range(args.rows)]
        arrays = engine.builder.build([], [Request(s, p, 0) for s, p in enumerate(prompts)])
    else:
        engine = Engine(
            model,
            max_slots=args.rows,
            max_len=args.context + 1,
            token_budget=16,
            decode_buckets=(args.rows,),
            token_buckets=(16,),
        )
        decode = [
            Request(s, [int(rng.integers(cfg.vocab_size))], args.context) for s in range(args.rows)
        ]
        arrays = engine.builder.build(decode, [])
    # Back to back, as Engine.stream launches them, and one at a time (waiting for each).
    chained = harness.time_fn(lambda: engine.step(arrays, wait=False), warmup=2, samples=10)
    waited = harness.time_fn(lambda: engine.step(arrays), warmup=2, samples=10)
    launches = []
    for _ in range(20):  # the host's share: from the call to the step being launched
        jax.block_until_ready(engine.step(arrays))
        start = time.perf_counter()
        logits = engine.step(arrays, wait=False)
        launches.append((time.perf_counter() - start) * 1e3)
        jax.block_until_ready(logits)
    kind = f"prefill {args.rows}x{args.prompt}" if args.prompt else f"decode {args.rows} rows"
    if args.prompts:
        kind = f"prefill of {arrays.num_tokens} tokens in a {arrays.bucket[1]}-token bucket"
    print(
        f"{args.model} {args.pattern} {args.impl} tp={args.tp} {kind}, context {args.context}: "
        f"{chained.median_ms:.3f} ms a step back to back, {waited.median_ms:.3f} ms waiting "
        f"for each, {statistics.median(launches):.3f} ms to launch one"
    )

    trace_dir = Path(tempfile.mkdtemp(prefix="run_", dir=args.trace_dir))  # this run's only
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(args.steps):
            logits = engine.step(arrays, wait=False)
        jax.block_until_ready(logits)
    events, host = trace_events(trace_dir)
    total, calls = device_op_times(events)
    # Every device's ops land in the trace: per device, averaged over the devices.
    runs = args.steps * args.tp
    overall = sum(total.values()) / runs
    print(f"device ops: {overall / 1e3:.3f} ms per step (per device)")
    for name, us in total.most_common(args.top):
        print(f"  {us / runs / 1e3:9.3f} ms {calls[name] // runs:5d}x  {name[:110]}")
    if args.timeline:
        print("\n".join(step_timeline(events, args.steps)))
    if args.host:
        print(f"host, over {args.steps} steps:")
        print("\n".join(host_thread_times(host)))


if __name__ == "__main__":
    main()
