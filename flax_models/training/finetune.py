"""Supervised fine-tuning of a Hugging Face checkpoint on a JSONL file, the library's
training pieces put together: ``python -m flax_models.finetune MODEL --data FILE --output
DIR``::

    python -m flax_models.finetune tests/fixtures/text --data chats.jsonl --output out \\
        --lora-rank 8 --epochs 3 --batch-size 8 --max-len 512

The file's lines are ``{"text": ...}`` (every token scored) or ``{"messages": [...]}``
(rendered with the chat template, only the assistant turns scored): see
``flax_models.training.sft_data``. Examples are cut to ``--max-len`` tokens (those then
left with no target are dropped, with a warning) and right-padded into batches of one
shape ``input_ids[B, L]``, ``labels[B, L]`` (``L`` the longest example: one compilation;
a short last batch gets rows that score nothing). A held-out split is evaluated
(``evaluate``: loss and perplexity) before training, every ``--eval-every`` steps and at
the end. The optimizer is ``default_optimizer`` (AdamW, fp32 state, clipping) on a
``warmup_cosine`` schedule (5 % warm-up); with ``--lora-rank`` the model gets
``add_lora`` adapters and only they train (``trainable=nnx.LoRAParam``). ``DIR`` gets the
model (``save_hf_checkpoint``, adapters merged, the tokenizer copied), with LoRA the PEFT
adapter in ``DIR/adapter``, and ``finetune_log.json`` (options, example counts, per-step
train losses and learning rates, evaluations).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

import pallas_kernels as pk
from flax_models.checkpoint import load_hf_checkpoint
from flax_models.lora import add_lora, merge_lora, save_lora_adapter
from flax_models.model import HybridLM
from flax_models.save import save_hf_checkpoint
from flax_models.serving.outputs import progress_bar
from flax_models.serving.text import resolve_dtype, resolve_model
from flax_models.training.evaluate import evaluate
from flax_models.training.optimizer import default_optimizer, make_optimizer, warmup_cosine
from flax_models.training.sft_data import (
    Example,
    TextFormat,
    make_batches,
    read_examples,
    split,
    truncate,
)
from flax_models.training.step import train_step

logger = logging.getLogger(__name__)

LOG_FILE = "finetune_log.json"
ADAPTER_DIR = "adapter"
# Fraction of the steps spent warming the learning rate up.
_WARMUP_FRACTION = 0.05


def train(
    model: HybridLM,
    train_examples: Sequence[Example],
    eval_examples: Sequence[Example],
    *,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    eval_every: int | None = None,
    pad_id: int = 0,
    lora: bool = False,
    seed: int = 0,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Fine-tunes ``model`` in place on ``train_examples`` (shuffled every epoch) and
    returns the log: ``{"train": [{"step", "epoch", "loss", "learning_rate"}], "eval":
    [{"step", "loss", "perplexity", "tokens"}], "steps", "seconds"}``.

    Args:
      eval_every: steps between evaluations of ``eval_examples`` (also before the first
        step and after the last; default once per epoch; none without held-out examples).
      lora: train the ``nnx.LoRAParam`` adapters alone (``add_lora`` first); else every
        ``nnx.Param``.
      progress: the progress bar on stderr (None: when stderr is a terminal).
    """
    if epochs < 1 or batch_size < 1 or not train_examples:
        raise ValueError(f"need {epochs=} >= 1, {batch_size=} >= 1 and training examples")
    if eval_every is not None and eval_every < 1:
        raise ValueError(f"{eval_every=} must be >= 1")
    length = max(len(e.input_ids) for e in [*train_examples, *eval_examples])
    per_epoch = math.ceil(len(train_examples) / batch_size)
    total = epochs * per_epoch
    eval_every = per_epoch if eval_every is None else eval_every
    schedule = warmup_cosine(
        learning_rate, warmup_steps=int(_WARMUP_FRACTION * total), total_steps=total
    )
    trainable = nnx.LoRAParam if lora else nnx.Param
    optimizer = make_optimizer(model, default_optimizer(schedule), trainable=trainable)
    options = dict(batch_size=batch_size, length=length, pad_id=pad_id)
    held_out = make_batches(eval_examples, **options) if eval_examples else []
    log: dict[str, Any] = {"train": [], "eval": []}

    def run_eval(step: int) -> None:
        if held_out:
            result = {"step": step, **evaluate(model, held_out)}
            log["eval"].append(result)
            logger.info(
                "step %d: eval loss %.4f, perplexity %.3f",
                step,
                result["loss"],
                result["perplexity"],
            )

    rng = np.random.default_rng(seed)
    start, step = time.perf_counter(), 0
    run_eval(0)
    with progress_bar(total, enabled=progress, desc="finetune", unit="step") as bar:
        for epoch in range(1, epochs + 1):
            order = rng.permutation(len(train_examples))
            shuffled = [train_examples[i] for i in order]
            for batch in make_batches(shuffled, **options):
                rate = float(schedule(step))  # the rate of this update (optax counts from 0)
                loss = float(train_step(model, optimizer, *batch))
                step += 1
                log["train"].append(
                    {"step": step, "epoch": epoch, "loss": loss, "learning_rate": rate}
                )
                bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                bar.update(1)
                if step % eval_every == 0 and step < total:
                    run_eval(step)
    run_eval(step)
    log["steps"], log["seconds"] = step, time.perf_counter() - start
    return log


