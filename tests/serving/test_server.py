"""The OpenAI-compatible server (``python -m flax_models.serve``) end to end.

One server process for the module, on 127.0.0.1 at a free port, serving the tiny text
fixture (``tests/fixtures/text``: byte-level tokenizer, chat template) on the CPU with
fixed buckets (few programs to compile), an API key, and a small waiting queue. It is
started with ``--parent-pid`` (it stops by itself if this process dies) and stopped with
SIGTERM by the fixture's finalizer, which checks it exits 0. Requests go through the
official ``openai`` client where it can express them, raw ``httpx`` where the test needs
the wire (errors, events, disconnects). Every wait has a timeout.

Outputs are checked against ``LLM.generate`` / ``LLM.chat`` in this process on the same
checkpoint and engine settings (the fixture's random weights make the text itself
meaningless, so nothing is hard-coded).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from flax_models import LLM, SamplingParams  # noqa: E402
from flax_models.serving.engine import MAMBA_SSM_CACHE_DTYPES  # noqa: E402
from flax_models.serving.server import cli_args, protocol  # noqa: E402
from flax_models.serving.server.api_server import ParentWatchdog, _validation_error  # noqa: E402
from flax_models.serving.server.metrics import Metrics  # noqa: E402
from flax_models.serving.server.serving_engine import SSE_DONE, sse_event  # noqa: E402

TEXT = Path(__file__).parent.parent / "fixtures" / "text"
API_KEY = "test-key"
MODEL = "tiny-text"
SLOTS, WAITING, MAX_LEN = 4, 4, 128
# The same engine settings in the server and in the reference LLM.
ENGINE = dict(max_slots=SLOTS, token_budget=16, decode_buckets=(4,), token_buckets=(16,))
START_TIMEOUT_S = 600.0  # loading and compiling on a shared 2-core machine
REQUEST_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, process: subprocess.Popen, port: int, log: Path):
        self.process, self.port, self.log = process, port, log
        self.url = f"http://127.0.0.1:{port}"

    def http(self, **kwargs) -> httpx.Client:
        headers = {"Authorization": f"Bearer {API_KEY}"} | kwargs.pop("headers", {})
        return httpx.Client(base_url=self.url, headers=headers, timeout=REQUEST_TIMEOUT_S, **kwargs)

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key=api_key, timeout=REQUEST_TIMEOUT_S, max_retries=0
        )

    def metrics(self) -> dict[str, float]:
        """``name{labels}`` -> value of every sample of ``/metrics``."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def metric(self, name: str, **labels: str) -> float:
        labels = {"model_name": MODEL} | labels
        # prometheus_client writes the labels in name order.
        key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        return self.metrics()[key]


