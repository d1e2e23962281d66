"""End-to-end serving benchmark: hybrid models of real shapes (random init, bf16).

``python -m benchmarks.model [--out FILE] [--results-dir DIR] [--quick] [--models NAME ...]
[--mesh tp=N ...] [--implementations auto xla] [--processes N] [--mock-devices N]``.
Models (``HybridConfig`` presets):
``bamba-9b`` (dense: hidden 4096, 32 layers, attention at 9, 18, 27),
``nemotron3-nano-30b-a3b`` (MoE: hidden 2688, 52 layers of Mamba2, MoE and attention
blocks, 128 experts top-6), ``granite-4.0-h-small`` (MoE: hidden 4096, 40 layers, 72
experts top-10 beside a shared MLP) and ``nemotron-h-56b`` (dense, 118 layers, 112 GB: two
GPUs; decode at 1 and 64 rows only), one after the other. Rows, for each implementation in
one run on the same weights: prefill tokens/s on 8 × 4096, on a ragged batch and on one
1024-token prompt alone (the prefill an idle server's first token waits for), decode
step time at 1, 64 and 256 rows with 4k tokens of context, and peak device memory. Steps
are launched back to back, the host not waiting for one before launching the next, as
``Engine.stream`` runs them (it reads step n's tokens after launching step n + 1): a
decode row's time is the time per output token of a long generation. A timing sample
chains decode steps for at least ``DECODE_SAMPLE_MS``, so the host's launch of a sample's
first step (the fill of the pipeline, which a generation pays once) is shared by ten
steps or more (14 at 256 rows of Bamba-9B). ``decode-1x…-stream`` checks that figure end
to end: one request of that context streamed through ``Engine.stream`` (its prompt
prefilled, then greedy tokens), the median interval between its tokens as the host
receives them.
``--quick`` runs a tiny dense and a tiny MoE model.

``--mesh tp=1 tp=2`` runs every model once per mesh (the first N devices, one axis
``"tp"``; ``flax_models.sharding``), the rows named ``model@tpN/case`` and, beside a tp=1
row of the same case, ``speedup_vs_tp1``. The roofline of a tp=N row is the model's over N
devices' measured ceilings (each device reads its shard of the weights and states).
``--processes N`` runs the benchmark as N processes of this host, one GPU each, joined by
``jax.distributed`` (as on several hosts; ``harness.spawn_processes``): a tp=N mesh then
spans all N processes, each launching only its own GPU's kernels, and a tp=1 row is every
process running its own copy (the first process's rows are reported, ``processes`` in
each row says how many ran).

``--mock-devices N`` runs on one GPU as if it were one of N, with JAX's mock GPU topology:
``jax.devices()`` lists N, the others stand-ins whose collectives do nothing. A tp=N row
then times one device's share of the step, its all-reduces free, and beside a tp=1 row of
the same run its ``speedup_vs_tp1`` is the most tp=N can give: the part of a measured tp=N
step above it is communication. Each such row says ``"collectives": "mocked"``.

The roofline counts *active* parameters: FLOPs use the k of E routed experts each token
runs; bytes the experts a step reads. For decode steps those are the experts their rows
route to, measured on the rows' tokens (``routed_experts``: a random-init model routes far
from uniformly, so uniform routing would overstate the bytes); prefill steps are
compute-bound and take uniform routing's ``E (1 - (1 - 1/E)^(k tokens))``.

The allocator may use 94% of each GPU (``XLA_PYTHON_CLIENT_MEM_FRACTION``, unless set):
JAX's default 75% cannot hold Granite-4.0-H-Small's weights (65 GB) beside its 256-slot
decode caches (56 GB).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import harness
from flax_models.config import HybridConfig
from flax_models.layers.moe import MoE
from flax_models.model import HybridLM
from flax_models.serving.batching import Request
from flax_models.serving.engine import Engine
from flax_models.serving.sampling import SamplingParams


def _with_implementation(
    model: HybridLM, implementation: str, *, mesh: jax.sharding.Mesh | None = None
) -> HybridLM:
    """The same weights under another implementation (a static attribute of the modules),
    and on ``mesh`` (the model's own by default; ``mesh=False``: its sharded weights under
    the unsharded modules, which XLA partitions by itself)."""
    mesh = model.mesh if mesh is None else mesh or None
    abstract = nnx.eval_shape(
        lambda: HybridLM(
            model.cfg,
            dtype=model.dtype,
            implementation=implementation,
            rngs=nnx.Rngs(0),
            mesh=mesh,
        )
    )
    return nnx.merge(nnx.split(abstract)[0], nnx.state(model))


MODELS = {
    "bamba-9b": HybridConfig.bamba_9b,
    "nemotron3-nano-30b-a3b": HybridConfig.nemotron3_nano_30b_a3b,
    "granite-4.0-h-small": HybridConfig.granite_4_h_small,
    "nemotron-h-56b": HybridConfig.nemotron_h_56b,
}
# Decode rows per model where not (1, 64, 256): the engine holds a state per row, and the
# 56B model's 256 rows of 4k context would not fit beside its weights on two GPUs.
DECODE_ROWS = {"nemotron-h-56b": (1, 64)}
# Decode steps chained per timing sample (at least this long). Launching a Bamba-9B step
# costs the host ~1.5 ms, paid once before a sample's first step; 25 ms samples held 1-3
# decode steps and charged it to every 1-3 tokens, which a long generation does not.
DECODE_SAMPLE_MS = 400.0
# Greedy tokens streamed for the ``-stream`` row (the first, after the prefill, uncounted).
STREAM_TOKENS = 64
# Routed-expert weights in the parameter tree (layers/moe.py): [E, K, N] each.
_EXPERT_PARAMS = ("experts_up", "experts_down")


def _weights(model: HybridLM) -> tuple[int, int, int, int]:
    """(elements, bytes) of the dense weights, then of the routed experts' weights."""
    dense = experts = dense_bytes = expert_bytes = 0
    for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        array = leaf[...]
        size, nbytes = array.size, array.size * array.dtype.itemsize
        if any(name in _EXPERT_PARAMS for name in map(str, path)):
            experts, expert_bytes = experts + size, expert_bytes + nbytes
        else:
            dense, dense_bytes = dense + size, dense_bytes + nbytes
    return dense, dense_bytes, experts, expert_bytes


