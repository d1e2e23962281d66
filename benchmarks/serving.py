"""Serving benchmark: an offline trace of 512 requests on Bamba-9B's shape (random init,
bf16, ``implementation="auto"``) through one ``Engine.stream`` call.

``python -m benchmarks.serving [--out FILE] [--results-dir DIR] [--quick] [--bucket-policy
pow2|sqrt2|linear] [--bucket-step N] [--max-slots N] [--decode-buckets ROWS ...]
[--max-prefill-seqs N] [--mamba-ssm-cache-dtype float32|bfloat16] [--startup]``.

The trace (seed 0, ``TRACES``): 512 requests, all submitted at t = 0 in one
``Engine.stream(prompts, [SamplingParams(max_new_tokens=n), ...])`` call (an offline
trace: no arrivals over time, so TTFT includes the wait for a free slot). Prompt lengths
are log-normal, median 1024 tokens, σ = 0.8 (of the log), rounded and clipped to
[64, 4096] (674,283 prompt tokens); output lengths (``max_new_tokens``) are uniform
integers in [64, 512] (150,812 output tokens); token ids are uniform in the vocabulary.
No eos: every request generates exactly ``max_new_tokens`` tokens, so the schedule (which
steps run, in which buckets) does not depend on the model's outputs, and runs are
comparable. ``--quick``: the tiny model (fp32; on a CPU ``auto`` is the ``xla`` path), 32
requests of 4-32 prompt and 2-6 output tokens, 4 slots, a 16-token budget, one decode
and one token bucket (three programs).

Engine (``engine_options``): 256 slots of ``max_len`` 4608 (4096 + 512) tokens, a token
budget of 8192 tokens per step (prompt tokens get what the decode rows leave), decode
buckets 1, 2, 4, ..., 256 (the engine's default; ``--decode-buckets`` to change) and token
buckets ``pk.token_buckets(8192, policy=--bucket-policy, step=--bucket-step)``, the
engine's default policy (``DEFAULT_TOKEN_BUCKET_POLICY``, sqrt2) unless given. Memory on
the device: 18 GB of weights, per slot 121 MB of SSM states (29 Mamba layers × 128 heads ×
64 × 128 × fp32) and 57 MB of KV pages (3 attention layers × 4608 tokens × 8 heads × 128 ×
K and V in bf16), 64 GB in all beside the step's transients: an H200 (``--max-slots 128``:
41 GB, for an 80 GB H100). ``--mamba-ssm-cache-dtype bfloat16``: the states in bf16 (61 MB
a slot; the row's problem gains ``/ssm-bfloat16``), the engine's ``mamba_ssm_cache_dtype``;
prefill steps hold ``--max-prefill-seqs`` prompts at most (the engine's default, 16).

Measurement: ``Engine.warmup`` compiles the programs the trace uses (one per (decode
bucket, token bucket) of the schedule, from the analysis below, in parallel threads;
``compile_s``), then the identical trace runs twice on one engine (the schedule is the
same in both runs, see above): the first is reported as ``warmup_s`` (with
``compiles_in_warmup_run``, a program the analysis missed), the second is measured
(``compiles_in_measured_run`` says it compiled nothing). Each
``TokenEvent`` is timestamped with ``time.perf_counter()`` as it arrives; per request,
TTFT = first token time − the call's start and TPOT = (last − first) / (n − 1). Reported:
output tokens/s and total (prompt + output) tokens/s over the run's wall time, TTFT and
TPOT p50/p99, steps, ``engine.compile_count``, ``engine.stats`` of the run (prefill and
decode tokens and seconds) and the padding: ``engine.step_buckets`` counts the run's steps
per (decode bucket, token bucket); padding fraction = 1 − real tokens / Σ steps ×
(decode bucket + token bucket). Padding decode rows cost little (the state update and
attention skip them; a decode step's matmuls are bound by reading the weights), padding
prompt tokens cost what real ones do, so ``prefill_padding_fraction`` (token buckets
alone) is given beside it.

Start-up (``--startup``): the programs the trace uses (its step buckets, from the analysis
below) compiled by ``Engine.warmup(buckets=...)`` in a fresh process, twice: first from an
empty JAX persistent compilation cache (``startup.cold``), then with the cache that run
filled (``startup.warm``, what a restarted server pays), each with the engine's executable
cache beside it (``<cache>/executables``: a warm start loads the step programs untraced).
Each probe reports the model's initialisation and the warm-up apart. The measured process
then takes the filled cache.

Bucket policy analysis (``bucket_analysis``, printed and stored as ``bucket_policies``;
the JSON is written once it is done, so a run cut short keeps it): for pow2, sqrt2 and
linear with steps 2048 and 1024 (and the run's own token buckets if none of those), the
programs the trace uses, the full grid (``len(engine.builder.buckets())``, what
``warmup()`` would compile), the steps and the padding fractions, at the run's engine
settings. The schedule depends only on request lengths and engine settings, so it is
computed on the host without a model, in seconds: the real scheduler (``Engine.stream``)
and batch builder run over the trace with only the device step replaced by a stub that
takes the step's KV pages and returns token 0 for every row (``_ScheduleOnly``; the tiny
model stands in for the configuration, with the run's slots, ``max_len``, budget, buckets
and KV block size). The measured run checks this: ``schedule_matches_analysis`` compares
its ``step_buckets`` with the analysis of its own buckets.

JSON: the harness's schema, one row per trace and bucket policy
(``<model>/offline-<requests>/<policy>``: the measured run's wall time against a roofline
floor of the trace, see ``_cost``), the row's ``serving`` holding the trace's parameters,
the engine settings, the run's figures, ``bucket_policies`` and ``requests`` (per request:
``prompt_len``, ``output_len``, ``ttft_s``, ``tpot_s``) for ``benchmarks.plots``
(``python -m benchmarks.plots benchmarks/results/nvidia_h200/serving.json``: TTFT and TPOT
CDFs).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels as pk
from benchmarks import harness
from flax_models.config import HybridConfig
from flax_models.model import HybridLM
from flax_models.serving.batching import StepArrays
from flax_models.serving.engine import DEFAULT_TOKEN_BUCKET_POLICY, Engine
from flax_models.serving.executables import beside_compilation_cache
from flax_models.serving.sampling import SamplingParams

# The traces (see the module docstring). Prompt lengths: round(exp(N(log median, sigma²)))
# clipped to ``prompt_range``; output lengths: uniform integers in ``output_range``
# (both ends included).
TRACES = dict(
    full=dict(
        requests=512,
        prompt_median=1024,
        prompt_sigma=0.8,
        prompt_range=(64, 4096),
        output_range=(64, 512),
        seed=0,
    ),
    quick=dict(
        requests=32,
        prompt_median=12,
        prompt_sigma=0.8,
        prompt_range=(4, 32),
        output_range=(2, 6),
        seed=0,
    ),
)
# The policies the analysis compares: (policy, linear step).
ANALYSIS_POLICIES: tuple[tuple[str, int | None], ...] = (
    ("pow2", None),
    ("sqrt2", None),
    ("linear", 2048),
    ("linear", 1024),
)


def make_trace(vocab_size: int, spec: dict[str, Any]) -> tuple[list[list[int]], list[int]]:
    """``(prompts, max_new_tokens)`` of the trace ``spec`` (one of ``TRACES``)."""
    rng = np.random.default_rng(spec["seed"])
    n = spec["requests"]
    low, high = spec["prompt_range"]
    lengths = np.exp(rng.normal(np.log(spec["prompt_median"]), spec["prompt_sigma"], n))
    lengths = np.clip(np.rint(lengths), low, high).astype(int)
    outputs = rng.integers(spec["output_range"][0], spec["output_range"][1] + 1, n)
    prompts = [rng.integers(0, vocab_size, int(length)).tolist() for length in lengths]
    return prompts, [int(o) for o in outputs]


def engine_options(
    quick: bool,
    *,
    policy: str = DEFAULT_TOKEN_BUCKET_POLICY,
    step: int | None = None,
    max_slots: int | None = None,
    decode_buckets: Sequence[int] | None = None,
    max_prefill_seqs: int | None = None,
    mamba_ssm_cache_dtype: str = "float32",
) -> dict[str, Any]:
    """The engine's settings (module docstring): token buckets from ``policy``, decode
    buckets powers of two up to the slots unless given, the engine's default prefill
    sequence rows unless given."""
    spec = TRACES["quick" if quick else "full"]
    max_len = spec["prompt_range"][1] + spec["output_range"][1]
    slots = max_slots or (4 if quick else 256)
    budget = 16 if quick else 8192
    if decode_buckets is None:
        # --quick: one decode bucket and one token bucket: three programs to compile on a CPU.
        decode_buckets = (slots,) if quick else pk.sequence_buckets(slots)
    return dict(
        max_slots=slots,
        max_len=max_len,
        token_budget=budget,
        decode_buckets=tuple(sorted(decode_buckets)),
        token_buckets=pk.token_buckets(budget, policy=policy, step=step),
        max_prefill_seqs=max_prefill_seqs,
        mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
    )


# ----------------------------------------------------------------------- the schedule


class _ScheduleOnly(Engine):
    """An engine that plans, builds and counts its steps but runs none: each step takes
    its KV pages (admission waits on them) and "samples" token 0 on every row, on the host.
    With no eos, its schedule is the real one's."""

    def _launch(self, arrays: StepArrays, sampling=None, restore_ids=None, snapshots=None, *,
                logprobs: bool = False) -> tuple[None, np.ndarray, None]:  # fmt: skip
        del sampling, restore_ids, snapshots, logprobs
        self.scheduler.ensure_pages(arrays)
        return None, np.zeros(arrays.slot_ids.shape[0], np.int32), None


