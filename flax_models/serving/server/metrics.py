"""The server's Prometheus metrics (``GET /metrics``), with vLLM's names where vLLM has one.

vLLM's (``vllm/v1/metrics/loggers.py``), each labelled ``model_name``:

- counters ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
  ``vllm:request_success_total`` (label ``finished_reason``: stop, length, abort);
- histograms ``vllm:time_to_first_token_seconds`` (arrival to the first token),
  ``vllm:inter_token_latency_seconds`` (between a request's steps that gave tokens),
  ``vllm:request_time_per_output_token_seconds`` (a request's TPOT: first to last token
  over tokens - 1), ``vllm:e2e_request_latency_seconds``, ``vllm:request_prompt_tokens``,
  ``vllm:request_generation_tokens``, ``vllm:request_params_n``,
  ``vllm:request_params_max_tokens``;
- gauges ``vllm:num_requests_running`` (sequences holding a cache slot),
  ``vllm:num_requests_waiting`` (sequences admitted by the server, not yet in a slot) and
  ``vllm:kv_cache_usage_perc`` (the fraction of KV pages in use, 0 to 1).

This engine's own, under ``flax_models:``: gauges ``flax_models:num_slots`` and
``flax_models:num_free_slots`` (cache slots), ``flax_models:num_kv_pages`` and
``flax_models:num_free_kv_pages``, and the counter ``flax_models:engine_steps_total``.

Every metric lives in the ``Metrics`` object's own registry (not prometheus_client's
global one), so several servers or tests in one process do not collide.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

# vLLM's buckets (``loggers.py``): latencies from milliseconds to minutes.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def _token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's ``build_1_2_5_buckets``)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return buckets
            buckets.append(value)
        scale *= 10


class Metrics:
    """The metrics of one server, for one model name; the engine loop records into it
    (``observe_*``, ``set_engine_state``) and ``render`` gives the exposition text."""

    def __init__(self, model_name: str, *, max_model_len: int):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels + list(extra), registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self._model = model_name
        # prometheus_client appends ``_total`` to a counter's name.
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.").labels(
            model_name
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Generation tokens processed."
        ).labels(model_name)
        self._success = counter(
            "vllm:request_success", "Finished requests, by finish reason.", ("finished_reason",)
        )
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)  # exported at 0 from the start
        self.steps = counter("flax_models:engine_steps", "Engine steps run.").labels(model_name)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS
        )
        self.inter_token = histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency.", _TOKEN_LATENCY_BUCKETS
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Time per output token of a request (first to last token).",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            _REQUEST_LATENCY_BUCKETS,
        )
        tokens = _token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of a request.", tokens
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens of a request.", tokens
        )
        self.request_n = histogram(
            "vllm:request_params_n", "The n request parameter.", (1, 2, 5, 10, 20)
        )
        self.request_max_tokens = histogram(
            "vllm:request_params_max_tokens", "The max_tokens request parameter.", tokens
        )

        self.running = gauge("vllm:num_requests_running", "Sequences in a cache slot.")
        self.waiting = gauge("vllm:num_requests_waiting", "Sequences waiting for a slot.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of KV pages in use (0-1).")
        self.num_slots = gauge("flax_models:num_slots", "Cache slots.")
        self.num_free_slots = gauge("flax_models:num_free_slots", "Free cache slots.")
        self.num_pages = gauge("flax_models:num_kv_pages", "KV pages in the pool.")
        self.num_free_pages = gauge("flax_models:num_free_kv_pages", "Free KV pages.")

    # ------------------------------------------------------------------ recording

    def observe_arrival(self, *, prompt_tokens: int, n: int, max_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_n.observe(n)
        self.request_max_tokens.observe(max_tokens)

    def observe_finish(
        self,
        *,
        reason: str,
        e2e_s: float,
        generation_tokens: int,
        tpot_s: float | None,
    ) -> None:
        self._success.labels(self._model, reason).inc()
        self.e2e.observe(e2e_s)
        self.request_generation_tokens.observe(generation_tokens)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)

    def set_engine_state(
        self,
        *,
        num_slots: int,
        num_free_slots: int,
        waiting: int,
        num_pages: int,
        num_free_pages: int,
    ) -> None:
        self.num_slots.set(num_slots)
        self.num_free_slots.set(num_free_slots)
        self.running.set(num_slots - num_free_slots)
        self.waiting.set(waiting)
        self.num_pages.set(num_pages)
        self.num_free_pages.set(num_free_pages)
        self.kv_usage.set(1.0 - num_free_pages / num_pages if num_pages else 0.0)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