def routed_experts(model: HybridLM, token_ids: np.ndarray) -> np.ndarray:
    """Expert ids ``[layers, B * L, k]`` that each MoE layer routes ``token_ids[B, L]`` to,
    run as fresh sequences (``[0, B * L, k]`` for a model without experts). A random-init
    model routes far from uniformly, so the experts a step reads are measured, not
    assumed. A sharded model is probed through unsharded modules (its mixers' shard_map
    would hide the ids)."""
    graphdef, state = nnx.split(_with_implementation(model, "xla", mesh=False))

    @jax.jit
    def probe(state, ids):
        copy = nnx.merge(graphdef, state)
        chosen = []
        for _, moe in nnx.iter_graph(copy):
            if isinstance(moe, MoE):  # record each layer's expert ids as the model routes
                moe.route = functools.partial(_recording, moe.route, chosen)
        copy(ids)
        return [i.reshape(-1, i.shape[-1]) for i in chosen]

    chosen = probe(state, jnp.asarray(token_ids, jnp.int32))
    return np.stack([np.asarray(i) for i in chosen]) if chosen else np.zeros((0, token_ids.size, 1))


def _recording(route, chosen: list, logits, bias, cfg):
    weights, ids = route(logits, bias, cfg)
    chosen.append(ids)
    return weights, ids