def _tiny_model() -> HybridLM:
    return HybridLM(HybridConfig.tiny(), dtype=jnp.float32, implementation="xla", rngs=nnx.Rngs(0))


def padding_fractions(
    step_buckets: dict[tuple[int, int], int], stats: dict[str, float]
) -> tuple[float, float]:
    """``(all, prompt)``: 1 − real tokens (decode rows and prompt tokens, from ``stats``) /
    the tokens the steps' buckets hold; the same for prompt tokens and token buckets."""
    held = sum(steps * (d + t) for (d, t), steps in step_buckets.items())
    held_prompt = sum(steps * t for (_, t), steps in step_buckets.items())
    real = stats["decode_tokens"] + stats["prefill_tokens"]
    return (
        1.0 - real / held if held else 0.0,
        1.0 - stats["prefill_tokens"] / held_prompt if held_prompt else 0.0,
    )


def schedule(
    lengths: Sequence[int],
    outputs: Sequence[int],
    options: dict[str, Any],
    block_size: int,
    *,
    model: HybridLM | None = None,
) -> tuple[collections.Counter, dict[str, float], int]:
    """The steps the trace runs under ``options`` (on the host, ``_ScheduleOnly``; ``model``
    only configures the engine, the tiny one by default): ``(step_buckets, engine.stats
    (its token counts), full grid size)``."""
    if model is None:
        model = _tiny_model()
    engine = _ScheduleOnly(model, kv_block_size=block_size, **options)
    prompts = [[0] * n for n in lengths]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in outputs]
    for _ in engine.stream(prompts, params, progress=False):
        pass
    return collections.Counter(engine.step_buckets), engine.stats, len(engine.builder.buckets())


