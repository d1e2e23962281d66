"""The command line of ``python -m flax_models.serve`` (vLLM's names where vLLM has one)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["default_compilation_cache_dir", "engine_options", "make_arg_parser", "parse_args"]


def default_compilation_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/flax_models/jax``, else ``~/.cache/flax_models/jax``."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "flax_models" / "jax"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def make_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flax_models.serve",
        description="An OpenAI-compatible HTTP server (completions, chat completions, "
        "models, health, Prometheus metrics) for a Hugging Face checkpoint.",
    )
    parser.add_argument("model", help="a checkpoint directory or a Hub id in the local cache")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model name(s) requests give (the first is the one responses carry); "
        "MODEL by default",
    )
    server.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1 routes (401 without it)",
    )
    server.add_argument(
        "--max-waiting-seqs",
        type=_non_negative,
        default=1024,
        metavar="N",
        help="sequences admitted beyond the engine's slots (a request of n completions "
        "counts n); requests past that get 503 (1024)",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="on SIGINT/SIGTERM, seconds to wait for open connections after aborting their "
        "requests (10)",
    )
    server.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        metavar="PID",
        help="shut down when process PID ends (for supervisors and tests)",
    )
    server.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="logging level (info)",
    )
    server.add_argument("--no-access-log", action="store_true", help="no log line per HTTP request")

    model = parser.add_argument_group("model and engine")
    model.add_argument(
        "--dtype",
        default="auto",
        help="weights' dtype: auto (the config's), bfloat16, float16, float32",
    )
    model.add_argument(
        "--implementation",
        default="auto",
        choices=("auto", "xla", "triton", "mosaic"),
        help="the kernels (auto)",
    )
    model.add_argument(
        "--max-model-len",
        type=_positive,
        default=None,
        metavar="N",
        help="prompt + generated tokens per request (the config's, capped by memory)",
    )
    model.add_argument(
        "--max-num-seqs",
        "--max-slots",
        dest="max_slots",
        type=_positive,
        default=None,
        metavar="N",
        help="sequences in flight at once (cache slots); the engine's default",
    )
    model.add_argument(
        "--token-budget",
        type=_positive,
        default=None,
        metavar="N",
        help="prompt tokens per step (the engine's default)",
    )
    model.add_argument(
        "--decode-buckets",
        type=_positive,
        nargs="+",
        default=None,
        metavar="ROWS",
        help="allowed decode-row counts of a step (the engine's default)",
    )
    model.add_argument(
        "--token-buckets",
        type=_positive,
        nargs="+",
        default=None,
        metavar="TOKENS",
        help="allowed prompt-token counts of a step (the engine's default)",
    )
    model.add_argument(
        "--max-prefill-seqs",
        type=_positive,
        default=None,
        metavar="N",
        help="prompts a step computes chunks of, at most (the engine's default)",
    )
    model.add_argument(
        "--mamba-ssm-cache-dtype",
        default=None,
        choices=("auto", "float32", "bfloat16"),  # the engine's MAMBA_SSM_CACHE_DTYPES
        help="the SSM state cache's dtype (the engine's default, float32; auto: the model's)",
    )
    model.add_argument(
        "--kv-block-size", type=_positive, default=None, metavar="N", help="tokens per KV page"
    )
    model.add_argument(
        "--num-kv-blocks", type=_positive, default=None, metavar="N", help="pages in the KV pool"
    )
    model.add_argument(
        "--enable-prefix-caching",
        action="store_true",
        help="reuse the KV pages and Mamba states of repeated prompt prefixes",
    )
    model.add_argument("--seed", type=int, default=0, help="the engine's seed (0)")
    model.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),  # LLM(load_format=)
        help="auto: the checkpoint's weights; dummy: random weights of its config (benchmarks)",
    )

    cache = parser.add_argument_group("compilation")
    cache.add_argument(
        "--compilation-cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help=f"JAX's persistent compilation cache ({default_compilation_cache_dir()})",
    )
    cache.add_argument(
        "--no-compilation-cache",
        action="store_true",
        help="compile every program afresh (no persistent cache, no executable cache)",
    )
    cache.add_argument(
        "--no-executable-cache",
        action="store_true",
        help="keep the compilation cache but not the compiled step programs themselves "
        "(DIR/executables: a later start loads them untraced)",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = make_arg_parser().parse_args(argv)
    if args.served_model_name is None:
        args.served_model_name = [args.model]
    return args


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM``/``Engine`` keyword arguments the command line gives (unset ones are left
    to their defaults)."""
    options = dict(
        max_slots=args.max_slots,
        token_budget=args.token_budget,
        decode_buckets=None if args.decode_buckets is None else tuple(args.decode_buckets),
        token_buckets=None if args.token_buckets is None else tuple(args.token_buckets),
        max_prefill_seqs=args.max_prefill_seqs,
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
        kv_block_size=args.kv_block_size,
        num_kv_blocks=args.num_kv_blocks,
    )
    options = {k: v for k, v in options.items() if v is not None}
    if args.enable_prefix_caching:
        options["prefix_caching"] = True
    return options