def _cost(
    cfg: HybridConfig, model: HybridLM, arrays, context: int, touched: float
) -> tuple[float, float]:
    """(FLOPs, bytes) floor of a step: 2 FLOPs per active matmul weight per token (the
    embedding table is a gather, not a matmul; of the routed experts the k of E a token
    runs) plus the vocabulary projection of each sequence row's last token and causal
    attention over the step's keys; every weight read once (of the embedding table only the
    rows looked up, unless it is tied to the output; of the experts those the step's tokens
    touch under uniform routing), plus each decode row's SSM state (read and written, fp32)
    and its K/V context (bf16)."""
    weights, weight_bytes, experts, expert_bytes = _weights(model)
    if experts:
        k_of_e = cfg.num_experts_per_tok / cfg.num_experts
        weights += experts * k_of_e
        weight_bytes += expert_bytes * touched
    vocab = cfg.vocab_size * cfg.hidden_size  # the embedding table; also the output if tied
    itemsize = jnp.dtype(model.dtype).itemsize
    matmul_weights = weights - vocab * (1 if model.lm_head is None else 2)
    if model.lm_head is not None:  # the table itself is only gathered from
        looked_up = min(arrays.num_tokens, cfg.vocab_size) * cfg.hidden_size
        weight_bytes -= (vocab - looked_up) * itemsize
    lengths = np.diff(arrays.query_start_loc)[arrays.num_decode :]
    attention_layers = cfg.layer_pattern.count("*")
    mamba_layers = cfg.layer_pattern.count("M")
    pairs = float(np.sum(lengths * (lengths + 1) / 2))
    rows = int(np.sum(arrays.slot_ids[: arrays.num_decode] >= 0))
    pairs += rows * (context + 1)
    logits_rows = len(arrays.query_start_loc) - 1
    flops = (
        2.0 * matmul_weights * arrays.num_tokens
        + 2.0 * vocab * logits_rows
        + 4.0 * pairs * cfg.num_heads * cfg.head_dim * attention_layers
    )
    state = cfg.mamba_num_heads * cfg.mamba_head_dim * cfg.mamba_state_size * 4
    kv = 2 * context * cfg.num_kv_heads * cfg.head_dim * 2
    bytes_moved = weight_bytes + rows * (2 * state * mamba_layers + kv * attention_layers)
    return flops, float(bytes_moved)


def _mesh(tp: int) -> jax.sharding.Mesh | None:
    """The first ``tp`` devices on one axis ``"tp"`` (None for one device: the unsharded
    model, not a one-device mesh; under several processes, each process's own)."""
    if tp == 1:
        return None
    if tp > jax.device_count():
        raise SystemExit(f"--mesh tp={tp}: only {jax.device_count()} devices")
    if jax.process_count() > 1 and tp != jax.device_count():
        # Every process runs every step: a mesh that left one out would hang the others.
        raise SystemExit(
            f"--mesh tp={tp}: under {jax.process_count()} processes a mesh spans all "
            f"{jax.device_count()} devices (or tp=1)"
        )
    return jax.sharding.Mesh(np.array(jax.devices()[:tp]), ("tp",))


