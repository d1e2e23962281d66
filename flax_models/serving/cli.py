"""Generate text from a Hugging Face directory: ``python -m flax_models.generate DIR``.

    python -m flax_models.generate tests/fixtures/text --prompt "Hello" --max-new-tokens 32
    python -m flax_models.generate DIR --prompt "Tell me a story" --chat --temperature 0.8 \\
        --top-p 0.95 --seed 1
    python -m flax_models.generate DIR --prompts-file prompts.txt > completions.jsonl

With ``--prompt`` the completion streams to stdout as its tokens are drawn, followed by a
line with the token count and tokens/s. With ``--prompts-file`` (one prompt per line) the
prompts run as one continuously batched generation, with a progress bar over requests on
stderr, and stdout gets one JSON line per prompt, in order (``index``, ``prompt``,
``text``, ``finish_reason``, ``num_tokens``); prompt ``i`` samples with seed ``--seed + i``,
so identical prompts give independent samples. ``--chat`` renders each prompt as a user
message with the directory's chat template. The engine compiles the programs a
generation needs as it first meets them, and the rate counts that time (the summary says
how many were compiled); ``--warmup`` compiles every program first, so that the rate counts
generation only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import pallas_kernels as pk
from flax_models.serving.sampling import SamplingParams
from flax_models.serving.text import LLM


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m flax_models.generate", description=__doc__.splitlines()[0]
    )
    parser.add_argument("directory", help="Hugging Face directory with tokenizer.json")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt; its completion streams to stdout")
    source.add_argument("--prompts-file", help="a text file, one prompt per line")
    parser.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=-1, help="-1: off")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeat)")
    parser.add_argument("--chat", action="store_true", help="apply the chat template")
    parser.add_argument("--system", default=None, help="a system message (with --chat)")
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto"
    )
    parser.add_argument("--implementation", choices=pk.IMPLEMENTATIONS, default="auto")
    parser.add_argument("--max-slots", type=int, default=None, help="default: 1 or 8")
    parser.add_argument("--max-len", type=int, default=None, help="default: 256")
    parser.add_argument("--token-budget", type=int, default=64)
    parser.add_argument(
        "--warmup", action="store_true", help="compile every program before generating"
    )
    return parser.parse_args(argv)


def _conversation(prompt: str, system: str | None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": prompt}]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prompts_file is not None:
        with open(args.prompts_file, encoding="utf-8") as file:
            prompts = [line.rstrip("\n") for line in file if line.strip()]
        if not prompts:
            raise SystemExit(f"{args.prompts_file}: no prompts")
    else:
        prompts = [args.prompt]
    try:
        sampling = [
            SamplingParams(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=(args.seed + i) % 2**32,
                stop=tuple(args.stop),
            )
            for i in range(len(prompts))
        ]
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    max_slots = args.max_slots or (1 if args.prompt is not None else min(8, len(prompts)))
    llm = LLM(
        args.directory,
        dtype=args.dtype,
        implementation=args.implementation,
        max_slots=max_slots,
        max_model_len=args.max_len or 256,
        token_budget=args.token_budget,
    )
    if args.warmup:
        start = time.perf_counter()
        programs = llm.engine.warmup()
        print(
            f"[compiled {programs} programs in {time.perf_counter() - start:.1f} s]",
            file=sys.stderr,
        )

    compiled = llm.engine.compile_count
    start = time.perf_counter()
    first_piece = None
    if args.prompt is not None:
        prompt = _conversation(args.prompt, args.system) if args.chat else args.prompt
        stream = llm.stream(prompt, sampling[0])
        try:
            while True:
                piece = next(stream)
                first_piece = first_piece or time.perf_counter() - start
                sys.stdout.write(piece)
                sys.stdout.flush()
        except StopIteration as done:
            completions = [done.value.outputs[0]]
        sys.stdout.write("\n")
    else:
        if args.chat:
            conversations = [_conversation(p, args.system) for p in prompts]
            outputs = llm.chat(conversations, sampling, use_tqdm=True)
        else:
            outputs = llm.generate(prompts, sampling, use_tqdm=True)
        completions = [output.outputs[0] for output in outputs]
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            record = dict(
                index=i,
                prompt=prompt,
                text=completion.text,
                finish_reason=completion.finish_reason,
                num_tokens=len(completion.token_ids),
            )
            print(json.dumps(record, ensure_ascii=False))
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in completions)
    reasons = sorted({c.finish_reason for c in completions})
    compiled = llm.engine.compile_count - compiled
    summary = (
        f"[{len(completions)} request(s), {tokens} tokens in {seconds:.2f} s: "
        f"{tokens / seconds:.1f} tokens/s"
        + (f"; first text after {first_piece:.2f} s" if first_piece is not None else "")
        + (f"; {compiled} program(s) compiled on the way" if compiled else "")
        + f"; finish_reason: {', '.join(reasons)}]"
    )
    # Streaming: the summary follows the text on stdout. JSON lines: stderr keeps stdout
    # one record per line.
    print(summary, file=sys.stdout if args.prompt is not None else sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
