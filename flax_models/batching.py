"""Host-side batch builder: requests → bucketed, static-shape step arrays.

A step packs decode rows first (one token each, continuing a cached sequence), then prefill
chunks (new prompt tokens of a sequence, possibly continuing an earlier chunk). Shapes come
from a bounded set of buckets, so ``jax.jit`` compiles one program per
``(decode bucket, token bucket)`` pair whatever the requests::

    decode rows  [d0 d1 d2 pad]                     decode bucket 4 (slot -1 pads)
    prefill      [p0 p0 p0 p0 p0 p1 p1 pad ... pad] token bucket 16, prefill_seqs sequences
    tokens       = decode rows ++ prefill tokens     T = 4 + 16

Every request is checked before anything is built, and a bad one raises ``ValueError``
naming the request, so the engine never touches a cache for a batch it cannot run.

A decode row's token may be ``FROM_DEVICE``: the token its slot sampled in the engine's
last step, still on the device. The engine feeds a step from the one before it that way
before the host has read that step's tokens (``Engine.stream`` runs one step ahead).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

import pallas_kernels as pk

# A decode row's token id meaning "the token this slot sampled last" (kept on the device).
FROM_DEVICE = -1


@dataclasses.dataclass(frozen=True)
class Request:
    """New tokens of one sequence for one step.

    Attributes:
      slot: its cache slot.
      tokens: this step's token ids (one for a decode row).
      num_computed: tokens of the sequence already in the cache.
    """

    slot: int
    tokens: Sequence[int]
    num_computed: int


@dataclasses.dataclass(frozen=True)
class StepArrays:
    """Host arrays of one step; ``num_decode`` (static) and the shapes pick the program."""

    tokens: np.ndarray  # int32[num_decode + token_bucket]
    query_start_loc: np.ndarray  # int32[num_decode + prefill_seqs + 1]
    num_computed_tokens: np.ndarray  # int32[num_decode + prefill_seqs]
    slot_ids: np.ndarray  # int32[num_decode + prefill_seqs], -1 for padding
    num_decode: int  # the decode bucket
    num_requests: int  # decode and prefill requests, in order, before the padding
    num_decode_requests: int  # decode requests (one real token each), the first requests
    num_tokens: int  # real tokens (decode rows and prompt tokens), padding excluded

    @property
    def bucket(self) -> tuple[int, int]:
        return self.num_decode, self.tokens.shape[0] - self.num_decode


@dataclasses.dataclass(frozen=True)
class BatchBuilder:
    """Builds ``StepArrays`` for one engine's caches and buckets.

    Attributes:
      num_slots: cache slots.
      max_len: tokens a sequence may hold (KV cache length).
      decode_buckets: allowed decode-row counts (0 is always allowed).
      token_buckets: allowed prefill token counts (0 is always allowed).
      prefill_seqs: static number of prefill sequence rows (padding sequences fill it).
      vocab_size: token ids must lie in ``[0, vocab_size)`` (None: not checked). An id
        outside would index past the embedding table inside the jitted step, where
        nothing can raise: NaN logits, or a wrapped row for a negative id.
    """

    num_slots: int
    max_len: int
    decode_buckets: tuple[int, ...]
    token_buckets: tuple[int, ...]
    prefill_seqs: int
    vocab_size: int | None = None

    def check(self, decode: Sequence[Request], prefill: Sequence[Request]) -> None:
        """Raises ``ValueError`` for a batch that cannot run (touches nothing)."""
        seen: set[int] = set()
        for kind, requests in (("decode", decode), ("prefill", prefill)):
            for i, r in enumerate(requests):
                where = f"{kind} request {i} (slot {r.slot})"
                if not 0 <= r.slot < self.num_slots:
                    raise ValueError(f"{where}: unknown slot; slots are 0..{self.num_slots - 1}")
                if r.slot in seen:
                    raise ValueError(f"{where}: slot appears twice in one step")
                seen.add(r.slot)
                if len(r.tokens) == 0:
                    raise ValueError(f"{where}: empty prompt (no new tokens)")
                ids = np.asarray(r.tokens)
                if ids.ndim != 1 or ids.dtype.kind not in "iu":
                    raise ValueError(f"{where}: tokens must be a list of int token ids")
                if self.vocab_size is not None:
                    bad = (ids < 0) | (ids >= self.vocab_size)
                    if kind == "decode":
                        bad &= ids != FROM_DEVICE
                    if bad.any():
                        raise ValueError(
                            f"{where}: token id {ids[bad][0]} is outside "
                            f"[0, vocab_size={self.vocab_size})"
                        )
                if kind == "decode" and len(r.tokens) != 1:
                    raise ValueError(f"{where}: a decode row has exactly one token")
                if r.num_computed < 0:
                    raise ValueError(f"{where}: num_computed={r.num_computed} < 0")
                if r.num_computed + len(r.tokens) > self.max_len:
                    raise ValueError(
                        f"{where}: {r.num_computed} cached + {len(r.tokens)} new tokens exceed "
                        f"max_len={self.max_len}"
                    )
        if decode and len(decode) > max(self.decode_buckets):
            raise ValueError(
                f"{len(decode)} decode rows exceed the largest decode bucket "
                f"{max(self.decode_buckets)}"
            )
        if len(prefill) > self.prefill_seqs:
            raise ValueError(f"{len(prefill)} prefill sequences exceed {self.prefill_seqs}")
        total = sum(len(r.tokens) for r in prefill)
        if total > max(self.token_buckets):
            raise ValueError(
                f"{total} prefill tokens exceed the largest token bucket {max(self.token_buckets)}"
            )

    def build(self, decode: Sequence[Request], prefill: Sequence[Request]) -> StepArrays:
        """Checks, then packs decode rows and prefill chunks into their buckets."""
        self.check(decode, prefill)
        if not decode and not prefill:
            raise ValueError("a step needs at least one request")
        num_decode = pk.bucket_for(len(decode), self.decode_buckets) if decode else 0
        prefill_tokens = [t for r in prefill for t in r.tokens]
        token_bucket = pk.bucket_for(len(prefill_tokens), self.token_buckets) if prefill else 0
        prefill_rows = self.prefill_seqs if token_bucket else 0

        decode_pad = num_decode - len(decode)
        tokens = (
            [r.tokens[0] for r in decode]
            + [0] * decode_pad
            + prefill_tokens
            + [0] * (token_bucket - len(prefill_tokens))
        )
        lengths = (
            [1] * num_decode
            + [len(r.tokens) for r in prefill]
            + [0] * (prefill_rows - len(prefill))
        )
        computed = (
            [r.num_computed for r in decode]
            + [0] * decode_pad
            + [r.num_computed for r in prefill]
            + [0] * (prefill_rows - len(prefill))
        )
        slots = (
            [r.slot for r in decode]
            + [-1] * decode_pad
            + [r.slot for r in prefill]
            + [-1] * (prefill_rows - len(prefill))
        )
        return StepArrays(
            tokens=np.asarray(tokens, np.int32),
            query_start_loc=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            num_computed_tokens=np.asarray(computed, np.int32),
            slot_ids=np.asarray(slots, np.int32),
            num_decode=num_decode,
            num_requests=len(decode) + len(prefill),
            num_decode_requests=len(decode),
            num_tokens=len(decode) + len(prefill_tokens),
        )

    def request_rows(self, step: StepArrays) -> np.ndarray:
        """Sequence row of each request of ``step``, in request order (decode, prefill)."""
        prefill = step.num_requests - step.num_decode_requests
        return np.concatenate(
            [np.arange(step.num_decode_requests), step.num_decode + np.arange(prefill)]
        ).astype(np.int32)

    def buckets(self) -> list[tuple[int, int]]:
        """Every ``(decode bucket, token bucket)`` a step can use (for warm-up)."""
        decode = (0, *self.decode_buckets)
        tokens = (0, *self.token_buckets)
        return [(d, t) for d in decode for t in tokens if d or t]

    def dummy(self, num_decode: int, token_bucket: int) -> StepArrays:
        """An all-padding step of the given bucket: runs the program, changes no cache."""
        prefill_rows = self.prefill_seqs if token_bucket else 0
        # One padding sequence holds all the prefill tokens; slot -1 everywhere.
        prefill_lengths = [token_bucket] + [0] * (prefill_rows - 1) if prefill_rows else []
        lengths = [1] * num_decode + prefill_lengths
        rows = num_decode + prefill_rows
        return StepArrays(
            tokens=np.zeros(num_decode + token_bucket, np.int32),
            query_start_loc=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            num_computed_tokens=np.zeros(rows, np.int32),
            slot_ids=np.full(rows, -1, np.int32),
            num_decode=num_decode,
            num_requests=0,
            num_decode_requests=0,
            num_tokens=0,
        )