# ------------------------------------------------------------------------ the CLI


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked: an argparse error (exit 2) names a bad argument."""
    parser = argparse.ArgumentParser(
        prog="python -m flax_models.finetune",
        description="Supervised fine-tuning of a Hugging Face checkpoint on a JSONL file.",
    )
    parser.add_argument("model", help="Hugging Face directory (or Hub id in the local cache)")
    parser.add_argument("--data", required=True, help='JSONL: {"text"} or {"messages"} lines')
    parser.add_argument("--output", required=True, help="directory for the fine-tuned model")
    parser.add_argument("--lora-rank", type=int, default=None, help="train LoRA adapters only")
    parser.add_argument("--lora-alpha", type=float, default=None, help="default: 2 × rank")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=1024, help="tokens per example")
    parser.add_argument(
        "--learning-rate", type=float, default=None, help="peak; default 2e-5, 2e-4 with LoRA"
    )
    parser.add_argument(
        "--eval-fraction", type=float, default=None, help="default 0.1 (0 under 10 examples)"
    )
    parser.add_argument("--eval-every", type=int, default=None, help="steps; default an epoch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto"
    )
    parser.add_argument("--implementation", choices=pk.IMPLEMENTATIONS, default="auto")
    args = parser.parse_args(argv)
    if not Path(args.data).is_file():
        parser.error(f"--data {args.data}: no such file")
    positive = ["epochs", "batch_size", "eval_every", "lora_rank"]
    for name in positive:
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_len < 2:
        parser.error(
            f"--max-len must be >= 2 (a target needs a token before it), got {args.max_len}"
        )
    if args.learning_rate is not None and not args.learning_rate > 0:
        parser.error(f"--learning-rate must be > 0, got {args.learning_rate}")
    if args.eval_fraction is not None and not 0 <= args.eval_fraction < 1:
        parser.error(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
    if args.lora_alpha is not None and (args.lora_rank is None or not args.lora_alpha > 0):
        parser.error(f"--lora-alpha {args.lora_alpha} needs --lora-rank and must be > 0")
    return args


def run(args: argparse.Namespace, *, progress: bool | None = None) -> tuple[HybridLM, dict]:
    """Loads, fine-tunes and saves as ``args`` say (:func:`parse_args`); returns the trained
    model (adapters merged) and the log written to ``DIR/finetune_log.json``."""
    directory = resolve_model(args.model)
    fmt = TextFormat.from_directory(directory)
    examples, counts = truncate(read_examples(args.data, fmt), args.max_len)
    if counts["truncated"] or counts["dropped"]:
        logger.warning(
            "%d example(s) cut to --max-len %d; %d dropped (no target left)",
            counts["truncated"],
            args.max_len,
            counts["dropped"],
        )
    if not examples:
        raise ValueError(f"{args.data}: no example has a target within --max-len {args.max_len}")
    fraction = args.eval_fraction
    if fraction is None:
        fraction = 0.1 if len(examples) >= 10 else 0.0
    rng = np.random.default_rng(args.seed)
    train_examples, eval_examples = split(examples, fraction, rng)
    logger.info("%d training and %d held-out examples", len(train_examples), len(eval_examples))

    config = json.loads((directory / "config.json").read_text())
    model = load_hf_checkpoint(
        directory, dtype=resolve_dtype(args.dtype, config), implementation=args.implementation
    )
    lora = args.lora_rank is not None
    if lora:
        alpha = 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
        add_lora(model, rank=args.lora_rank, alpha=alpha, rngs=nnx.Rngs(args.seed))
    learning_rate = args.learning_rate or (2e-4 if lora else 2e-5)
    pad_id = config.get("pad_token_id")
    log = train(
        model,
        train_examples,
        eval_examples,
        epochs=args.epochs,
        batch_size=args.batch_size,
        learning_rate=learning_rate,
        eval_every=args.eval_every,
        pad_id=pad_id if isinstance(pad_id, int) and 0 <= pad_id < model.cfg.vocab_size else 0,
        lora=lora,
        seed=args.seed,
        progress=progress,
    )

    output = Path(args.output)
    if lora:
        save_lora_adapter(model, output / ADAPTER_DIR, base_model_name_or_path=str(args.model))
        merge_lora(model)
    save_hf_checkpoint(model, output, tokenizer_from=directory)
    options = vars(args) | {
        "learning_rate": learning_rate,
        "eval_fraction": fraction,
    }
    log = {
        "options": options,
        "examples": {"train": len(train_examples), "eval": len(eval_examples), **counts},
        **log,
    }
    (output / LOG_FILE).write_text(json.dumps(log, indent=2) + "\n")
    return model, log


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: fine-tunes, saves, prints a summary; a bad data file or option exits with
    ``error: ...`` (the file and line)."""
    args = parse_args(argv)
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    # The library's INFO messages on stderr (importing orbax may have given the root logger
    # its own handler already, which basicConfig then leaves as it is).
    logging.getLogger("flax_models").setLevel(logging.INFO)
    try:
        _, log = run(args)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    final = log["eval"][-1] if log["eval"] else None
    last = log["train"][-1]["loss"]
    summary = f"[{log['steps']} steps in {log['seconds']:.1f} s; last train loss {last:.4f}"
    if final is not None:
        summary += f"; eval loss {final['loss']:.4f}, perplexity {final['perplexity']:.3f}"
    print(summary + f"; saved to {args.output}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
