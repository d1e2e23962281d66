"""What the engine hands back: token events, the stream of them, its progress bar, and
the engine's step statistics."""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Iterator, Sequence
from typing import Literal, NamedTuple

from flax_models.serving.batching import StepArrays
from flax_models.serving.request import SequenceState

__all__ = [
    "CompletionOutput",
    "EventStream",
    "RequestOutput",
    "StepStats",
    "TokenEvent",
    "progress_bar",
]


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request, so far (vLLM's fields).

    Attributes:
      index: its place among the request's ``n`` completions.
      text: the generated text (special tokens left out, cut before a stop string; empty
        from an engine without a tokenizer).
      token_ids: the generated token ids (a stopping eos or stop token included).
      cumulative_logprob: the sum of the sampled tokens' log-probabilities (requests with
        ``logprobs``), else None.
      logprobs: per generated token, ``{token id: log-probability}`` for the sampled token
        and the ``logprobs`` most likely (fp32 log-softmax of the model's logits), or None.
      finish_reason: None while it runs, then ``"stop"`` (an eos or stop token, or a stop
        string), ``"length"`` (``max_tokens``) or ``"abort"``.
      stop_reason: the stop string or stop token id that ended it, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A request's outputs so far (vLLM's fields): ``outputs`` holds its ``n``
    completions; ``finished`` once every one has ended."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


class TokenEvent(NamedTuple):
    """One generated token of ``Engine.stream``: request ``index`` (prompt order), the
    ``token``, and ``finish_reason`` when it is the request's last (``"stop"``: an eos or
    stop token, or the ``stop`` callback said so; ``"length"``: ``max_new_tokens``)."""

    index: int
    token: int
    finish_reason: Literal["stop", "length"] | None


class EventStream:
    """The iterator ``Engine.stream`` returns: its ``TokenEvent``s, ``num_requests``, and
    ``prefix_hits`` (request index -> prompt tokens taken from the prefix cache, for the
    requests admitted so far; 0 without prefix caching)."""

    def __init__(self, events: Iterator[TokenEvent], sequences: Sequence[SequenceState]):
        self._events, self._sequences = events, sequences
        self.num_requests = len(sequences)

    @property
    def prefix_hits(self) -> dict[int, int]:
        return {
            i: seq.prefix_hit for i, seq in enumerate(self._sequences) if seq.prefix_hit is not None
        }

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> TokenEvent:
        return next(self._events)

    def close(self) -> None:
        """Stops the generation; its slots go back to the engine."""
        self._events.close()


def progress_bar(total: int, *, enabled: bool | None, desc: str = "generate", unit: str = "tok"):
    """A progress bar (``tqdm``) on stderr over ``total`` items; ``enabled=None`` shows it
    for long generations on a terminal (at least 256 tokens; any warm-up)."""
    from tqdm.auto import tqdm  # imported on first use: `import flax_models` needs no tqdm

    if enabled is None:
        enabled = (total >= 256 or unit != "tok") and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr)


class StepStats:
    """Wall time and real tokens of the steps an engine served.

    Attributes:
      values: ``prefill_seconds``, ``prefill_tokens``, ``decode_seconds``, ``decode_tokens``
        (a mixed step runs both in one program; its time is shared in proportion to its
        tokens) and, with prefix caching, ``prefix_hit_tokens`` (prompt tokens not
        computed), ``prefix_hits`` and ``prefix_misses`` (requests that did or did not
        start from a cached prefix).
      step_buckets: how many steps ran in each ``(decode rows, prompt tokens)`` bucket.
    """

    def __init__(self) -> None:
        self.values: dict[str, float] = dict.fromkeys(
            ("prefill_seconds", "prefill_tokens", "decode_seconds", "decode_tokens"), 0
        )
        self.values.update(prefix_hit_tokens=0, prefix_hits=0, prefix_misses=0)
        self.step_buckets: collections.Counter[tuple[int, int]] = collections.Counter()

    def count_step(
        self,
        arrays: StepArrays,
        seconds: float,
        decode_tokens: int | None = None,
        prefill_tokens: int | None = None,
    ) -> None:
        """Adds a step served in ``seconds``: its decode rows and prompt tokens (those of the
        built step by default; ``stream`` leaves out rows of sequences that ended in the
        step before, launched ahead of their end)."""
        if decode_tokens is None:
            decode_tokens = arrays.num_decode_requests
            prefill_tokens = arrays.num_tokens - decode_tokens
        # A mixed step runs decode rows and prompt tokens through the same program; every
        # token costs about the same in the projections, which dominate, so the step's time
        # is shared in proportion to the tokens it computed.
        values = self.values
        values["decode_tokens"] += decode_tokens
        values["prefill_tokens"] += prefill_tokens
        values["decode_seconds"] += seconds * decode_tokens / arrays.num_tokens
        values["prefill_seconds"] += seconds * prefill_tokens / arrays.num_tokens
        self.step_buckets[arrays.bucket] += 1

    def count_admission(self, hit_tokens: int) -> None:
        """Counts a request admitted with ``hit_tokens`` prompt tokens from the prefix cache."""
        self.values["prefix_hit_tokens"] += hit_tokens
        self.values["prefix_hits" if hit_tokens else "prefix_misses"] += 1
