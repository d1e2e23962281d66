"""End-to-end serving benchmark: a Bamba-9B-shaped hybrid (random init, bf16).

``python -m benchmarks.model [--out results.json] [--quick]``. Hidden 4096, 32 layers with
attention at 9, 18, 27 (mixer 128 heads × 64, N = 128, G = 1, chunk 256; attention 32 query /
8 KV heads × 128; MLP 14336). Rows, for ``xla`` and ``auto`` in one run on the same weights:
prefill tokens/s on 8 × 4096 and on a ragged batch, decode step latency at 1, 64 and 256
rows with 4k tokens of context, and peak device memory. ``--quick`` runs a tiny model.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import harness
from flax_models.batching import Request
from flax_models.config import HybridConfig
from flax_models.engine import Engine
from flax_models.model import HybridLM


def _with_implementation(model: HybridLM, implementation: str) -> HybridLM:
    """The same weights under another implementation (a static attribute of the modules)."""
    abstract = nnx.eval_shape(
        lambda: HybridLM(
            model.cfg, dtype=model.dtype, implementation=implementation, rngs=nnx.Rngs(0)
        )
    )
    return nnx.merge(nnx.split(abstract)[0], nnx.state(model))


def _cost(cfg: HybridConfig, model: HybridLM, arrays, context: int) -> tuple[float, float]:
    """(FLOPs, bytes) floor of a step: 2 FLOPs per matmul weight per token (the embedding
    table is a gather, not a matmul) plus the vocabulary projection of each sequence row's
    last token and causal attention over the step's keys; every weight read once (of the
    embedding table only the rows looked up, unless it is tied to the output), plus each
    decode row's SSM state (read and written, fp32) and its K/V context (bf16)."""
    params = jax.tree.leaves(nnx.state(model))
    weights = sum(x.size for x in params)
    weight_bytes = sum(x.size * jnp.dtype(x.dtype).itemsize for x in params)
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


def _peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = harness.parse_args(argv, "hybrid model serving benchmark")
    rng = np.random.default_rng(0)
    if args.quick:
        cfg, dtype = HybridConfig.tiny(), jnp.float32
        dense, ragged, context, decode_rows = (2, 32), [5, 40, 17], 48, (1, 4)
    else:
        cfg, dtype = HybridConfig.bamba_9b(), jnp.bfloat16
        dense = (8, 4096)
        ragged = [int(n) for n in rng.integers(64, 8193, size=8)]
        context, decode_rows = 4096, (1, 64, 256)
    budget = max(dense[0] * dense[1], sum(ragged))
    # Prefill and decode each get an engine sized for them (slots, cache length, buckets):
    # a prefill step over a 256-sequence bucket would spend its memory on 248 empty
    # sequences' chunks and states.
    # The benchmark builds its steps itself and never warms up, so the unused kind of step
    # gets one bucket (the engine checks that buckets cover its slots and budget).
    prefill_slots = max(dense[0], len(ragged))
    engines = dict(
        prefill=dict(
            max_slots=prefill_slots,
            max_len=max(dense[1], max(ragged)),
            token_budget=budget,
            decode_buckets=(prefill_slots,),
            token_buckets=(dense[0] * dense[1], budget),
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
    }
    for r in decode_rows:
        cases[f"decode-{r}x{context}"] = (
            "decode",
            [Request(s, [int(rng.integers(cfg.vocab_size))], context) for s in range(r)],
            [],
        )
    ceilings = harness.measure_ceilings(quick=args.quick)
    base = HybridLM(cfg, dtype=dtype, implementation="xla", rngs=nnx.Rngs(0))
    rows: list[dict] = []
    for impl in ("xla", "auto"):
        model = _with_implementation(base, impl)
        for kind, engine_args in engines.items():
            engine = Engine(model, **engine_args)
            for name, (case_kind, decode, prefill) in cases.items():
                if case_kind != kind or not harness.selected(name, args.only):
                    continue
                arrays = engine.builder.build(decode, prefill)
                timing = harness.time_fn(lambda a=arrays, e=engine: e.step(a), warmup=2, samples=5)
                tokens = arrays.num_tokens
                flops, bytes_moved = _cost(cfg, base, arrays, context)
                rows.append(
                    harness.row(
                        name,
                        impl,
                        timing,
                        flops=flops,
                        bytes_moved=bytes_moved,
                        op="model",
                        ceilings=ceilings,
                        tokens=tokens,
                        tokens_per_s=tokens / (timing.median_ms * 1e-3),
                        peak_bytes=_peak_bytes(),
                    )
                )
                print(f"{name} {impl}: {timing.median_ms:.3f} ms", flush=True)
            engine = None  # free this engine's caches before the next one's
    harness.add_speedups(rows)
    print(f"\n## hybrid model ({cfg.family} pattern of {cfg.num_layers} layers, {dtype.__name__})")
    print(f"{'case':<22}{'impl':<6}{'median ms':>10}{'tokens/s':>12}{'vs xla':>8}{'peak GiB':>10}")
    for r in rows:
        peak = r["peak_bytes"]
        print(
            f"{r['problem']:<22}{r['implementation']:<6}{r['median_ms']:>10.3f}"
            f"{r['tokens_per_s']:>12.0f}{r['speedup_vs_xla']:>7.2f}x"
            f"{'' if peak is None else f'{peak / 2**30:.1f}':>10}"
        )
    harness.report("hybrid model serving", rows, ceilings, args.out)
    return rows


if __name__ == "__main__":
    main()