def bench_model(
    name: str,
    cfg: HybridConfig,
    dtype,
    args,
    ceilings: harness.Ceilings,
    *,
    record: Callable[[dict], None],
    tp: int = 1,
    implementations: Sequence[str] = ("auto", "xla"),
    decode_rows: Sequence[int] = (1, 64, 256),
) -> None:
    """Every case of one model, for each implementation in turn (``auto`` first), on the
    same weights, tensor-parallel over ``tp`` devices; ``record(row)`` as each is timed."""
    rng = np.random.default_rng(0)
    mesh = _mesh(tp)
    label = name if mesh is None else f"{name}@tp{tp}"
    # N devices together: each reads its 1/N of the weights and states and runs 1/N of
    # the FLOPs (the all-reduces are the step's own cost).
    ceilings = dataclasses.replace(
        ceilings, copy_gbps=ceilings.copy_gbps * tp, matmul_tflops=ceilings.matmul_tflops * tp
    )
    if args.quick:
        dense, ragged, context, decode_rows = (2, 32), [5, 40, 17], 48, (1, 4)
        single = 24
    else:
        dense = (8, 4096)
        ragged = [int(n) for n in rng.integers(64, 8193, size=8)]
        context = 4096
        single = 1024  # one prompt alone: the TTFT of a request on an idle server
    budget = max(dense[0] * dense[1], sum(ragged))
    # Prefill and decode each get an engine sized for them (slots, cache length, buckets):
    # a prefill step over a 256-sequence bucket would spend its memory on 248 empty
    # sequences' chunks and states.
    # The benchmark builds its steps itself and never warms up, so the unused kind of step
    # gets one bucket (the engine checks that buckets cover its slots and budget); prefill
    # steps run in the engine's default token buckets (the ragged batch's padding is
    # theirs).
    prefill_slots = max(dense[0], len(ragged))
    engines = dict(
        prefill=dict(
            max_slots=prefill_slots,
            max_len=max(dense[1], max(ragged)),
            token_budget=budget,
            decode_buckets=(prefill_slots,),
        ),
        decode=dict(
            max_slots=max(decode_rows),
            max_len=context + 1,
            token_budget=16,
            decode_buckets=decode_rows,
            token_buckets=(16,),
        ),
    )
    cases = {
        f"prefill-{dense[0]}x{dense[1]}": (
            "prefill",
            [],
            [
                Request(s, list(rng.integers(0, cfg.vocab_size, dense[1])), 0)
                for s in range(dense[0])
            ],
        ),
        "prefill-ragged": (
            "prefill",
            [],
            [Request(s, list(rng.integers(0, cfg.vocab_size, n)), 0) for s, n in enumerate(ragged)],
        ),
        f"prefill-1x{single}": (
            "prefill",
            [],
            [Request(0, list(rng.integers(0, cfg.vocab_size, single)), 0)],
        ),
    }
    for r in decode_rows:
        cases[f"decode-{r}x{context}"] = (
            "decode",
            [Request(s, [int(rng.integers(cfg.vocab_size))], context) for s in range(r)],
            [],
        )
    # Experts a decode step reads: the rows' own routing (their tokens as fresh one-token
    # sequences; their context is not computed here either). Prefill steps route
    # thousands of tokens and are compute-bound: uniform routing's estimate serves there.
    base = HybridLM(cfg, dtype=dtype, implementation="xla", rngs=nnx.Rngs(0), mesh=mesh)
    touched = {}
    if cfg.num_experts:
        decode_cases = {c: d for c, (kind, d, _) in cases.items() if kind == "decode"}
        tokens = np.array([[r.tokens[0]] for d in decode_cases.values() for r in d])
        ids = routed_experts(base, tokens)
        start = 0
        for case, requests in decode_cases.items():
            rows = ids[:, start : start + len(requests)]
            start += len(requests)
            used = [len(np.unique(layer)) for layer in rows]
            touched[case] = float(np.mean(used)) / cfg.num_experts
        for case, (kind, _, prefill) in cases.items():
            if kind == "prefill":
                routed = sum(len(r.tokens) for r in prefill) * cfg.num_experts_per_tok
                touched[case] = 1.0 - (1.0 - 1.0 / cfg.num_experts) ** routed

    def timed(problem: str, impl: str, case: str, arrays, timing: harness.Timing) -> None:
        """Records the row of a step (``arrays``, the case's roofline) timed at ``timing``."""
        flops, bytes_moved = _cost(cfg, base, arrays, context, touched.get(case, 0.0))
        tokens = arrays.num_tokens
        record(
            harness.row(
                problem,
                impl,
                timing,
                flops=flops,
                bytes_moved=bytes_moved,
                op="model",
                ceilings=ceilings,
                model=name,
                tp=tp,
                processes=jax.process_count(),
                experts_touched=touched.get(case),
                tokens=tokens,
                tokens_per_s=tokens / (timing.median_ms * 1e-3),
                peak_bytes=harness.peak_bytes(),
            )
        )
        print(f"{problem} {impl}: {timing.median_ms:.3f} ms", flush=True)

    # auto first: a baseline that cannot run (e.g. xla's ragged_dot out of memory on a MoE
    # prefill) must not leave the device fragmented for the rows that matter.
    for impl in implementations:
        model = _with_implementation(base, impl)
        for kind, engine_args in engines.items():
            engine = Engine(model, **engine_args)
            for case, (case_kind, decode, prefill) in cases.items():
                problem = f"{label}/{case}"
                if case_kind != kind or not harness.selected(problem, args.only):
                    continue
                arrays = engine.builder.build(decode, prefill)
                sample_ms = DECODE_SAMPLE_MS if case_kind == "decode" and not args.quick else 25.0
                try:
                    timing = harness.time_fn(
                        lambda a=arrays, e=engine: e.step(a, wait=False),
                        warmup=2,
                        samples=5,
                        min_sample_ms=sample_ms,
                    )
                except jax.errors.JaxRuntimeError as error:  # e.g. out of device memory
                    reason = harness.failure_reason(error)
                    print(f"note: {problem}: no {impl} row ({reason})", flush=True)
                    continue
                timed(problem, impl, case, arrays, timing)
            engine = None  # free this engine's caches before the next one's
            gc.collect()
        case = f"decode-1x{context}"
        problem = f"{label}/{case}-stream"
        if case in cases and harness.selected(problem, args.only):
            _, decode, _ = cases[case]  # the same one-row step: its experts and roofline
            try:
                timing, arrays = _stream_timing(model, decode, context, rng)
            except jax.errors.JaxRuntimeError as error:
                print(f"note: {problem}: no {impl} row ({harness.failure_reason(error)})")
                continue
            timed(problem, impl, case, arrays, timing)
            gc.collect()


