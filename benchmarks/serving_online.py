"""Online serving benchmark: Poisson arrivals at several rates through the HTTP server.

``python -m benchmarks.serving_online [--model DIR] [--url URL] [--rates R ...]
[--requests N] [--serve-args "..."] [--server-log FILE] [--out FILE] [--results-dir DIR]
[--quick]``: the online counterpart of ``benchmarks.serving``'s offline trace, written to the
same results file.

Like ``vllm bench serve``: an async HTTP client (httpx) sends streamed completions
(``stream: true``, server-sent events) to ``/v1/completions`` of a server it starts itself
(``python -m flax_models.serve MODEL --serve-args...``, stopped at the end) or of one
already running (``--url``). Per rate, ``--requests`` requests arrive as a Poisson process
(exponential gaps of mean 1 / rate, seed 0; ``inf``: all at once). Prompts are token ids
(uniform in the vocabulary), their lengths log-normal and clipped as the offline trace's
(``benchmarks.serving.TRACES``), the outputs exactly ``max_tokens`` long (``ignore_eos``),
so runs compare. Before the measured rates one request warms the server up.

Per request, from the client's clock: TTFT = first event with tokens − send; the
inter-token latencies (ITL) = gaps between its events (one per engine step that gave it a
token); TPOT = (last − first event) / (output tokens − 1). Per rate: TTFT, TPOT and ITL
p50/p99 (ms), output and total tokens/s and requests/s over the run's wall time (first
send to last byte), and the achieved arrival rate.

``--model bamba-9b``: the offline trace's model shape with random weights
(:func:`dummy_model`: the server's ``--load-format dummy``), its engine settings, coarser buckets.

``--quick``: the tiny text fixture on the CPU (fixed buckets, three programs), 8 requests
of the quick trace at rates 4 and inf. Results: one row per rate (``<model>/online-<N>/
rate-<r>``, ``op: serving_online``) in the harness's schema, in the store's
``<device>/serving.json`` beside the offline rows, and a plot ``serving_online.png``
(latency percentiles and throughput against the rate).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
QUICK_MODEL = ROOT / "tests" / "fixtures" / "text"
QUICK_SERVE_ARGS = (
    "--implementation xla --max-slots 4 --token-budget 16 --decode-buckets 4 "
    "--token-buckets 16 --max-model-len 64 --no-access-log"
)
START_TIMEOUT_S = 1800.0
# --model's shape name: the offline trace's model, random weights (dummy_model).
DUMMY_SHAPE = "bamba-9b"
DUMMY_DECODE_BUCKETS = (1, 4, 16, 64, 256)
DUMMY_TOKEN_BUCKETS = (512, 1024, 2048, 4096, 8192)


@dataclasses.dataclass
class RequestResult:
    prompt_len: int
    output_len: int
    ok: bool = False
    error: str = ""
    send: float = 0.0
    events: list[float] = dataclasses.field(default_factory=list)  # times of token events
    tokens: int = 0  # output tokens (usage)
    end: float = 0.0

    @property
    def ttft(self) -> float:
        return self.events[0] - self.send if self.events else math.nan

    @property
    def tpot(self) -> float:
        if len(self.events) < 1 or self.tokens < 2:
            return math.nan
        return (self.events[-1] - self.events[0]) / (self.tokens - 1)

    @property
    def itl(self) -> list[float]:
        return list(np.diff(self.events)) if len(self.events) > 1 else []


def _percentiles(values: Sequence[float]) -> tuple[float, float]:
    finite = np.asarray([v for v in values if math.isfinite(v)]) * 1e3
    if not finite.size:
        return math.nan, math.nan
    return float(np.percentile(finite, 50)), float(np.percentile(finite, 99))


async def _one(client, model: str, prompt: list[int], max_tokens: int, result: RequestResult):
    body = dict(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        stream=True,
        stream_options=dict(include_usage=True),
    )
    result.send = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"{response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                event = json.loads(line[len("data: ") :])
                if event.get("choices"):
                    result.events.append(now)
                if event.get("usage"):
                    result.tokens = event["usage"]["completion_tokens"]
        result.ok = result.tokens == max_tokens
        if not result.ok:
            result.error = f"{result.tokens} tokens, expected {max_tokens}"
    except Exception as error:  # noqa: BLE001 (counted as a failed request)
        result.error = repr(error)
    finally:
        result.end = time.perf_counter()


async def run_rate(
    url: str,
    model: str,
    prompts: list[list[int]],
    outputs: list[int],
    rate: float,
    *,
    seed: int = 0,
    api_key: str | None = None,
) -> tuple[list[RequestResult], float]:
    """Sends the requests at Poisson arrivals of ``rate`` per second; ``(results, wall)``."""
    import httpx

    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(prompts)) if math.isinf(rate) else rng.exponential(1 / rate, len(prompts))
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=60.0)
    results = [RequestResult(len(p), o) for p, o in zip(prompts, outputs, strict=True)]
    async with httpx.AsyncClient(
        base_url=url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens, result, gap in zip(prompts, outputs, results, gaps, strict=True):
            await asyncio.sleep(float(gap))
            tasks.append(asyncio.create_task(_one(client, model, prompt, max_tokens, result)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return results, wall


def summarize(results: list[RequestResult], wall: float, rate: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.tokens for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)
    ttft = _percentiles([r.ttft for r in ok])
    tpot = _percentiles([r.tpot for r in ok])
    itl = _percentiles([gap for r in ok for gap in r.itl])
    sends = sorted(r.send for r in results)
    span = sends[-1] - sends[0] if len(sends) > 1 else 0.0
    return dict(
        rate=None if math.isinf(rate) else rate,
        achieved_rate=(len(sends) - 1) / span if span > 0 else None,
        requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        errors=sorted({r.error for r in results if r.error})[:5],
        wall_s=wall,
        output_tokens=output_tokens,
        prompt_tokens=prompt_tokens,
        output_tokens_per_s=output_tokens / wall,
        total_tokens_per_s=(output_tokens + prompt_tokens) / wall,
        requests_per_s=len(ok) / wall,
        ttft_p50_ms=ttft[0],
        ttft_p99_ms=ttft[1],
        tpot_p50_ms=tpot[0],
        tpot_p99_ms=tpot[1],
        itl_p50_ms=itl[0],
        itl_p99_ms=itl[1],
    )


# ------------------------------------------------------------------ the server process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, serve_args: Sequence[str], log: Path) -> tuple[subprocess.Popen, str]:
    """``python -m flax_models.serve model`` on 127.0.0.1 at a free port, stopped if this
    process dies (``--parent-pid``); returns once ``/health`` answers 200."""
    import httpx

    port = _free_port()
    command = [
        sys.executable, "-m", "flax_models.serve", model, "--host", "127.0.0.1",
        "--port", str(port), "--parent-pid", str(os.getpid()), *serve_args,
    ]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}); see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    process.kill()
    raise RuntimeError(f"the server was not ready within {START_TIMEOUT_S:.0f} s; see {log}")


def stop_server(process: subprocess.Popen) -> int:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(timeout=60)


# ------------------------------------------------------------------ reporting


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r["online"] for r in rows]
    labels = ["inf" if r["rate"] is None else f"{r['rate']:g}" for r in runs]
    x = np.arange(len(runs))
    fig, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4))
    for key, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL")):
        p50 = [r[f"{key}_p50_ms"] for r in runs]
        p99 = [r[f"{key}_p99_ms"] for r in runs]
        (line,) = latency.plot(x, p50, marker="o", label=f"{name} p50")
        latency.plot(
            x, p99, marker="x", linestyle="--", color=line.get_color(), label=f"{name} p99"
        )
    latency.set(xticks=x, xticklabels=labels, xlabel="arrival rate (requests/s)", ylabel="ms")
    latency.set_yscale("log")
    latency.legend(fontsize=7)
    latency.set_title("latency")
    throughput.bar(x, [r["output_tokens_per_s"] for r in runs])
    throughput.set(xticks=x, xticklabels=labels, xlabel="arrival rate (requests/s)",
                   ylabel="output tokens/s", title="throughput")  # fmt: skip
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def dummy_model(directory: Path) -> tuple[Path, list[str]]:
    """A Bamba-9B-shaped "checkpoint" without weights, for ``--model bamba-9b``: its
    ``config.json`` and a word-level ``tokenizer.json`` of the config's vocabulary (token
    ``i`` is ``<i>``), served with ``--load-format dummy`` (random weights) and the offline
    trace's engine settings (``benchmarks.serving.engine_options``) but coarser buckets,
    :data:`DUMMY_DECODE_BUCKETS` × :data:`DUMMY_TOKEN_BUCKETS`: the server compiles every
    pair at start-up (35 step programs, not the offline grid's 189). Returns the directory and
    those server options."""
    import jax.numpy as jnp
    from tokenizers import Tokenizer, models, pre_tokenizers

    from benchmarks import serving
    from flax_models.config import HybridConfig
    from flax_models.save import hf_config_dict

    cfg = HybridConfig.bamba_9b()
    directory.mkdir(parents=True, exist_ok=True)
    config = hf_config_dict(cfg, dtype=jnp.bfloat16)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    vocab = {f"<{i}>": i for i in range(cfg.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    options = serving.engine_options(False)
    serve_args = [
        "--load-format", "dummy",
        "--max-slots", str(options["max_slots"]),
        "--max-model-len", str(options["max_len"]),
        "--token-budget", str(options["token_budget"]),
        "--decode-buckets", *map(str, DUMMY_DECODE_BUCKETS),
        "--token-buckets", *map(str, DUMMY_TOKEN_BUCKETS),
    ]  # fmt: skip
    return directory, serve_args


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    from benchmarks import harness

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint directory for the server, or bamba-9b (random weights, dummy_model)",
    )
    parser.add_argument("--url", default=None, help="an already running server instead")
    parser.add_argument("--served-model-name", default=None, help="the model name requests give")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--rates", type=float, nargs="+", default=None, metavar="R",
                        help="arrival rates, requests/s (inf: all at once)")  # fmt: skip
    parser.add_argument("--requests", type=int, default=None, help="requests per rate")
    parser.add_argument(
        "--serve-args",
        default=None,
        help="options for flax_models.serve, one string",
    )
    parser.add_argument("--vocab-size", type=int, default=None, help="prompt ids' range")
    parser.add_argument("--server-log", default=None, help="the started server's log file")
    argv = list(argv)
    if "--serve-args" in argv[:-1]:  # its value is one, even when it starts with a dash
        at = argv.index("--serve-args")
        argv[at : at + 2] = [f"--serve-args={argv[at + 1]}"]
    own, rest = parser.parse_known_args(argv)
    args = harness.parse_args(
        rest, "online serving (Poisson arrivals through the HTTP server)", module="serving",
        command=argv,
    )  # fmt: skip
    # The store's file is benchmarks.serving's (module "serving"); the command is this one.
    command = shlex.join(["python", "-m", "benchmarks.serving_online", *argv])
    args.output = dataclasses.replace(args.output, command=command)
    return argparse.Namespace(**vars(args), **vars(own))


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    # This process only sends requests: it must not take the accelerator's memory.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from benchmarks import serving

    args = _parse(list(sys.argv[1:] if argv is None else argv))
    quick = args.quick
    spec = serving.TRACES["quick" if quick else "full"]
    model = args.model or (str(QUICK_MODEL) if quick else None)
    if model is None and args.url is None:
        raise SystemExit("--model DIR (a checkpoint for the server) or --url URL is needed")
    name = args.served_model_name or (Path(model).name if model else "model")
    shape_args: list[str] = []
    if model == DUMMY_SHAPE and args.url is None:
        path, shape_args = dummy_model(Path(tempfile.mkdtemp(prefix="serving_online_model_")))
        model = str(path)
    rates = args.rates or ([4.0, math.inf] if quick else [1.0, 4.0, 16.0, math.inf])
    count = args.requests or (8 if quick else 256)
    vocab = args.vocab_size
    if vocab is None and model is not None:
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompts, outputs = serving.make_trace(vocab or 256, spec | dict(requests=count))

    serve_args = shape_args + shlex.split(args.serve_args or (QUICK_SERVE_ARGS if quick else ""))
    if args.url is None:
        serve_args += ["--served-model-name", name]
        if args.api_key:
            serve_args += ["--api-key", args.api_key]
        log = args.server_log or Path(tempfile.mkdtemp(prefix="serving_online_")) / "server.log"
        log = Path(log)
        print(f"starting the server for {model} (log: {log})", flush=True)
        start = time.perf_counter()
        process, url = start_server(model, serve_args, log)
        startup_s = time.perf_counter() - start
        print(f"server ready in {startup_s:.1f} s", flush=True)
    else:
        process, url, startup_s = None, args.url, None

    rows = []
    try:
        warm, _ = asyncio.run(run_rate(url, name, prompts[:1], outputs[:1], math.inf,
                                       api_key=args.api_key))  # fmt: skip
        if not warm[0].ok:
            raise RuntimeError(f"the warm-up request failed: {warm[0].error}")
        for rate in rates:
            results, wall = asyncio.run(
                run_rate(url, name, prompts, outputs, rate, api_key=args.api_key)
            )
            summary = summarize(results, wall, rate)
            _print(summary)
            label = "inf" if math.isinf(rate) else f"{rate:g}"
            rows.append(
                dict(
                    problem=f"{name}/online-{count}/rate-{label}",
                    implementation="auto",
                    op="serving_online",
                    model=name,
                    online=summary
                    | dict(
                        trace=spec | dict(requests=count),
                        server_args=serve_args,
                        startup_s=startup_s,
                        requests_detail=[
                            dict(
                                prompt_len=r.prompt_len,
                                output_len=r.output_len,
                                ttft_s=r.ttft,
                                tpot_s=r.tpot,
                            )  # fmt: skip
                            for r in results
                        ],
                    ),
                    **{k: v for k, v in summary.items() if k != "errors"},
                )
            )
    finally:
        if process is not None:
            code = stop_server(process)
            print(f"server stopped (exit {code})", flush=True)
    # JAX (the device name) only now, with the server gone.
    from benchmarks import harness

    harness.write_report(rows, None, args.output)
    for path in args.output.paths():
        png = plot(rows, path.with_name("serving_online.png"), f"online serving, {name}")
        print(f"wrote {path} and {png}")
    return rows


def _print(s: dict[str, Any]) -> None:
    rate = "inf" if s["rate"] is None else f"{s['rate']:g}"
    print(
        f"rate {rate:>5} req/s: {s['completed']}/{s['requests']} ok in {s['wall_s']:.1f} s, "
        f"{s['output_tokens_per_s']:.0f} output tok/s; TTFT p50 {s['ttft_p50_ms']:.1f} "
        f"p99 {s['ttft_p99_ms']:.1f} ms; TPOT p50 {s['tpot_p50_ms']:.2f} p99 "
        f"{s['tpot_p99_ms']:.2f} ms; ITL p50 {s['itl_p50_ms']:.2f} p99 {s['itl_p99_ms']:.2f} ms",
        flush=True,
    )


if __name__ == "__main__":
    main()