def bucket_analysis(
    lengths: Sequence[int],
    outputs: Sequence[int],
    options: dict[str, Any],
    *,
    block_size: int,
    compare: bool = True,
) -> list[dict[str, Any]]:
    """Programs used, full grid and padding fraction of each ``ANALYSIS_POLICIES`` entry
    (and of the engine's own token buckets when they are none of them): the engine
    ``options`` with their token buckets replaced by the policy's. ``compare=False``: the
    engine's own buckets alone (each schedule takes about 5 s of host time on the full
    trace)."""
    model = _tiny_model()
    results = []
    budget = options["token_budget"]
    candidates = [
        (policy, step, pk.token_buckets(budget, policy=policy, step=step))
        for policy, step in (ANALYSIS_POLICIES if compare else ())
        if step is None or step < budget  # (else the same buckets as pow2)
    ]
    if all(tokens != options["token_buckets"] for _, _, tokens in candidates):
        candidates.append(("engine", None, tuple(options["token_buckets"])))
    for policy, step, tokens in candidates:
        buckets, stats, grid = schedule(
            lengths, outputs, options | dict(token_buckets=tokens), block_size, model=model
        )
        results.append(
            dict(
                policy=policy,
                step=step,
                token_buckets=list(tokens),
                programs=len(buckets),
                grid=grid,
                steps=sum(buckets.values()),
                padding_fraction=padding_fractions(buckets, stats)[0],
                prefill_padding_fraction=padding_fractions(buckets, stats)[1],
                step_buckets=_bucket_list(buckets),
            )
        )
    return results


