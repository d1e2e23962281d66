"""Host-side state of one request while the engine serves it."""

from __future__ import annotations

import dataclasses

from flax_models.serving.prefix_cache import BlockHashes
from flax_models.serving.sampling import SamplingParams

__all__ = ["SequenceState"]


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
