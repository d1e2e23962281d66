"""Demo: generate with a hybrid model through the serving engine, then every kernel op.

``python -m flax_models.demo [--checkpoint DIR] [--implementation auto|xla|triton|mosaic]``

1. Builds the embedded default, a tiny random-init Bamba-style hybrid (``M M * M`` with an
   MLP after each mixer), or loads a Hugging Face directory with ``--checkpoint``; runs
   ``Engine.generate`` on a ragged batch of prompts (more prompts than slots, prompts
   longer than the token budget) and prints per-request tokens, prefill and decode
   tokens/s, the number of compiled programs, and the largest logit difference between the
   serving path (chunked prefill over the caches) and the plain ``xla`` forward.
2. Text in, text out (``--text DIR``, by default the shipped trained model,
   ``flax_models/assets/kjv-bamba/``): ``LLM.generate`` on a batch of prompts with per-request
   sampling settings and a stop string, ``LLM.stream`` piece by piece, and ``LLM.chat``
   through the directory's chat template where it has one.
3. Runs a ragged batch through every kernel op and prints one row per op: shapes, relative
   and max absolute error against the float64 oracles of ``pallas_kernels.testing``, and
   the median time of the jitted call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels import testing

# The embedded default batch: a long prefill, a decode row, a padding sequence, a
# continued prefix and a short continuation (T = 55 real tokens + 9 bucket rows).
LENGTHS = (37, 1, 0, 12, 5)
COMPUTED = (0, 20, 0, 3, 9)
SLOTS = (2, 0, -1, 5, 3)
NUM_TOKENS, NUM_SLOTS = 64, 6
HEADS, HEAD_DIM, STATE_DIM, GROUPS, CHUNK = 4, 8, 16, 2, 8
CONV_DIM, WIDTH = 64, 4
Q_HEADS, KV_HEADS, ATT_DIM, CACHE_LEN = 4, 2, 16, 64


def _median_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _row(op, shape, actual, expected, fn):
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    return dict(
        op=op,
        shape=shape,
        rel=testing.relative_error(actual, expected),
        max_abs=float(np.max(np.abs(actual - expected))),
        ms=_median_ms(fn),
    )


def kernel_table(implementation: str = "auto", seed: int = 0) -> list[dict]:
    """Runs every op once on the embedded batch; returns the table rows. ``implementation``
    names a backend family as for the model ("mosaic": Mosaic kernels where an op has
    them, Triton elsewhere)."""
    from flax_models.model import layer_implementation

    implementation = layer_implementation(implementation)
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    qsl = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    computed = np.asarray(COMPUTED, np.int32)
    slots = np.asarray(SLOTS, np.int32)
    num_seqs = len(LENGTHS)
    rows = []

    # SSD prefill from cached states.
    x, dt = normal(NUM_TOKENS, HEADS, HEAD_DIM), normal(NUM_TOKENS, HEADS)
    A = -jnp.exp(normal(HEADS))
    B, C = normal(NUM_TOKENS, GROUPS, STATE_DIM), normal(NUM_TOKENS, GROUPS, STATE_DIM)
    D, dt_bias = normal(HEADS), normal(HEADS)
    init = normal(num_seqs, HEADS, HEAD_DIM, STATE_DIM)
    md = pk.chunk_metadata(
        jnp.asarray(qsl),
        jnp.asarray(computed),
        chunk_size=CHUNK,
        max_chunks=pk.max_chunks_for(NUM_TOKENS, num_seqs, CHUNK),
    )
    ssd = jax.jit(
        lambda: pk.ssd_scan(
            x,
            dt,
            A,
            B,
            C,
            metadata=md,
            chunk_size=CHUNK,
            D=D,
            dt_bias=dt_bias,
            dt_softplus=True,
            initial_states=init,
            implementation=implementation,
        )
    )
    y, _ = ssd()
    y_ref, _ = testing.ssd_oracle(
        x,
        dt,
        A,
        B,
        C,
        query_start_loc=qsl,
        D=D,
        dt_bias=dt_bias,
        dt_softplus=True,
        initial_states=init,
    )
    rows.append(_row("ssd_scan", f"x{list(x.shape)} G={GROUPS} cs={CHUNK}", y, y_ref, ssd))

    # Decode SSM step for the first three sequences' slots.
    state_cache = normal(NUM_SLOTS, HEADS, HEAD_DIM, STATE_DIM)
    step = jax.jit(
        lambda: pk.selective_state_update(
            state_cache,
            x[:3],
            dt[:3],
            A,
            B[:3],
            C[:3],
            slot_ids=jnp.asarray(slots[:3]),
            D=D,
            dt_bias=dt_bias,
            dt_softplus=True,
            implementation=implementation,
        )
    )
    y, _ = step()
    y_ref, _ = testing.selective_state_update_oracle(
        state_cache,
        x[:3],
        dt[:3],
        A,
        B[:3],
        C[:3],
        slot_ids=slots[:3],
        D=D,
        dt_bias=dt_bias,
        dt_softplus=True,
    )
    rows.append(_row("selective_state_update", f"x{list(x[:3].shape)}", y, y_ref, step))

    # Causal conv1d prefill (mixed prefill + decode rows) and decode update.
    xc, w, bias = normal(NUM_TOKENS, CONV_DIM), normal(CONV_DIM, WIDTH), normal(CONV_DIM)
    conv_cache = normal(NUM_SLOTS, WIDTH - 1, CONV_DIM)
    has_init = computed > 0
    conv = jax.jit(
        lambda: pk.causal_conv1d(
            xc,
            w,
            bias,
            query_start_loc=jnp.asarray(qsl),
            conv_state_cache=conv_cache,
            slot_ids=jnp.asarray(slots),
            has_initial_state=jnp.asarray(has_init),
            implementation=implementation,
        )
    )
    y, _ = conv()
    y_ref, _ = testing.causal_conv1d_oracle(
        xc,
        w,
        bias,
        query_start_loc=qsl,
        conv_state_cache=conv_cache,
        slot_ids=slots,
        has_initial_state=has_init,
        activation="silu",
    )
    rows.append(_row("causal_conv1d", f"x{list(xc.shape)} K={WIDTH}", y, y_ref, conv))
    update = jax.jit(
        lambda: pk.causal_conv1d_update(
            xc[:3],
            conv_cache,
            w,
            bias,
            slot_ids=jnp.asarray(slots[:3]),
            implementation=implementation,
        )
    )
    y, _ = update()
    y_ref, _ = testing.causal_conv1d_update_oracle(
        xc[:3], conv_cache, w, bias, slot_ids=slots[:3], activation="silu"
    )
    rows.append(_row("causal_conv1d_update", f"x{list(xc[:3].shape)}", y, y_ref, update))

    # Attention over a KV cache whose tails are NaN (never read).
    kv_lens = jnp.asarray(computed + np.asarray(LENGTHS), jnp.int32)
    q = normal(NUM_TOKENS, Q_HEADS, ATT_DIM)
    k_cache = np.array(normal(NUM_SLOTS, CACHE_LEN, KV_HEADS, ATT_DIM))
    v_cache = np.array(normal(NUM_SLOTS, CACHE_LEN, KV_HEADS, ATT_DIM))
    for s, n in zip(slots, np.asarray(kv_lens), strict=True):
        if s >= 0:
            k_cache[s, n:] = v_cache[s, n:] = np.nan
    attend = jax.jit(
        lambda: pk.masked_tail_attention(
            q,
            k_cache,
            v_cache,
            query_start_loc=jnp.asarray(qsl),
            kv_lens=kv_lens,
            slot_ids=jnp.asarray(slots),
            implementation=implementation,
        )
    )
    out = attend()
    out_ref = testing.attention_oracle(
        q, k_cache, v_cache, query_start_loc=qsl, kv_lens=kv_lens, slot_ids=slots
    )
    rows.append(
        _row("masked_tail_attention", f"q{list(q.shape)} L={CACHE_LEN} GQA", out, out_ref, attend)
    )

    # Gated grouped RMSNorm.
    xn, zn, wn = normal(NUM_TOKENS, CONV_DIM), normal(NUM_TOKENS, CONV_DIM), normal(CONV_DIM)
    norm = jax.jit(
        lambda: pk.gated_rms_norm(
            xn, zn, wn, group_size=CONV_DIM // GROUPS, implementation=implementation
        )
    )
    y_ref = testing.gated_rms_norm_oracle(xn, zn, wn, group_size=CONV_DIM // GROUPS)
    rows.append(_row("gated_rms_norm", f"x{list(xn.shape)} groups={GROUPS}", norm(), y_ref, norm))
    return rows


PROMPT_LENGTHS = (3, 45, 17, 1, 30, 9)
MAX_NEW_TOKENS = 8


def model_demo(checkpoint: str | None, implementation: str, seed: int = 0) -> dict:
    """Generates for a ragged batch; returns the per-request tokens and the statistics."""
    from flax import nnx

    from flax_models.checkpoint import load_hf_checkpoint
    from flax_models.config import HybridConfig
    from flax_models.model import HybridLM
    from flax_models.serving.batching import Request
    from flax_models.serving.engine import Engine

    def build(impl):
        if checkpoint:
            return load_hf_checkpoint(checkpoint, implementation=impl)
        return HybridLM(HybridConfig.tiny(), implementation=impl, rngs=nnx.Rngs(seed))

    model, reference = build(implementation), build("xla")
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, model.cfg.vocab_size, n)] for n in PROMPT_LENGTHS]
    engine = Engine(model, max_slots=4, max_len=64, token_budget=16)
    engine.warmup()
    generated = engine.generate(prompts, MAX_NEW_TOKENS)

    # Serving path vs plain xla forward: chunked prefill of prompt + generated tokens.
    # A fresh sequence (num_computed = 0) in slot 0 never reads what the last one left.
    worst, check = 0.0, Engine(model, max_slots=1, max_len=64, token_budget=16)
    for prompt, tokens in zip(prompts, generated, strict=True):
        sequence = prompt + tokens
        full = np.asarray(reference(jnp.asarray([sequence])))[0]
        done = 0
        while done < len(sequence):
            chunk = sequence[done : done + 16]
            logits = check.step(check.builder.build([], [Request(0, chunk, done)]))[0]
            done += len(chunk)
            worst = max(worst, float(np.max(np.abs(logits - full[done - 1]))))
    return dict(
        prompts=prompts,
        generated=generated,
        stats=engine.stats,
        compiled=engine.compile_count,
        max_logit_diff=worst,
        cfg=model.cfg,
    )


# The shipped trained model (flax_models/assets/kjv-bamba/, tools/train_demo_model.py).
DEMO_MODEL = Path(__file__).resolve().parent / "assets" / "kjv-bamba"


def text_demo(directory: str | Path, implementation: str = "auto") -> list[str]:
    """Text through ``LLM``: a batch with per-request settings, a stream, a chat reply.
    Returns the lines it printed."""
    from flax_models.serving.sampling import SamplingParams
    from flax_models.serving.text import LLM

    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        print(line)

    llm = LLM(
        directory, implementation=implementation, max_slots=4, max_model_len=96, token_budget=32
    )
    shown = os.path.relpath(directory) if Path(directory).is_absolute() else directory
    say(
        f"\ntext: {shown} ({llm.model.cfg.family}, pattern {llm.model.cfg.layer_pattern!r}, "
        f"tokenizer of {llm.tokenizer.get_vocab_size()} tokens, eos ids "
        f"{sorted(llm.eos_token_ids)})"
    )
    prompts = ["In the beginning", "And the LORD said unto Moses,", "Blessed are the", "Then"]
    sampling = [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=24, temperature=0.0, stop=[" into"]),
        SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(max_tokens=24, temperature=1.0, top_k=20, seed=2),
    ]
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    for prompt, params, output in zip(prompts, sampling, outputs, strict=True):
        completion = output.outputs[0]
        settings = (
            "greedy"
            if params.greedy
            else f"T={params.temperature} top_k={params.top_k} top_p={params.top_p}"
        )
        if params.stop:
            settings += f", stop={list(params.stop)}"
        say(
            f"  generate {prompt!r} ({settings}) -> {completion.text!r} "
            f"[{completion.finish_reason}, {len(completion.token_ids)} tokens]"
        )
    pieces = list(llm.stream("And God said,", sampling[2]))
    say(f"  stream 'And God said,' -> {pieces}")
    if llm.chat_template is None:  # the shipped model is a plain language model
        return lines
    messages = [{"role": "user", "content": "Hi! Tell me a story."}]
    params = SamplingParams(max_tokens=8, temperature=0.7, seed=3)
    reply = llm.chat(messages, params, use_tqdm=False)[0]
    completion = reply.outputs[0]
    say(f"  chat prompt {reply.prompt!r} -> {completion.text!r} [{completion.finish_reason}]")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="a Hugging Face model directory")
    parser.add_argument(
        "--text",
        default=str(DEMO_MODEL),
        help="a Hugging Face directory with tokenizer.json (default: the shipped KJV model)",
    )
    parser.add_argument("--implementation", default="auto", choices=pk.IMPLEMENTATIONS)
    args = parser.parse_args()
    print(
        f"jax {jax.__version__} on {jax.devices()[0].device_kind}, "
        f"implementation={args.implementation!r}"
    )

    result = model_demo(args.checkpoint, args.implementation)
    cfg = result["cfg"]
    print(
        f"\nmodel: {args.checkpoint or 'tiny random-init hybrid'} ({cfg.family}, pattern "
        f"{cfg.layer_pattern!r}, hidden {cfg.hidden_size}, vocab {cfg.vocab_size})"
    )
    for i, (prompt, tokens) in enumerate(zip(result["prompts"], result["generated"], strict=True)):
        print(f"  request {i}: prompt of {len(prompt):>2} tokens -> {tokens}")
    stats = result["stats"]
    for kind in ("prefill", "decode"):
        seconds = stats[f"{kind}_seconds"]
        rate = stats[f"{kind}_tokens"] / seconds if seconds else 0.0
        print(
            f"  {kind:<8} {stats[f'{kind}_tokens']:>4} tokens in {seconds:.3f} s "
            f"({rate:.0f} tokens/s)"
        )
    print(f"  compiled programs: {result['compiled']} (all buckets, at warm-up)")
    print(
        f"  largest logit difference, serving path vs xla forward: {result['max_logit_diff']:.2e}"
    )

    if args.text:
        try:
            text_demo(args.text, args.implementation)
        except ModuleNotFoundError as error:  # tokenizers / jinja2 not installed here
            print(f"\ntext: skipped ({error}; pip install tokenizers jinja2)")

    print(
        f"\nkernels on a ragged batch: lengths={list(LENGTHS)} computed={list(COMPUTED)} "
        f"slots={list(SLOTS)}"
    )
    rows = kernel_table(args.implementation)
    header = f"{'op':<24}{'shape':<30}{'rel err':>10}{'max abs':>10}{'ms':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['op']:<24}{r['shape']:<30}{r['rel']:>10.2e}{r['max_abs']:>10.2e}{r['ms']:>9.3f}")


if __name__ == "__main__":
    main()