def _bucket_list(buckets: dict[tuple[int, int], int]) -> list[list[int]]:
    """``step_buckets`` as JSON: ``[[decode bucket, token bucket, steps], ...]``, sorted."""
    return [[d, t, n] for (d, t), n in sorted(buckets.items())]


# ------------------------------------------------------------------------ the runs


def serve(engine: Engine, prompts: list[list[int]], outputs: list[int]) -> dict[str, Any]:
    """One run of the trace through one ``stream`` call: timings and per-request times."""
    stats_before = dict(engine.stats)
    buckets_before = collections.Counter(engine.step_buckets)
    compiles_before = engine.compile_count
    params = [SamplingParams(max_new_tokens=n, temperature=0.0) for n in outputs]
    first = [0.0] * len(prompts)
    last = [0.0] * len(prompts)
    counts = [0] * len(prompts)
    start = time.perf_counter()
    for event in engine.stream(prompts, params, progress=False):
        now = time.perf_counter()
        if not counts[event.index]:
            first[event.index] = now
        last[event.index] = now
        counts[event.index] += 1
    wall = time.perf_counter() - start
    if counts != outputs:
        raise RuntimeError("a request generated other than max_new_tokens tokens (eos?)")
    stats = {k: engine.stats[k] - stats_before[k] for k in stats_before}
    buckets = collections.Counter(engine.step_buckets)
    buckets.subtract(buckets_before)
    buckets = collections.Counter({k: v for k, v in buckets.items() if v})
    ttft = [f - start for f in first]
    tpot = [
        (b - a) / (n - 1) if n > 1 else float("nan")
        for a, b, n in zip(first, last, counts, strict=True)
    ]
    return dict(
        wall_s=wall,
        compiles=engine.compile_count - compiles_before,
        stats=stats,
        step_buckets=buckets,
        ttft_s=ttft,
        tpot_s=tpot,
    )


def _percentiles(values: Sequence[float], scale: float = 1e3) -> tuple[float, float]:
    finite = np.asarray([v for v in values if np.isfinite(v)]) * scale
    if not finite.size:
        return float("nan"), float("nan")
    return float(np.percentile(finite, 50)), float(np.percentile(finite, 99))


def _cost(
    model: HybridLM,
    steps: int,
    prompt_tokens: int,
    output_tokens: int,
    decode_rows: int,
    state_itemsize: int = 4,
):
    """(FLOPs, bytes) floor of the whole trace: 2 FLOPs per matmul weight per computed token
    (the embedding table is gathered from; the vocabulary projection runs for the sampled
    rows only, one per output token), attention ignored; every step reads every weight
    once (the untied embedding table excepted) and every decode row reads and writes its
    SSM states (``state_itemsize`` bytes an element)."""
    cfg = model.cfg
    params = nnx.state(model, nnx.Param)
    leaves = jax.tree.leaves(params)
    count = sum(leaf.size for leaf in leaves)
    nbytes = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    table = cfg.vocab_size * cfg.hidden_size
    tied = model.lm_head is None
    matmul = count - table * (1 if tied else 2)  # the head is counted per sampled row
    if not tied:
        nbytes -= table * jnp.dtype(model.dtype).itemsize  # rows looked up only
    computed = prompt_tokens + decode_rows  # a decode row computes one token
    flops = 2.0 * matmul * computed + 2.0 * table * output_tokens
    state = cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.mamba_state_size * state_itemsize
    mamba_layers = cfg.layer_pattern.count("M")
    bytes_moved = steps * nbytes + decode_rows * 2 * state * mamba_layers
    return flops, float(bytes_moved)


# ------------------------------------------------------------------------ start-up


def _build(cfg: HybridConfig, dtype: Any, options: dict[str, Any]) -> tuple[HybridLM, Engine]:
    """The benchmark's model (random init) and engine."""
    model = HybridLM(cfg, dtype=dtype, implementation="auto", rngs=nnx.Rngs(0))
    return model, Engine(model, kv_block_size=cfg.mamba_chunk_size, **options)


