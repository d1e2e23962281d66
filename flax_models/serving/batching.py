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

With ``groups = G > 1`` (the engine's slots split over a ``"dp"`` mesh axis) the step is G
such layouts one after another, group-major: group g holds only the requests of its slots
``[g·S/G, (g+1)·S/G)`` and every group is padded to the same buckets, the largest any group
needs this step (one program per bucket, whatever G)::

    group 0      [d0 d1 | p0 p0 p0 pad]   decode bucket 2, token bucket 4
    group 1      [d2 pad| p1 pad ...  ]
    tokens       = group 0 ++ group 1     T = 2 · (2 + 4)

Slot ids stay global here (the host's and the sampler's view); the engine makes them local
to their group on the device.

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
    """Host arrays of one step; ``num_decode`` (static) and the shapes pick the program.
    With ``groups = G > 1`` every array is G groups' arrays one after another (G times the
    shapes below; each group's ``query_start_loc`` starts at 0)."""

    tokens: np.ndarray  # int32[num_decode + token_bucket]
    query_start_loc: np.ndarray  # int32[num_decode + prefill_seqs + 1]
    num_computed_tokens: np.ndarray  # int32[num_decode + prefill_seqs]
    slot_ids: np.ndarray  # int32[num_decode + prefill_seqs], -1 for padding
    num_decode: int  # the decode bucket (of each group)
    num_requests: int  # decode and prefill requests, in order, before the padding
    num_decode_requests: int  # decode requests (one real token each), the first requests
    num_tokens: int  # real tokens (decode rows and prompt tokens), padding excluded
    rows: np.ndarray  # int32[num_requests]: each request's sequence row, in request order
    groups: int = 1  # slot groups (``BatchBuilder.groups``)

    @property
    def query_lens(self) -> np.ndarray:
        """int32[rows]: each sequence row's new tokens (0 for padding rows)."""
        starts = self.query_start_loc.reshape(self.groups, -1)
        return np.diff(starts, axis=1).reshape(-1)

    @property
    def bucket(self) -> tuple[int, int]:
        """``(decode bucket, token bucket)`` of each group."""
        return self.num_decode, self.tokens.shape[0] // self.groups - self.num_decode


@dataclasses.dataclass(frozen=True)
class BatchBuilder:
    """Builds ``StepArrays`` for one engine's caches and buckets.

    Attributes:
      num_slots: cache slots.
      max_len: tokens a sequence may hold (KV cache length).
      decode_buckets: allowed decode-row counts (0 is always allowed).
      token_buckets: allowed prefill token counts (0 is always allowed).
      prefill_seqs: static number of prefill sequence rows (padding sequences fill it), of
        each group.
      vocab_size: token ids must lie in ``[0, vocab_size)`` (None: not checked). An id
        outside would index past the embedding table inside the jitted step, where
        nothing can raise: NaN logits, or a wrapped row for a negative id.
      groups: slot groups (>= 1, dividing ``num_slots``): group g holds slots
        ``[g·S/G, (g+1)·S/G)`` and the buckets and ``prefill_seqs`` bound each group's rows.
    """

    num_slots: int
    max_len: int
    decode_buckets: tuple[int, ...]
    token_buckets: tuple[int, ...]
    prefill_seqs: int
    vocab_size: int | None = None
    groups: int = 1

    def __post_init__(self):
        if self.groups < 1 or self.num_slots % self.groups:
            raise ValueError(f"num_slots={self.num_slots} must be divisible by {self.groups=}")

    @property
    def slots_per_group(self) -> int:
        return self.num_slots // self.groups

    def _by_group(self, requests: Sequence[Request]) -> list[list[int]]:
        """Indices of ``requests`` per slot group, in order."""
        indices: list[list[int]] = [[] for _ in range(self.groups)]
        for i, r in enumerate(requests):
            indices[r.slot // self.slots_per_group].append(i)
        return indices

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
        where = " of one slot group" if self.groups > 1 else ""
        decode_groups, prefill_groups = self._by_group(decode), self._by_group(prefill)
        most_decode = max(map(len, decode_groups))
        if most_decode > max(self.decode_buckets):
            raise ValueError(
                f"{most_decode} decode rows{where} exceed the largest decode bucket "
                f"{max(self.decode_buckets)}"
            )
        most_prefill = max(map(len, prefill_groups))
        if most_prefill > self.prefill_seqs:
            raise ValueError(f"{most_prefill} prefill sequences{where} exceed {self.prefill_seqs}")
        total = max(sum(len(prefill[i].tokens) for i in g) for g in prefill_groups)
        if total > max(self.token_buckets):
            raise ValueError(
                f"{total} prefill tokens{where} exceed the largest token bucket "
                f"{max(self.token_buckets)}"
            )

    def build(self, decode: Sequence[Request], prefill: Sequence[Request]) -> StepArrays:
        """Checks, then packs decode rows and prefill chunks into their buckets (each slot
        group's into the buckets of the group that needs the largest)."""
        self.check(decode, prefill)
        if not decode and not prefill:
            raise ValueError("a step needs at least one request")
        decode_groups, prefill_groups = self._by_group(decode), self._by_group(prefill)
        most_decode = max(map(len, decode_groups))
        most_tokens = max(sum(len(prefill[i].tokens) for i in g) for g in prefill_groups)
        num_decode = pk.bucket_for(most_decode, self.decode_buckets) if decode else 0
        token_bucket = pk.bucket_for(most_tokens, self.token_buckets) if prefill else 0
        prefill_rows = self.prefill_seqs if token_bucket else 0
        group_rows = num_decode + prefill_rows

        parts = []
        rows = np.zeros(len(decode) + len(prefill), np.int32)
        for g, (decode_ids, prefill_ids) in enumerate(
            zip(decode_groups, prefill_groups, strict=True)
        ):
            group_decode = [decode[i] for i in decode_ids]
            group_prefill = [prefill[i] for i in prefill_ids]
            parts.append(self._pack(group_decode, group_prefill, num_decode, token_bucket))
            rows[decode_ids] = g * group_rows + np.arange(len(decode_ids))
            rows[len(decode) + np.asarray(prefill_ids, int)] = (
                g * group_rows + num_decode + np.arange(len(prefill_ids))
            )
        tokens, query_start_loc, computed, slots = (
            np.concatenate(a) for a in zip(*parts, strict=True)
        )
        return StepArrays(
            tokens=tokens,
            query_start_loc=query_start_loc,
            num_computed_tokens=computed,
            slot_ids=slots,
            num_decode=num_decode,
            num_requests=len(decode) + len(prefill),
            num_decode_requests=len(decode),
            num_tokens=len(decode) + sum(len(r.tokens) for r in prefill),
            rows=rows,
            groups=self.groups,
        )

    def _pack(
        self,
        decode: Sequence[Request],
        prefill: Sequence[Request],
        num_decode: int,
        token_bucket: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One group's ``(tokens, query_start_loc, num_computed_tokens, slot_ids)`` in the
        given buckets."""
        prefill_rows = self.prefill_seqs if token_bucket else 0
        prefill_tokens = [t for r in prefill for t in r.tokens]
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
        return (
            np.asarray(tokens, np.int32),
            np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
            np.asarray(computed, np.int32),
            np.asarray(slots, np.int32),
        )

    def request_rows(self, step: StepArrays) -> np.ndarray:
        """Sequence row of each request of ``step``, in request order (decode, prefill)."""
        return step.rows

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
        rows = self.groups * (num_decode + prefill_rows)
        query_start_loc = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        return StepArrays(
            tokens=np.zeros(self.groups * (num_decode + token_bucket), np.int32),
            query_start_loc=np.tile(query_start_loc, self.groups),
            num_computed_tokens=np.zeros(rows, np.int32),
            slot_ids=np.full(rows, -1, np.int32),
            num_decode=num_decode,
            num_requests=0,
            num_decode_requests=0,
            num_tokens=0,
            rows=np.zeros(0, np.int32),
            groups=self.groups,
        )