def _wait_ready(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited ({process.returncode}):\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the server was not ready in {START_TIMEOUT_S:.0f} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def server(tmp_path_factory, request) -> Server:
    tmp = tmp_path_factory.mktemp("server")
    port = _free_port()
    log = tmp / "server.log"
    command = [
        sys.executable, "-m", "flax_models.serve", str(TEXT),
        "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", MODEL, "--api-key", API_KEY,
        "--implementation", "xla", "--max-model-len", str(MAX_LEN),
        "--max-slots", str(SLOTS), "--token-budget", "16",
        "--decode-buckets", "4", "--token-buckets", "16",
        "--max-waiting-seqs", str(WAITING),
        "--compilation-cache-dir", str(tmp / "jax-cache"),
        "--parent-pid", str(os.getpid()), "--no-access-log",
    ]  # fmt: skip
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    with log.open("w") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    try:
        # The reference LLM compiles here while the server compiles there.
        request.getfixturevalue("llm")
        _wait_ready(process, f"http://127.0.0.1:{port}", log)
        yield Server(process, port, log)
        # A signal stops it gracefully: exit status 0 (checked here, at the end).
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
        text = log.read_text()
        assert code == 0, text[-4000:]
        assert "ready: serving tiny-text" in text and "engine loop stopped" in text
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def llm() -> LLM:
    llm = LLM(TEXT, implementation="xla", max_model_len=MAX_LEN, **ENGINE)
    llm.engine.warmup()  # (while the server compiles the same programs)
    return llm


def _generate(llm: LLM, prompts, **sampling):
    return llm.generate(prompts, SamplingParams(**sampling), use_tqdm=False)


def _events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a server-sent event stream."""
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


# ------------------------------------------------------------------ parts (no server)


def test_protocol_validation_and_fields():
    request = protocol.CompletionRequest(prompt=[[1, 2], [3]], n=2, stop="x", foo=1)
    assert request.prompts() == [[1, 2], [3]]
    assert request.stop_strings() == ["x"]
    assert request.ignored_fields() == ["foo"]
    assert protocol.CompletionRequest(prompt="a", echo=True).unsupported_field() == "echo"
    assert protocol.CompletionRequest(prompt="a", best_of=3).unsupported_field() == "best_of"
    chat = protocol.ChatCompletionRequest(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],  # noqa: E501
        max_tokens=3,
        max_completion_tokens=5,
    )
    assert chat.conversation() == [{"role": "user", "content": "ab"}]
    assert chat.token_limit() == 5
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        protocol.CompletionRequest(prompt=["a", ""])
    with pytest.raises(ValueError, match="top_logprobs needs logprobs"):
        protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "a"}], top_logprobs=2)
    with pytest.raises(ValueError, match="stream_options"):
        protocol.CompletionRequest(prompt="a", stream_options={"include_usage": True})
    error = _validation_error([{"loc": ("body", "n"), "msg": "too small", "type": "x"}])
    assert (error.status, error.param, error.message) == (400, "n", "n: too small")
    body = error.response().model_dump()
    assert body == {
        "error": {"message": "n: too small", "type": "BadRequestError", "param": "n", "code": 400}
    }


def test_sse_format():
    usage = protocol.UsageInfo(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    event = sse_event(usage)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event[len("data: ") :]) == usage.model_dump()
    assert sse_event({"a": 1}) == 'data: {"a": 1}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"


def test_metrics_names_and_values():
    metrics = Metrics("m", max_model_len=100)
    metrics.observe_arrival(prompt_tokens=7, n=2, max_tokens=5)
    metrics.ttft.observe(0.25)
    metrics.observe_finish(reason="length", e2e_s=1.5, generation_tokens=10, tpot_s=0.1)
    metrics.set_engine_state(
        num_slots=4, num_free_slots=1, waiting=2, num_pages=8, num_free_pages=6
    )
    text = metrics.render().decode()
    for line in (
        'vllm:prompt_tokens_total{model_name="m"} 7.0',
        'vllm:request_success_total{finished_reason="length",model_name="m"} 1.0',
        'vllm:request_success_total{finished_reason="abort",model_name="m"} 0.0',
        'vllm:time_to_first_token_seconds_count{model_name="m"} 1.0',
        'vllm:e2e_request_latency_seconds_sum{model_name="m"} 1.5',
        'vllm:request_time_per_output_token_seconds_count{model_name="m"} 1.0',
        'vllm:num_requests_running{model_name="m"} 3.0',
        'vllm:num_requests_waiting{model_name="m"} 2.0',
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25',
        'flax_models:num_free_slots{model_name="m"} 1.0',
    ):
        assert line in text.splitlines(), line
    assert "vllm:inter_token_latency_seconds_bucket" in text
    assert "vllm:generation_tokens_total" in text


def test_command_line():
    args = cli_args.parse_args(
        ["ckpt", "--max-num-seqs", "3", "--decode-buckets", "1", "2", "--enable-prefix-caching"]
    )
    assert (args.host, args.port, args.served_model_name, args.dtype) == (
        "127.0.0.1", 8000, ["ckpt"], "auto",
    )  # fmt: skip
    assert cli_args.engine_options(args) == dict(
        max_slots=3, decode_buckets=(1, 2), prefix_caching=True
    )
    assert cli_args.parse_args(["ckpt", "--max-slots", "5"]).max_slots == 5
    cache_dtype = cli_args.parse_args(["ckpt", "--mamba-ssm-cache-dtype", "bfloat16"])
    assert cli_args.engine_options(cache_dtype) == dict(mamba_ssm_cache_dtype="bfloat16")
    actions = cli_args.make_arg_parser()._actions
    dtypes = next(a for a in actions if a.dest == "mamba_ssm_cache_dtype")
    assert dtypes.choices == MAMBA_SSM_CACHE_DTYPES
    with pytest.raises(SystemExit):
        cli_args.parse_args(["ckpt", "--max-slots", "0"])


def test_parent_watchdog_sees_a_process_end():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    assert not ParentWatchdog(child.pid).parent_alive()
    assert ParentWatchdog(os.getpid()).parent_alive()


# ------------------------------------------------------------------ the server


def test_health_and_models(server):
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_LEN


def test_completions_equal_llm_generate(server, llm):
    prompts = ["Hello", "The quick brown fox"]
    expected = _generate(llm, prompts, temperature=0, max_tokens=8)
    got = server.client().completions.create(
        model=MODEL, prompt=prompts, max_tokens=8, temperature=0
    )
    assert [c.index for c in got.choices] == [0, 1]
    for choice, want in zip(got.choices, expected, strict=True):
        assert choice.text == want.outputs[0].text
        assert choice.finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in expected)
    assert got.usage.completion_tokens == sum(len(w.outputs[0].token_ids) for w in expected)
    # Token ids as the prompt give the same completion.
    by_ids = server.client().completions.create(
        model=MODEL, prompt=expected[0].prompt_token_ids, max_tokens=8, temperature=0
    )
    assert by_ids.choices[0].text == expected[0].outputs[0].text


def test_chat_equals_llm_chat(server, llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    (want,) = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    got = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)


def test_streams_concatenate_to_the_whole_text(server):
    client = server.client()
    settings = dict(model=MODEL, max_tokens=12, temperature=0.9, top_p=0.9, seed=3)
    whole = client.completions.create(prompt="Once upon", **settings).choices[0]
    pieces, finish = [], None
    for chunk in client.completions.create(prompt="Once upon", stream=True, **settings):
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.text and finish == whole.finish_reason

    messages = [{"role": "user", "content": "Tell me"}]
    whole = client.chat.completions.create(messages=messages, **settings).choices[0]
    chunks = list(
        client.chat.completions.create(
            messages=messages, stream=True, stream_options={"include_usage": True}, **settings
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0

    # On the wire: events, then data: [DONE].
    with (
        server.http() as http,
        http.stream(
            "POST", "/v1/completions", json=dict(prompt="Hi", max_tokens=3, stream=True)
        ) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    assert events[-1] == "[DONE]" and all(json.loads(e)["choices"] for e in events[:-1])


def test_logprobs(server, llm):
    (want,) = _generate(llm, "Hello", temperature=0, max_tokens=5, logprobs=2)
    want = want.outputs[0]
    got = server.client().completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=2
    )
    logprobs = got.choices[0].logprobs
    assert len(logprobs.tokens) == len(want.token_ids) == 5
    assert "".join(logprobs.tokens) == got.choices[0].text == want.text
    for i, (token, entries) in enumerate(zip(want.token_ids, want.logprobs, strict=True)):
        assert logprobs.token_logprobs[i] == pytest.approx(entries[token], abs=1e-4)
        assert 1 <= len(logprobs.top_logprobs[i]) <= 3
        assert max(logprobs.top_logprobs[i].values()) == pytest.approx(
            max(entries.values()), abs=1e-4
        )
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]

    chat = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6
        assert entry.bytes == list(entry.token.encode("utf-8", errors="replace"))


def test_n_completions_with_a_seed(server, llm):
    settings = dict(n=2, temperature=1.0, seed=5, max_tokens=8)
    (want,) = _generate(llm, "Hello", **settings)
    client = server.client()
    first = client.completions.create(model=MODEL, prompt="Hello", **settings)
    again = client.completions.create(model=MODEL, prompt="Hello", **settings)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [o.text for o in want.outputs]
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], **settings
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_concurrent_streams_join_one_batch(server, llm):
    prompts = ["a b c", "Hello there", "The quick", "Once upon a time"]
    expected = [o.outputs[0].text for o in _generate(llm, prompts, temperature=0, max_tokens=16)]
    steps_before = server.metric("flax_models:engine_steps_total")
    texts = [None] * len(prompts)
    errors = []
    barrier = threading.Barrier(len(prompts), timeout=60)

    def run(i: int) -> None:
        try:
            client = server.client()
            barrier.wait()
            stream = client.completions.create(
                model=MODEL, prompt=prompts[i], max_tokens=16, temperature=0, stream=True
            )
            texts[i] = "".join(c.choices[0].text for c in stream if c.choices)
        except BaseException as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=REQUEST_TIMEOUT_S)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert texts == expected
    # One after another, 4 requests of 16 tokens take at least 64 steps; batched, about 20.
    steps = server.metric("flax_models:engine_steps_total") - steps_before
    assert steps < 48, steps


def test_disconnect_aborts_and_frees_the_slots(server):
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    body = dict(prompt="Hi", n=SLOTS, max_tokens=120, ignore_eos=True, stream=True)
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        # Every slot is taken and the waiting queue holds fewer than 5 sequences more.
        full = http.post("/v1/completions", json=dict(prompt="Hi", n=WAITING + 1))
        assert full.status_code == 503, full.text
        assert full.json()["error"]["type"] == "ServiceUnavailableError"
        # The stream is closed mid-way: its request is aborted, its slots come back.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = server.metrics()
        label = f'{{model_name="{MODEL}"}}'
        if (
            metrics[f"flax_models:num_free_slots{label}"] == SLOTS
            and metrics[f"vllm:num_requests_running{label}"] == 0
        ):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the slots were not freed: {metrics}")
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", dict(prompt="Hi", n=0), 400, "n"),
        ("/v1/completions", dict(prompt="Hi", max_tokens=MAX_LEN), 400, "max_tokens"),
        ("/v1/completions", dict(prompt="Hi", temperature=-1), 400, "temperature"),
        ("/v1/completions", dict(prompt="Hi", logprobs=99), 400, "logprobs"),
        ("/v1/completions", dict(prompt=""), 400, None),
        ("/v1/completions", dict(prompt=[10**6]), 400, None),  # not a token id
        ("/v1/completions", dict(prompt="Hi", echo=True), 400, "echo"),
        ("/v1/completions", dict(prompt="Hi", model="other"), 404, "model"),
        ("/v1/chat/completions", dict(messages=[]), 400, "messages"),
        ("/v1/chat/completions", dict(messages=[{"role": "x", "content": "a"}]), 400, None),
        (
            "/v1/chat/completions",
            dict(messages=[{"role": "user", "content": "a"}], tools=[{}]),
            400,
            "tools",
        ),  # noqa: E501
    ],
)
def test_bad_requests_get_openai_errors(server, path, body, status, param):
    with server.http() as http:
        response = http.post(path, json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["code"] == status
        if param is not None:
            assert error["param"] == param, error
        bad_json = http.post(
            path, content=b"{not json", headers={"content-type": "application/json"}
        )
        assert bad_json.status_code == 400 and bad_json.json()["error"]["type"] == "BadRequestError"
        # Still serving.
        ok = http.post("/v1/completions", json=dict(prompt="Hi", max_tokens=2))
        assert ok.status_code == 200, ok.text


def test_bad_request_through_the_client(server):
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=MAX_LEN * 2)


def test_api_key(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    response = httpx.post(
        f"{server.url}/v1/completions", json=dict(prompt="Hi", max_tokens=2), timeout=30
    )
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "AuthenticationError"
    # Health and metrics need no key.
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 200


def test_metrics_after_requests(server):
    client = server.client()
    before = server.metrics()
    client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True}
    )
    after = server.metrics()
    label = f'{{model_name="{MODEL}"}}'

    def grew(name: str, by: float | None = None) -> bool:
        delta = after[name + label] - before.get(name + label, 0.0)
        return delta == by if by is not None else delta > 0

    assert grew("vllm:generation_tokens_total", 4)
    assert grew("vllm:prompt_tokens_total")
    assert grew("vllm:time_to_first_token_seconds_count", 1)
    assert grew("vllm:e2e_request_latency_seconds_count", 1)
    assert grew("vllm:inter_token_latency_seconds_count")
    assert grew("vllm:request_time_per_output_token_seconds_count", 1)
    for gauge in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "flax_models:num_slots",
        "flax_models:num_kv_pages",
    ):
        assert gauge + label in after, gauge
    assert after["flax_models:num_slots" + label] == SLOTS


def test_online_benchmark_client(server):
    """``benchmarks.serving --online``'s client against this server: Poisson arrivals, the
    events of every request timed, its summary consistent."""
    import asyncio
    import math

    from benchmarks import serving_online

    prompts, outputs = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [4, 3, 5]
    results, wall = asyncio.run(
        serving_online.run_rate(server.url, MODEL, prompts, outputs, 50.0, api_key=API_KEY, seed=1)
    )
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.tokens for r in results] == outputs
    for r in results:
        assert r.send < r.events[0] <= r.events[-1] <= r.end
        assert r.ttft > 0 and r.tpot >= 0 and len(r.itl) == len(r.events) - 1
    summary = serving_online.summarize(results, wall, 50.0)
    assert summary["completed"] == 3 and summary["output_tokens"] == sum(outputs)
    assert summary["ttft_p50_ms"] <= summary["ttft_p99_ms"]
    assert math.isclose(summary["output_tokens_per_s"], sum(outputs) / wall)