def _startup_probe(
    cfg: HybridConfig, dtype: Any, options: dict[str, Any], buckets: list[list[int]]
) -> None:
    """In a fresh process (``--startup-probe``): the model, the engine and the warm-up of
    ``buckets``, timed apart; one ``STARTUP {json}`` line on stdout, after the engine's
    warm-up log (its lines on stderr)."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    # The compiled step programs beside the compilation cache, as the server keeps them.
    cache_dir = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if cache_dir:
        options = dict(options, executable_cache_dir=beside_compilation_cache(cache_dir))
    start = time.perf_counter()
    _, engine = _build(cfg, dtype, options)
    jax.block_until_ready(engine.runner.caches)
    init_s = time.perf_counter() - start
    start = time.perf_counter()
    programs = engine.warmup(buckets=[tuple(b) for b in buckets], progress=False)
    warmup_s = time.perf_counter() - start
    loaded = engine.runner.loaded_count
    print(
        "STARTUP "
        + json.dumps(dict(init_s=init_s, warmup_s=warmup_s, programs=programs, loaded=loaded))
    )


def startup(
    argv: Sequence[str], buckets: list[list[int]], cache_dir: str, timeout_s: float = 1800
) -> dict[str, Any]:
    """Cold and warm start-up (module docstring): two probe processes on ``cache_dir``."""
    env = dict(
        os.environ,
        JAX_COMPILATION_CACHE_DIR=cache_dir,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    )
    probe = [
        sys.executable,
        "-m",
        "benchmarks.serving",
        *argv,
        "--startup-probe",
        json.dumps(buckets),
    ]
    result: dict[str, Any] = dict(cache_dir=cache_dir, step_buckets=len(buckets))
    for stage in ("cold", "warm"):
        done = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode:
            raise RuntimeError(f"start-up probe ({stage}) failed:\n{done.stderr[-4000:]}")
        # The engine's warm-up log: lowering against compiling, program by program.
        warmup_log = [line for line in done.stderr.splitlines() if "warmup:" in line]
        print("\n".join(warmup_log), flush=True)
        line = next(line for line in done.stdout.splitlines() if line.startswith("STARTUP "))
        result[stage] = json.loads(line.removeprefix("STARTUP "))
        print(
            f"start-up ({stage} compilation cache): init {result[stage]['init_s']:.1f} s, "
            f"warm-up {result[stage]['warmup_s']:.1f} s ({result[stage]['programs']} programs "
            f"compiled, {result[stage]['loaded']} step programs loaded)",
            flush=True,
        )
    return result


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """This module's options, then the harness's (``--out``, ``--quick``)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "--bucket-policy",
        default=DEFAULT_TOKEN_BUCKET_POLICY,
        choices=pk.metadata.TOKEN_BUCKET_POLICIES,
        help=f"the engine's default, {DEFAULT_TOKEN_BUCKET_POLICY}",
    )
    parser.add_argument("--bucket-step", type=int, default=None, help="linear's step")
    parser.add_argument("--max-slots", type=int, default=None, help="256 (--quick: 4)")
    parser.add_argument(
        "--decode-buckets",
        type=int,
        nargs="+",
        default=None,
        metavar="ROWS",
        help="decode-row buckets (powers of two up to --max-slots by default)",
    )
    parser.add_argument(
        "--max-prefill-seqs",
        type=int,
        default=None,
        metavar="N",
        help="prompts a step computes chunks of (the engine's default)",
    )
    parser.add_argument(
        "--mamba-ssm-cache-dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the SSM state cache's dtype (float32)",
    )
    parser.add_argument(
        "--startup",
        action="store_true",
        help="measure cold and warm start-up (compilation cache) in fresh processes first",
    )
    parser.add_argument(
        "--no-policy-comparison",
        action="store_true",
        help="schedule the engine's own token buckets only, not every policy's",
    )
    parser.add_argument("--startup-probe", default=None, help=argparse.SUPPRESS)
    own, rest = parser.parse_known_args(argv)
    args = harness.parse_args(
        rest, "offline serving trace (TTFT, TPOT, throughput)", module="serving", command=argv
    )
    return argparse.Namespace(**vars(args), **vars(own))


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--online" in argv:  # requests through the HTTP server (benchmarks.serving_online)
        from benchmarks import serving_online

        return serving_online.main([a for a in argv if a != "--online"])
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
    args = _parse(argv)
    quick = args.quick
    if args.startup:
        # The probes run while this process holds the device: it takes memory as it goes.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        # The probes' cache, and this process's unless it has one: set before its first
        # compile (JAX opens its persistent cache then), it loads the probes' programs.
        cache_dir = tempfile.mkdtemp(prefix="serving-compilation-cache-")
        if jax.config.jax_compilation_cache_dir is None:
            jax.config.update("jax_compilation_cache_dir", cache_dir)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    spec = TRACES["quick" if quick else "full"]
    name = "tiny" if quick else "bamba-9b"
    cfg = HybridConfig.tiny() if quick else HybridConfig.bamba_9b()
    dtype = jnp.float32 if quick else jnp.bfloat16
    options = engine_options(
        quick,
        policy=args.bucket_policy,
        step=args.bucket_step,
        max_slots=args.max_slots,
        decode_buckets=args.decode_buckets,
        max_prefill_seqs=args.max_prefill_seqs,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
    )
    if args.startup_probe is not None:
        _startup_probe(cfg, dtype, options, json.loads(args.startup_probe))
        return []
    prompts, outputs = make_trace(cfg.vocab_size, spec)
    lengths = [len(p) for p in prompts]
    prompt_tokens, output_tokens = sum(lengths), sum(outputs)
    block_size = cfg.mamba_chunk_size  # the engine's KV block size (a Mamba model's default)
    title = "offline serving trace"
    serving: dict[str, Any] = dict(
        model=name,
        dtype=jnp.dtype(dtype).name,
        implementation="auto",
        trace=spec | dict(prompt_tokens=prompt_tokens, output_tokens=output_tokens),
        submission="offline: every request at t=0 in one Engine.stream call; no eos",
        engine={k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}
        | dict(
            kv_block_size=block_size, bucket_policy=args.bucket_policy, bucket_step=args.bucket_step
        ),
    )

    label = args.bucket_policy + ("" if args.bucket_step is None else f"-{args.bucket_step}")
    if args.mamba_ssm_cache_dtype != "float32":
        label += f"/ssm-{args.mamba_ssm_cache_dtype}"
    problem = f"{name}/offline-{spec['requests']}/{label}"

    def save(row: dict[str, Any], ceilings: harness.Ceilings | None) -> None:
        """The JSON so far, the trace's one row with its ``serving`` record (rewritten after
        each stage: a run cut short keeps the analysis)."""
        harness.write_report([row | dict(serving=serving)], ceilings, args.output)

    # 1. The bucket policies, on the host (before the model takes the device's memory).
    start = time.perf_counter()
    analysis = bucket_analysis(
        lengths, outputs, options, block_size=block_size, compare=not args.no_policy_comparison
    )
    serving.update(bucket_policies=analysis, bucket_analysis_s=time.perf_counter() - start)
    _print_analysis(analysis, serving["bucket_analysis_s"])
    save(dict(problem=problem, implementation="auto", op="serving"), None)
    gc.collect()

    buckets = list(options["token_buckets"])
    own = next((a for a in analysis if a["token_buckets"] == buckets), None)

    # 2. Start-up, in fresh processes (before this one takes the device's memory).
    if args.startup:
        trace_buckets = [[d, t] for d, t, _ in own["step_buckets"]]
        probe_argv = [a for a in argv if a != "--startup"]
        serving.update(startup=startup(probe_argv, trace_buckets, cache_dir))
        save(dict(problem=problem, implementation="auto", op="serving"), None)

    # 3. The model, the warm-up run (compiles, or loads the start-up's programs) and the
    # measured run.
    ceilings = harness.measure_ceilings(quick=quick)
    start = time.perf_counter()
    model, engine = _build(cfg, dtype, options)
    init_s = time.perf_counter() - start
    serving["engine"]["max_prefill_seqs"] = engine.builder.prefill_seqs
    start = time.perf_counter()
    if own is not None:  # the trace's programs, compiled in parallel (Engine.warmup)
        engine.warmup(buckets=[(d, t) for d, t, _ in own["step_buckets"]], progress=False)
    compile_s = time.perf_counter() - start
    warm = serve(engine, prompts, outputs)
    print(
        f"compiled in {compile_s:.1f} s; warm-up run: {warm['wall_s']:.1f} s, "
        f"{warm['compiles']} programs",
        flush=True,
    )
    run = serve(engine, prompts, outputs)

    steps = sum(run["step_buckets"].values())
    ttft_p50, ttft_p99 = _percentiles(run["ttft_s"])
    tpot_p50, tpot_p99 = _percentiles(run["tpot_s"])
    figures = dict(
        wall_s=run["wall_s"],
        compile_s=compile_s,
        warmup_s=warm["wall_s"],
        init_s=init_s,
        output_tokens_per_s=output_tokens / run["wall_s"],
        total_tokens_per_s=(prompt_tokens + output_tokens) / run["wall_s"],
        ttft_p50_ms=ttft_p50,
        ttft_p99_ms=ttft_p99,
        tpot_p50_ms=tpot_p50,
        tpot_p99_ms=tpot_p99,
        steps=steps,
        programs=len(run["step_buckets"]),
        compile_count=engine.compile_count,
        compiles_in_warmup_run=warm["compiles"],
        compiles_in_measured_run=run["compiles"],
        padding_fraction=padding_fractions(run["step_buckets"], run["stats"])[0],
        prefill_padding_fraction=padding_fractions(run["step_buckets"], run["stats"])[1],
        prefill_tokens=run["stats"]["prefill_tokens"],
        decode_tokens=run["stats"]["decode_tokens"],
        prefill_seconds=run["stats"]["prefill_seconds"],
        decode_seconds=run["stats"]["decode_seconds"],
        schedule_matches_analysis=(
            None if own is None else _bucket_list(run["step_buckets"]) == own["step_buckets"]
        ),
        peak_bytes=harness.peak_bytes(),
    )
    state_itemsize = jnp.dtype(options["mamba_ssm_cache_dtype"]).itemsize
    flops, bytes_moved = _cost(
        model, steps, prompt_tokens, output_tokens, run["stats"]["decode_tokens"], state_itemsize
    )
    wall_ms = run["wall_s"] * 1e3
    row = harness.row(
        problem,
        "auto",
        harness.Timing(wall_ms, wall_ms, wall_ms),
        flops=flops,
        bytes_moved=bytes_moved,
        ceilings=ceilings,
        op="serving",
        model=name,
        bucket_policy=args.bucket_policy,
        bucket_step=args.bucket_step,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        tokens=prompt_tokens + output_tokens,
        tokens_per_s=(prompt_tokens + output_tokens) / run["wall_s"],
        **{k: v for k, v in figures.items() if k != "wall_s"},
    )
    serving.update(
        run=figures | dict(step_buckets=_bucket_list(run["step_buckets"])),
        requests=[
            dict(prompt_len=p, output_len=o, ttft_s=t, tpot_s=s)
            for p, o, t, s in zip(lengths, outputs, run["ttft_s"], run["tpot_s"], strict=True)
        ],
    )
    harness.report(title, [row], ceilings, None)
    save(row, ceilings)
    _print_run(figures)
    return [row]


