"""What the engine hands back: token events, the stream of them, its progress bar, and
the engine's step statistics."""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterator
from typing import Literal, NamedTuple

from flax_models.serving.batching import StepArrays

__all__ = ["EventStream", "StepStats", "TokenEvent", "progress_bar"]


class TokenEvent(NamedTuple):
    """One generated token of ``Engine.stream``: request ``index`` (prompt order), the
    ``token``, and ``finish_reason`` when it is the request's last (``"stop"``: an eos or
    stop token, or the ``stop`` callback said so; ``"length"``: ``max_new_tokens``)."""

    index: int
    token: int
    finish_reason: Literal["stop", "length"] | None


class EventStream:
    """The iterator ``Engine.stream`` returns: its ``TokenEvent``s, ``num_requests``, and
    ``prefix_hits`` (request index -> prompt tokens taken from the prefix cache, filled as
    requests are admitted; 0 without prefix caching)."""

    def __init__(
        self, events: Iterator[TokenEvent], num_requests: int, prefix_hits: dict[int, int]
    ):
        self._events, self.num_requests, self.prefix_hits = events, num_requests, prefix_hits

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> TokenEvent:
        return next(self._events)

    def close(self) -> None:
        """Stops the generation; its slots go back to the engine."""
        self._events.close()


def progress_bar(total: int, *, enabled: bool | None):
    """A token progress bar (``tqdm``) on stderr for a generation of ``total`` tokens;
    ``enabled=None`` shows it for long generations on a terminal (at least 256 tokens)."""
    from tqdm.auto import tqdm  # imported on first use: `import flax_models` needs no tqdm

    if enabled is None:
        enabled = total >= 256 and sys.stderr.isatty()
    return tqdm(total=total, desc="generate", unit="tok", disable=not enabled, file=sys.stderr)


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
