"""Incremental detokenisation with stop strings: token ids in, text pieces out.

Decoding each new token on its own is wrong in two ways: byte-level BPE splits a
multi-byte character over several tokens (one token alone decodes to ``"\\ufffd"``), and
SentencePiece-style decoders drop the leading space of the first token they see. So, as
vLLM and text-generation-inference do, each step decodes a short window of tokens twice,
with and without the new ones, and takes the difference as the new text; a difference that
ends in ``"\\ufffd"`` is an incomplete character and waits for the next token. The window
starts in the prompt's last tokens, so the first generated token decodes in context.

Stop strings are searched in the text as it grows (a stop string may span tokens); the
text is cut before the first one found. While streaming, text that could still turn into
the start of a stop string is held back until it is decided, so the pieces released, put
together, are always the final text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded ahead of the first generated token (vLLM uses 5 as well).
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class Decoder(Protocol):
    """What a tokenizer must offer: ``tokenizers.Tokenizer`` has it."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text of one request's generated tokens, released piece by piece.

    Args:
      tokenizer: decodes ids (``tokenizers.Tokenizer``).
      prompt_ids: the prompt's token ids (its last few give the first token context).
      stop: strings that end the text; it is cut before the first one found.
      skip_special_tokens: leave special tokens (eos, chat markers) out of the text.

    Attributes:
      text: the text so far (cut at a stop string once one is found).
      stop_string: the stop string found, or None.
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int] = (),
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stop = tuple(stop)
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        # ids[prefix:read] decoded is the context whose text is already counted; ids past
        # read are new and not yet turned into text.
        self._prefix, self._read = 0, len(self._ids)
        self.text = ""
        self.stop_string: str | None = None
        self._released = 0
        self._finished = False

    @property
    def stopped(self) -> bool:
        """True once a stop string was found."""
        return self.stop_string is not None

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token: int) -> bool:
        """Takes one generated token; returns True when the text now holds a stop string
        (the request should stop). Tokens after a stop or ``finish`` are ignored."""
        if self.stopped or self._finished:
            return self.stopped
        self._ids.append(int(token))
        self._advance(final=False)
        return self.stopped

    def finish(self) -> str:
        """Ends the text (the request is done): an incomplete character at the end is
        decoded as it stands; returns the text not yet released."""
        if not self._finished and not self.stopped:
            self._advance(final=True)
        self._finished = True
        return self.release()

    def release(self) -> str:
        """The text not released before that can no longer change (not an incomplete
        character, not a possible start of a stop string)."""
        end = len(self.text)
        if not (self._finished or self.stopped):
            end -= self._held_back()
        piece = self.text[self._released : end]
        self._released = max(self._released, end)
        return piece

    def _advance(self, *, final: bool) -> None:
        context = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        if len(full) <= len(context) or (full.endswith(_INCOMPLETE) and not final):
            return  # nothing new, or an incomplete character: wait for more tokens
        new = full[len(context) :]
        self._prefix, self._read = self._read, len(self._ids)
        start = len(self.text)
        self.text += new
        self._find_stop(start)

    def _find_stop(self, start: int) -> None:
        """Cuts the text at the earliest stop string that ends past ``start``."""
        found = None
        for stop in self._stop:
            at = self.text.find(stop, max(0, start - len(stop) + 1))
            if at >= 0 and (found is None or at < found[0]):
                found = (at, stop)
        if found is not None:
            self.text = self.text[: found[0]]
            self.stop_string = found[1]

    def _held_back(self) -> int:
        """Characters at the end of the text that begin some stop string."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