def _print_analysis(analysis: list[dict[str, Any]], seconds: float) -> None:
    print(f"\n## token bucket policies (schedule on the host, {seconds:.1f} s)")
    print(f"{'policy':<14}{'buckets':>8}{'programs':>10}{'grid':>6}{'steps':>7}{'padding':>9}")
    for a in analysis:
        label = a["policy"] + (f"/{a['step']}" if a["step"] else "")
        print(
            f"{label:<14}{len(a['token_buckets']):>8}{a['programs']:>10}{a['grid']:>6}"
            f"{a['steps']:>7}{a['padding_fraction']:>9.1%}",
            flush=True,
        )


def _print_run(f: dict[str, Any]) -> None:
    print(
        f"\nwall {f['wall_s']:.2f} s (warm-up run {f['warmup_s']:.1f} s), "
        f"{f['output_tokens_per_s']:.0f} output tok/s, {f['total_tokens_per_s']:.0f} tok/s; "
        f"TTFT p50 {f['ttft_p50_ms']:.1f} ms p99 {f['ttft_p99_ms']:.1f} ms; "
        f"TPOT p50 {f['tpot_p50_ms']:.2f} ms p99 {f['tpot_p99_ms']:.2f} ms; "
        f"{f['steps']} steps, {f['programs']} programs, padding {f['padding_fraction']:.1%}",
        flush=True,
    )


if __name__ == "__main__":
    main()
