"""Trains a small hybrid Mamba2/attention model on the King James Bible and saves it as a
Hugging Face directory that ``flax_models.LLM`` serves: the model ``make demo`` shows.

Corpus (public domain: the KJV's copyright, from 1611, has expired, as the Debian
package's ``copyright`` file says), from Debian's ``bible-kjv-text`` (compressed text)
and ``bible-kjv`` (its reader), one verse a line::

    cd /tmp && apt-get download bible-kjv-text bible-kjv
    dpkg -x bible-kjv-text_*.deb kjv && dpkg -x bible-kjv_*.deb kjv
    kjv/usr/bin/bible -f -p kjv/usr/lib 'gen1:1-rev22:21' > kjv.txt   # 31,102 verses

    PYTHONPATH=. python3 tools/train_demo_model.py --corpus /tmp/kjv.txt --output OUT

``--corpus`` is that file (``Ge1:1 In the beginning God created ...``: a chapter becomes
a document, its verses joined into paragraphs), or any UTF-8 text, whose blank-line
separated paragraphs are grouped into documents of about 2,000 characters.

Steps, all with this library's code:

1. Documents: 2 % (at least one) held out for evaluation, chosen with ``--seed``.
2. Tokenizer: a byte-level BPE (Hugging Face ``tokenizers``, GPT-2's pre-tokenizer and
   decoder, every byte in the alphabet: nothing is unknown) trained on the training
   documents, ``<|endoftext|>`` (id 0) ending every document: the eos.
3. Model: a Bamba-family ``HybridConfig`` (``MM*MM*``: four Mamba2 mixers, two attention
   layers, a SwiGLU MLP after each, tied embeddings), fp32 parameters, ``HybridLM`` with
   ``implementation="auto"`` (the Pallas kernels on a GPU, XLA on a CPU).
4. Training: ``flax_models.training``: documents packed by ``pack_documents`` (several per
   row, kept apart), ``train_step`` with ``packed_loss``, AdamW with warm-up and cosine
   decay (``default_optimizer``), held-out loss and perplexity by ``evaluate``.
5. Saving: ``save_hf_checkpoint`` (bf16 weights, with the tokenizer and
   ``generation_config.json`` from ``tokenizer_from``), then ``training_log.json``.
6. Check: the saved directory loaded by ``LLM`` (fp32) generates greedily from held-out
   prompts with ``logprobs``; each returned log-probability is compared with the
   log-softmax of the same model's training forward (``model(ids)``, fp32) at the same
   position. The largest difference goes into the log (it must be <= 1e-3).

``--quick``: a tiny model, a few steps on part of the corpus, for a CPU smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import pallas_kernels as pk
from flax_models import LLM, HybridConfig, HybridLM, SamplingParams, save_hf_checkpoint
from flax_models.training import (
    default_optimizer,
    evaluate,
    make_optimizer,
    pack_documents,
    packed_loss,
    scored_targets,
    train_step,
)

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS]  # id 0: eos, and the padding id (padding scores nothing)
HELD_OUT_FRACTION = 0.02
LOGPROB_TOLERANCE = 1e-3
VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")  # "1Sm3:10 And the LORD came"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Budget:
    """The sizes of one run (``--quick`` or the real one)."""

    vocab_size: int  # BPE vocabulary asked for (the model's is what the trainer makes)
    hidden_size: int
    layer_pattern: str
    mamba_num_heads: int
    mamba_head_dim: int
    mamba_state_size: int
    mamba_chunk_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    seq_len: int  # L: tokens per packed row
    batch_rows: int  # R: rows per batch
    steps: int
    warmup_steps: int
    learning_rate: float
    eval_every: int
    log_every: int
    max_documents: int | None  # None: the whole corpus; else the first this many
    check_prompts: tuple[int, ...]  # prompt lengths (tokens) of the logprob check
    check_new_tokens: int
    token_budget: int  # the engine's tokens per step (prompts longer are chunked)


REAL = Budget(
    vocab_size=4096,
    hidden_size=256,
    layer_pattern="MM*MM*",
    mamba_num_heads=8,
    mamba_head_dim=64,
    mamba_state_size=64,
    mamba_chunk_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=320,  # 4.6M parameters: 9.3 MB of bf16 weights
    seq_len=512,
    batch_rows=32,
    steps=2000,
    warmup_steps=100,
    learning_rate=2e-3,
    eval_every=250,
    log_every=25,
    max_documents=None,
    check_prompts=(48, 100, 200, 300),
    check_new_tokens=32,
    token_budget=128,
)
QUICK = Budget(
    vocab_size=512,
    hidden_size=64,
    layer_pattern="M*",
    mamba_num_heads=2,
    mamba_head_dim=64,
    mamba_state_size=16,
    mamba_chunk_size=16,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    intermediate_size=128,
    seq_len=64,
    batch_rows=4,
    steps=6,
    warmup_steps=2,
    learning_rate=3e-3,
    eval_every=3,
    log_every=1,
    max_documents=120,
    check_prompts=(12, 40),
    check_new_tokens=8,
    token_budget=32,
)


# ------------------------------------------------------------------------ corpus


def read_documents(path: Path) -> list[str]:
    """The corpus as documents: one per chapter of a ``bible -f`` dump (verses joined by
    spaces into paragraphs of up to four, paragraphs on lines of their own), else
    blank-line separated paragraphs grouped into documents of about 2,000 characters."""
    lines = path.read_text(encoding="utf-8").splitlines()
    verses = [VERSE.match(line) for line in lines if line.strip()]
    if verses and all(verses):
        chapters: dict[tuple[str, str], list[str]] = {}
        for v in verses:
            chapters.setdefault((v[1], v[2]), []).append(" ".join(v[4].split()))
        return [
            "\n".join(" ".join(text[i : i + 4]) for i in range(0, len(text), 4))
            for text in chapters.values()
        ]
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", "\n".join(lines))]
    documents, current = [], []
    for paragraph in filter(None, paragraphs):
        current.append(paragraph)
        if sum(map(len, current)) >= 2000:
            documents.append("\n".join(current))
            current = []
    return documents + (["\n".join(current)] if current else [])


def split_documents(
    documents: Sequence[str], *, seed: int, fraction: float = HELD_OUT_FRACTION
) -> tuple[list[str], list[str]]:
    """``(train, held_out)``: ``fraction`` of the documents (at least one) drawn at random
    with ``seed`` for evaluation, the rest shuffled for training."""
    if len(documents) < 2:
        raise ValueError(f"need at least two documents, got {len(documents)}")
    order = np.random.default_rng(seed).permutation(len(documents))
    held = max(1, round(fraction * len(documents)))
    return [documents[i] for i in order[held:]], [documents[i] for i in sorted(order[:held])]


def train_tokenizer(documents: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of at most ``vocab_size`` tokens: ``<|endoftext|>`` (id 0), the 256
    byte symbols, then merges learnt from ``documents``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


def encode_documents(tokenizer: Tokenizer, documents: Sequence[str]) -> list[list[int]]:
    """Each document's token ids followed by the eos (id 0)."""
    eos = tokenizer.token_to_id(EOS)
    return [e.ids + [eos] for e in tokenizer.encode_batch(list(documents))]