def _stream_timing(
    model: HybridLM, decode: list[Request], context: int, rng: np.random.Generator
) -> tuple[harness.Timing, object]:
    """Time per output token of one request through ``Engine.stream``: a prompt of
    ``context`` tokens (one prefill step), then ``STREAM_TOKENS`` greedy tokens; the
    intervals between the tokens as the host receives them, from the second on (the
    first waits for the prefill). Also the step arrays of the ``decode`` rows (one, with
    ``context`` tokens cached) on this engine, for the row's roofline."""
    engine = Engine(
        model,
        max_slots=1,
        max_len=context + STREAM_TOKENS,
        token_budget=context,
        decode_buckets=(1,),
        token_buckets=(16, context),
    )
    prompt = [int(t) for t in rng.integers(0, model.cfg.vocab_size, context)]
    greedy = SamplingParams(max_new_tokens=STREAM_TOKENS, temperature=0.0)
    for _ in engine.stream([prompt], greedy):  # compiles the prefill and decode steps
        pass
    arrivals = [time.perf_counter() for _ in engine.stream([prompt], greedy)]
    intervals = np.diff(arrivals[1:]) * 1e3
    timing = harness.Timing(
        float(np.median(intervals)), float(intervals.min()), float(intervals.max())
    )
    return timing, engine.builder.build(decode, [])


def _take_option(argv: list[str], name: str) -> tuple[list[str] | None, list[str]]:
    """The values after ``name`` (up to the next ``--option``) and the other arguments."""
    if name not in argv:
        return None, argv
    at = argv.index(name)
    end = next((i for i in range(at + 1, len(argv)) if argv[i].startswith("--")), len(argv))
    return argv[at + 1 : end], argv[:at] + argv[end:]


def _count(values: list[str], name: str, *, least: int) -> int:
    """The one count N >= ``least`` that option ``name`` takes."""
    if len(values) != 1 or not values[0].isdigit() or int(values[0]) < least:
        raise SystemExit(f"{name}: expected one count N >= {least}, got {values}")
    return int(values[0])


def _mock_devices(count: int) -> None:
    """Before the first device call: this host's one GPU as the first of ``count`` (JAX's
    mock GPU topology; see the module docstring)."""
    jax.config.update("jax_mock_gpu_topology", f"1x{count}x1")
    # A process shares its GEMM autotuning results with the others through the
    # distributed service, which stand-ins never answer: compilation would wait forever.
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_shard_autotuning=false".strip()


def _add_tp_speedups(rows: list[dict]) -> None:
    """``speedup_vs_tp1``: a tp=1 row's time over the time of the same case and
    implementation at tp=N."""
    base = {
        (r["model"], r["problem"].split("/", 1)[1], r["implementation"]): r["median_ms"]
        for r in rows
        if r["tp"] == 1
    }
    for r in rows:
        key = (r["model"], r["problem"].split("/", 1)[1], r["implementation"])
        if r["tp"] > 1 and key in base:
            r["speedup_vs_tp1"] = base[key] / r["median_ms"]


