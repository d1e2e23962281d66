"""Host-side state of one request while the engine serves it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from flax_models.serving.prefix_cache import BlockHashes
from flax_models.serving.sampling import SamplingParams

__all__ = ["RequestState", "SequenceState"]


@dataclasses.dataclass(eq=False)
class SequenceState:
    """One request: its prompt and settings, and how far the engine has taken it.

    Attributes:
      index: its position among the prompts of its ``stream`` call.
      prompt: the prompt's token ids.
      params: its sampling settings.
      stop_ids: the engine's eos ids and the request's ``stop_token_ids``.
      hashes: the hash chain of its full blocks (the prefix cache extends it).
      slot: its cache slot once admitted.
      num_computed: tokens already in the cache (or in a launched step).
      generated: tokens the host has read.
      restore: the prefix snapshot to restore before its first computed token.
      in_flight: tokens sampled by launched steps the host has not read yet.
      ended: its last token was read; rows of it launched ahead are discarded.
      prefix_hit: prompt tokens taken from the prefix cache, once admitted.
      stop_check: called with each generated token that is not a stop id; True ends the
        request there (stop strings, a caller's ``stop``).
      request: the request it is a completion of, and ``output_index`` its place there.
    """

    index: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    hashes: BlockHashes
    slot: int | None = None
    num_computed: int = 0
    generated: list[int] = dataclasses.field(default_factory=list)
    restore: int | None = None
    in_flight: int = 0
    ended: bool = False
    prefix_hit: int | None = None
    stop_check: Callable[[int], bool] | None = None
    request: RequestState | None = None
    output_index: int = 0

    @property
    def prompt_done(self) -> bool:
        """Every prompt token is computed (or in a launched step)."""
        return self.num_computed >= len(self.prompt)

    @property
    def num_generated(self) -> int:
        """Tokens generated, those in flight included."""
        return len(self.generated) + self.in_flight

    def tokens(self) -> list[int]:
        """The tokens fed so far and the next one: prompt, then generated."""
        return self.prompt + self.generated if self.generated else self.prompt


@dataclasses.dataclass(eq=False)
class RequestState:
    """One request of the engine's online API: ``n`` completions of one prompt.

    Attributes:
      request_id: the caller's id.
      prompt: the prompt text, when the caller gave it.
      prompt_token_ids: the prompt's token ids.
      params: its sampling settings.
      sequences: one ``SequenceState`` per completion.
      detokenizers: one incremental detokenizer per completion (engines with a tokenizer),
        and ``texts`` the text each has released so far.
      logprobs: per completion, each generated token's ``{token id: log-probability}``
        (requests with ``logprobs``).
      cumulative_logprob: per completion, the sum of its sampled tokens' log-probabilities.
      finish_reasons, stop_reasons: per completion, once it ended.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[SequenceState] = dataclasses.field(default_factory=list)
    detokenizers: list[Any] | None = None
    texts: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[list[dict[int, float]]] = dataclasses.field(default_factory=list)
    cumulative_logprob: list[float] = dataclasses.field(default_factory=list)
    finish_reasons: list[str | None] = dataclasses.field(default_factory=list)
    stop_reasons: list[int | str | None] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(reason is not None for reason in self.finish_reasons)