def write_tokenizer_files(tokenizer: Tokenizer, directory: Path, seq_len: int) -> None:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` (eos,
    sampling defaults) into ``directory``, for ``save_hf_checkpoint(tokenizer_from=)``."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"), pretty=False)
    eos = tokenizer.token_to_id(EOS)
    files = {
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS,
            "pad_token": EOS,
            "bos_token": None,
            "unk_token": None,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": seq_len,
        },
        "generation_config.json": {
            "eos_token_id": eos,
            "pad_token_id": eos,
            "do_sample": True,
            "temperature": 0.8,
            "top_p": 0.9,
            "max_new_tokens": 128,
        },
    }
    for name, payload in files.items():
        (directory / name).write_text(json.dumps(payload, indent=2) + "\n")


# ------------------------------------------------------------------------ model


def model_config(budget: Budget, vocab_size: int) -> HybridConfig:
    """The Bamba-family config of ``budget`` with the tokenizer's ``vocab_size``."""
    return HybridConfig(
        family="bamba",
        vocab_size=vocab_size,
        hidden_size=budget.hidden_size,
        layer_pattern=budget.layer_pattern,
        mlp_per_layer=True,
        tie_word_embeddings=True,
        mamba_num_heads=budget.mamba_num_heads,
        mamba_head_dim=budget.mamba_head_dim,
        mamba_state_size=budget.mamba_state_size,
        mamba_groups=1,
        mamba_chunk_size=budget.mamba_chunk_size,
        num_heads=budget.num_heads,
        num_kv_heads=budget.num_kv_heads,
        head_dim=budget.head_dim,
        partial_rotary_factor=0.5,
        intermediate_size=budget.intermediate_size,
    )


def parameter_count(model: HybridLM) -> int:
    return sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))


def batch_tokens(batch: Sequence[np.ndarray]) -> tuple[int, int]:
    """``(tokens, scored targets)`` of a packed batch (``tokens[T]``, padding included)."""
    return int(np.asarray(batch[0]).size), scored_targets(batch)


def train(
    model: HybridLM,
    train_batches: Sequence[Sequence[np.ndarray]],
    held_batches: Sequence[Sequence[np.ndarray]],
    budget: Budget,
    *,
    steps: int,
    seed: int,
    max_train_seconds: float,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """``steps`` optimizer steps over ``train_batches`` (packed ``tokens[R·L],
    query_start_loc[D+1], labels[R·L]``; their order reshuffled every epoch); returns the
    curve, held-out evaluations, tokens seen and timings. Stops early past
    ``max_train_seconds`` of training, or after ``stop_after`` steps (the schedule still
    the one of ``steps``: a run cut short, reproducibly)."""
    loss = packed_loss(budget.seq_len)
    tx = default_optimizer(
        budget.learning_rate,
        weight_decay=0.1,
        warmup_steps=min(budget.warmup_steps, steps),
        total_steps=steps,
    )
    optimizer = make_optimizer(model, tx)
    rng = np.random.default_rng(seed)
    curve: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    pending: list[tuple[int, jax.Array]] = []
    tokens_seen = targets_seen = 0
    order: list[int] = []
    start = time.perf_counter()
    first_step_s = None
    stopped_early = False

    def flush() -> None:
        for step, value in pending:
            curve.append({"step": step, "loss": float(value)})
        pending.clear()

    def held_out(step: int) -> None:
        flush()
        result = evaluate(model, held_batches, loss=loss)
        evals.append({"step": step, **result})
        print(f"step {step:5d}  held-out loss {result['loss']:.4f}  ppl {result['perplexity']:.2f}")

    held_out(0)
    train_start = time.perf_counter()
    for step in range(1, steps + 1):
        if not order:
            order = list(rng.permutation(len(train_batches)))
        batch = train_batches[order.pop()]
        pending.append((step, train_step(model, optimizer, *batch, loss=loss)))
        tokens, targets = batch_tokens(batch)
        tokens_seen += tokens
        targets_seen += targets
        if step == 1:
            flush()
            first_step_s = time.perf_counter() - train_start
        if step % budget.log_every == 0 or step == steps:
            flush()
            elapsed = time.perf_counter() - train_start
            print(
                f"step {step:5d}  loss {curve[-1]['loss']:.4f}  "
                f"{tokens_seen / max(elapsed, 1e-9):,.0f} tokens/s  {elapsed:.0f} s"
            )
            if elapsed > max_train_seconds and step < steps:
                print(f"stopping: {elapsed:.0f} s passed --max-train-seconds={max_train_seconds}")
                stopped_early = True
        if stop_after is not None and step == stop_after and step < steps:
            flush()
            print(f"stopping after step {step} (--stop-after)")
            stopped_early = True
        if step % budget.eval_every == 0 or step == steps or stopped_early:
            held_out(step)
        if stopped_early:
            break
    flush()
    return {
        "curve": curve,
        "held_out_curve": evals,
        "steps_run": curve[-1]["step"] if curve else 0,
        "stopped_early": stopped_early,
        "tokens_seen": tokens_seen,
        "targets_seen": targets_seen,
        "first_step_seconds": first_step_s,
        "train_seconds": time.perf_counter() - train_start,
        "seconds_with_evaluation": time.perf_counter() - start,
    }


# ------------------------------------------------------------------------ check


def check_logprobs(
    directory: Path,
    held_out_ids: Sequence[Sequence[int]],
    budget: Budget,
    implementation: str = "auto",
) -> dict[str, Any]:
    """Serving equals training: ``LLM(directory, dtype="float32")`` generates
    ``check_new_tokens`` greedy tokens with ``logprobs=5`` from held-out prompts of the
    ``check_prompts`` lengths (longer than ``token_budget``: chunked prefill), all in one
    batch; each returned ``{token: logprob}`` is compared with ``log_softmax`` of
    ``llm.model(ids[B, L])`` (the training forward, fp32, prompts and generated tokens
    right-padded to one length) at the same position."""
    documents = sorted(held_out_ids, key=len, reverse=True)
    prompts = [list(doc[:n]) for doc, n in zip(documents, budget.check_prompts, strict=False)]
    new = budget.check_new_tokens
    llm = LLM(
        directory,
        dtype="float32",
        implementation=implementation,
        max_model_len=budget.seq_len,
        max_slots=len(prompts),
        token_budget=budget.token_budget,
        decode_buckets=(len(prompts),),
        token_buckets=(budget.token_budget,),
    )
    params = SamplingParams(temperature=0.0, top_p=1.0, max_tokens=new, logprobs=5, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True)]
    length = max(map(len, sequences))
    ids = np.zeros((len(sequences), length), np.int32)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq
    forward = nnx.jit(lambda model, x: jax.nn.log_softmax(model(x).astype(jnp.float32), axis=-1))
    reference = np.asarray(forward(llm.model, ids))
    diffs, compared, argmax_agree = [], 0, 0
    for row, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        completion = out.outputs[0]
        for i, (token, entry) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            position = len(prompt) - 1 + i  # the logits that drew generated token i
            argmax_agree += int(np.argmax(reference[row, position]) == token)
            for tok, value in entry.items():
                logprob = getattr(value, "logprob", value)
                diffs.append(abs(float(logprob) - float(reference[row, position, tok])))
                compared += 1
    max_diff = max(diffs)
    return {
        "prompt_lengths": [len(p) for p in prompts],
        "new_tokens": new,
        "logprobs_compared": compared,
        "max_abs_diff": max_diff,
        "mean_abs_diff": float(np.mean(diffs)),
        "greedy_tokens_equal_forward_argmax": f"{argmax_agree}/{len(prompts) * new}",
        "tolerance": LOGPROB_TOLERANCE,
        "passed": bool(max_diff <= LOGPROB_TOLERANCE),
        "engine": "LLM(dtype='float32'), greedy, logprobs=5",
        "sample": {
            "prompt": llm.decode(prompts[0][-40:]),
            "greedy_completion": outputs[0].outputs[0].text,
        },
    }


def directory_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


# ------------------------------------------------------------------------ main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help="kjv.txt (bible -f) or text")
    parser.add_argument("--output", type=Path, required=True, help="the Hugging Face directory")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: budget)")
    parser.add_argument("--seed", type=int, default=0, help="held-out split, init, batch order")
    parser.add_argument("--quick", action="store_true", help="tiny model, a few steps (CPU)")
    parser.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="N",
        help="stop after N steps (the learning-rate schedule stays the one of --steps)",
    )
    parser.add_argument(
        "--evaluate-only",
        action="store_true",
        help="train nothing: evaluate --output's saved model (held-out perplexity, the "
        "logprob check) and write its evaluation.json",
    )
    parser.add_argument(
        "--implementation",
        default="auto",
        choices=pk.IMPLEMENTATIONS,
        help="the kernels of training and of the check (auto)",
    )
    parser.add_argument(
        "--max-train-seconds",
        type=float,
        default=540.0,
        help="stop training (then evaluate and save) once this much time has passed",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the whole recipe; returns what it wrote to ``training_log.json``."""
    args = parse_args(argv)
    budget = QUICK if args.quick else REAL
    steps = budget.steps if args.steps is None else args.steps
    if steps < 1:
        raise SystemExit(f"--steps={steps} must be >= 1")
    wall = time.perf_counter()
    device = jax.devices()[0]
    print(f"jax {jax.__version__} on {device.device_kind} ({device.platform})")

    corpus = args.corpus.read_bytes()
    documents = read_documents(args.corpus)
    if budget.max_documents is not None:
        documents = documents[: budget.max_documents]
    train_docs, held_docs = split_documents(documents, seed=args.seed)
    if args.evaluate_only:
        return evaluate_saved(args, budget, corpus, held_docs)
    tokenizer = train_tokenizer(train_docs, budget.vocab_size)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    train_ids = encode_documents(tokenizer, train_docs)
    held_ids = encode_documents(tokenizer, held_docs)
    print(
        f"{len(documents)} documents ({len(held_docs)} held out), "
        f"{sum(map(len, train_ids)):,} training tokens, vocab {vocab_size}"
    )

    train_batches = packed_batches(train_ids, budget)
    held_batches = packed_batches(held_ids, budget)
    cfg = model_config(budget, vocab_size)
    model = HybridLM(
        cfg, dtype=jnp.float32, implementation=args.implementation, rngs=nnx.Rngs(args.seed)
    )
    params = parameter_count(model)
    print(f"{params:,} parameters, pattern {cfg.layer_pattern!r}, {len(train_batches)} batches")

    run = train(
        model,
        train_batches,
        held_batches,
        budget,
        steps=steps,
        seed=args.seed,
        max_train_seconds=args.max_train_seconds,
        stop_after=args.stop_after,
    )

    out = args.output
    with tempfile.TemporaryDirectory() as staging:
        write_tokenizer_files(tokenizer, Path(staging), budget.seq_len)
        save_hf_checkpoint(model, out, dtype=jnp.bfloat16, tokenizer_from=staging)
    config = json.loads((out / "config.json").read_text())
    eos = tokenizer.token_to_id(EOS)
    config |= {"eos_token_id": eos, "pad_token_id": eos, "max_position_embeddings": budget.seq_len}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    saved, check = score_saved(out, held_ids, budget, args.implementation)
    log = {
        "corpus": {
            "path": str(args.corpus),
            "sha256": hashlib.sha256(corpus).hexdigest(),
            "source": "Debian bible-kjv-text 4.38 (King James Version, public domain)",
            "documents": len(documents),
            "held_out_documents": len(held_docs),
            "training_tokens": sum(map(len, train_ids)),
            "held_out_tokens": sum(map(len, held_ids)),
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "budget": dataclasses.asdict(budget) | {"steps": steps},
        "config": {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.compare},
        "parameters": params,
        "device": f"{device.device_kind} ({device.platform})",
        "jax": jax.__version__,
        **run,
        "held_out": run["held_out_curve"][-1],
        "held_out_saved_bf16": saved,
        "logprob_check": check,
        "wall_seconds": time.perf_counter() - wall,
    }
    log["config"]["time_step_limit"] = [
        x if math.isfinite(x) else str(x) for x in cfg.time_step_limit
    ]  # JSON has no inf
    (out / "training_log.json").write_text(json.dumps(log, indent=2, default=_json) + "\n")
    log["directory_bytes"] = directory_bytes(out)
    (out / "training_log.json").write_text(json.dumps(log, indent=2, default=_json) + "\n")
    print(
        f"held-out perplexity {log['held_out']['perplexity']:.2f} (saved bf16: "
        f"{saved['perplexity']:.2f}); {out} holds {log['directory_bytes'] / 1e6:.1f} MB; "
        f"{log['wall_seconds']:.0f} s in all"
    )
    return log


def packed_batches(ids: Sequence[Sequence[int]], budget: Budget) -> list[tuple]:
    """``pack_documents`` rows of ``budget``'s shape: ``(tokens, query_start_loc, labels)``."""
    pack = dict(rows=budget.batch_rows, length=budget.seq_len)
    return [tuple(b) for b in pack_documents(ids, **pack)]


def score_saved(
    out: Path, held_ids: Sequence[Sequence[int]], budget: Budget, implementation: str
) -> tuple[dict[str, float], dict[str, Any]]:
    """The saved directory's (bf16-rounded) weights in fp32 on the held-out documents
    (loss, perplexity), then the logprob check; prints both."""
    from flax_models import load_hf_checkpoint

    model = load_hf_checkpoint(out, dtype=jnp.float32, implementation=implementation)
    saved = evaluate(model, packed_batches(held_ids, budget), loss=packed_loss(budget.seq_len))
    check = check_logprobs(out, held_ids, budget, implementation)
    print(
        f"held-out perplexity of the saved weights {saved['perplexity']:.2f}; engine vs "
        f"training forward: max |Δ logprob| {check['max_abs_diff']:.2e} over "
        f"{check['logprobs_compared']} values ({'ok' if check['passed'] else 'FAILED'})"
    )
    return saved, check


def evaluate_saved(
    args: argparse.Namespace, budget: Budget, corpus: bytes, held_docs: Sequence[str]
) -> dict[str, Any]:
    """``--evaluate-only``: the held-out documents (the same split) through the saved
    directory's own tokenizer and weights (fp32): held-out loss and perplexity, then the
    logprob check; written to ``evaluation.json`` beside the model."""
    out = args.output
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    held_ids = encode_documents(tokenizer, held_docs)
    saved, check = score_saved(out, held_ids, budget, args.implementation)
    device = jax.devices()[0]
    log = {
        "corpus_sha256": hashlib.sha256(corpus).hexdigest(),
        "held_out_documents": len(held_docs),
        "held_out_tokens": sum(map(len, held_ids)),
        "held_out_saved_bf16": saved,
        "logprob_check": check,
        "device": f"{device.device_kind} ({device.platform})",
        "jax": jax.__version__,
        "implementation": args.implementation,
    }
    (out / "evaluation.json").write_text(json.dumps(log, indent=2, default=_json) + "\n")
    return log


def _json(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result["logprob_check"]["passed"] else 1)