def main(argv: Sequence[str] | None = None) -> list[dict]:
    # Before the first device call: the allocator's share of each GPU (see the docstring).
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
    argv = list(sys.argv[1:] if argv is None else argv)
    command = list(argv)
    processes, argv = _take_option(argv, "--processes")
    mock, argv = _take_option(argv, "--mock-devices")
    if mock is not None:
        count = _count(mock, "--mock-devices", least=2)
        if processes is not None:
            raise SystemExit("--mock-devices: one process on one GPU, not with --processes")
        _mock_devices(count)
    if processes is not None and harness.PROCESS_ENV not in os.environ:
        count = _count(processes, "--processes", least=1)
        raise SystemExit(harness.spawn_processes(count, "benchmarks.model", argv))
    harness.join_processes()
    # ``--models``, ``--mesh`` and ``--implementations`` are this module's own options;
    # the rest are the harness's.
    names, argv = _take_option(argv, "--models")
    names = list(MODELS) if names is None else names
    unknown = sorted(set(names) - set(MODELS))
    if unknown or not names:
        raise SystemExit(f"--models: expected names from {sorted(MODELS)}, got {names}")
    meshes, argv = _take_option(argv, "--mesh")
    try:
        tps = [1] if meshes is None else [int(m.removeprefix("tp=")) for m in meshes]
    except ValueError:
        raise SystemExit(f"--mesh: expected tp=N ..., got {meshes}") from None
    if not tps or min(tps) < 1:
        raise SystemExit(f"--mesh: expected tp=N with N >= 1, got {meshes}")
    implementations, argv = _take_option(argv, "--implementations")
    implementations = implementations or ["auto", "xla"]
    args = harness.parse_args(
        argv, "hybrid model serving benchmark", module="model", command=command
    )
    # The store's device folder: the most devices a mesh spans (mocked ones are not GPUs).
    args.output.devices = 1 if mock is not None else max(tps)
    ceilings = harness.measure_ceilings(quick=args.quick)
    if args.quick:  # a tiny dense and a tiny MoE model (CPU smoke run)
        models = {"tiny": HybridConfig.tiny(), "tiny-moe": HybridConfig.tiny_moe()}
        dtype = jnp.float32
    else:
        models = {name: MODELS[name]() for name in names}
        dtype = jnp.bfloat16
    rows: list[dict] = []

    def record(row: dict) -> None:
        if mock is not None and row["tp"] > 1:
            row["collectives"] = "mocked"
            row["processes"] = 1  # the stand-ins count as processes to JAX
        rows.append(row)
        harness.add_speedups(rows)
        _add_tp_speedups(rows)
        # After every row: a run stopped by a time limit keeps what it measured.
        harness.write_report(rows, ceilings, args.output)

    for name, cfg in models.items():
        for tp in tps:
            bench_model(
                name,
                cfg,
                dtype,
                args,
                ceilings,
                record=record,
                tp=tp,
                implementations=implementations,
                decode_rows=DECODE_ROWS.get(name, (1, 64, 256)),
            )
            jax.clear_caches()  # the next model's weights need the memory
            gc.collect()
    print(f"\n## hybrid models ({dtype.__name__})")
    if mock is not None:
        print("tp rows: one device's share of the step, its collectives mocked (free)")
    print(
        f"{'case':<48}{'impl':<6}{'median ms':>10}{'tokens/s':>12}{'% roof':>8}"
        f"{'vs xla':>8}{'vs tp1':>8}"
    )
    for r in rows:
        # A ratio whose baseline row was not in this run prints as "-".
        ratios = (r.get(key) for key in ("speedup_vs_xla", "speedup_vs_tp1"))
        print(
            f"{r['problem']:<48}{r['implementation']:<6}{r['median_ms']:>10.3f}"
            f"{r['tokens_per_s']:>12.0f}{r['roofline_fraction']:>8.1%}"
            + "".join(f"{'-':>8}" if x is None else f"{x:>7.2f}x" for x in ratios)
        )
    harness.report("hybrid model serving", rows, ceilings, args.output)
    return rows


if __name__ == "__main__":
    main()
