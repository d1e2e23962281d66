"""Serving: a jitted step over slot-indexed caches, and a scheduler that generates.

Each step packs decode rows (one token per running sequence, through the single-step
conv/SSM update kernels) and prefill chunks (prompt tokens within the per-step token
budget, through the chunked conv and SSD scan, continuing from the cached state) into one
bucketed batch. Caches are donated to the jitted step and updated in place. Requests join
as slots free up and leave when done (continuous batching); a prompt longer than the
budget is spread over several steps (chunked prefill).

Sampling runs inside the jitted step, with temperature, top-k and the random key as data,
so a step is one program per bucket whatever the sampling settings: after ``warmup()``
every program a generation can need is compiled and ``compile_count`` stays put.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import numbers
import operator
import reprlib
import sys
import time
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels as pk
from flax_models.batch import make_forward_batch
from flax_models.batching import BatchBuilder, Request, StepArrays
from flax_models.cache import init_cache
from flax_models.model import HybridLM


@dataclasses.dataclass
class _Sequence:
    """Host-side state of one request."""

    index: int
    prompt: list[int]
    slot: int | None = None
    num_computed: int = 0  # tokens already in the cache
    generated: list[int] = dataclasses.field(default_factory=list)

    @property
    def prompt_done(self) -> bool:
        return self.num_computed >= len(self.prompt)


# Seeds are 32-bit: the step builds its key from a uint32 scalar (data, not a constant, so one
# program serves every seed); jax.random.key(seed) gives the same key for these seeds.
_SEED_LIMIT = 2**32


def _check_buckets(
    name: str, buckets: Sequence[int] | None, default: tuple[int, ...], *, covers: int, what: str
) -> tuple[int, ...]:
    """``buckets`` (``default`` when None) as sorted, distinct sizes >= 1, the largest
    ``>= covers`` (the most a step can hold: ``what``); ValueError naming ``name``."""
    if buckets is None:
        return default
    try:
        sizes = tuple(sorted({operator.index(b) for b in buckets}))
    except TypeError:
        raise ValueError(f"{name}={buckets!r} must be a sequence of ints") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"{name}={buckets!r} must be non-empty sizes >= 1")
    if sizes[-1] < covers:
        raise ValueError(f"{name}={buckets!r}: the largest must be >= {what}={covers}")
    return sizes


class Engine:
    """Serves a ``HybridLM`` over ``max_slots`` cache slots of ``max_len`` tokens.

    Args:
      model: the model (its ``implementation`` picks the kernels).
      max_slots: sequences in flight at once (>= 1); more requests wait.
      max_len: tokens per sequence, prompt + generated (>= 1).
      token_budget: prompt tokens per step (>= 1; decode rows come on top).
      decode_buckets: allowed decode-row counts; powers of two up to ``max_slots`` by
        default. The largest must hold ``max_slots`` rows (every sequence decoding).
      token_buckets: allowed prefill token counts; powers of two up to ``token_budget`` by
        default. The largest must hold ``token_budget`` tokens (a full prefill step).

    Attributes:
      compile_count: programs compiled for this engine's steps (one per bucket).
      stats: wall time and real tokens of the steps served, split into prefill (prompt
        tokens) and decode (one token per decode row): ``prefill_seconds``,
        ``prefill_tokens``, ``decode_seconds``, ``decode_tokens``. A mixed step runs both
        in one program; its time is shared in proportion to its tokens.
    """

    def __init__(
        self,
        model: HybridLM,
        *,
        max_slots: int = 8,
        max_len: int = 256,
        token_budget: int = 64,
        decode_buckets: Sequence[int] | None = None,
        token_buckets: Sequence[int] | None = None,
    ):
        max_slots = _check_int("max_slots", max_slots, low=1)
        max_len = _check_int("max_len", max_len, low=1)
        token_budget = _check_int("token_budget", token_budget, low=1)
        self.cfg = model.cfg
        self.token_budget = token_budget
        self.builder = BatchBuilder(
            num_slots=max_slots,
            max_len=max_len,
            decode_buckets=_check_buckets(
                "decode_buckets",
                decode_buckets,
                pk.sequence_buckets(max_slots),
                covers=max_slots,
                what="max_slots",
            ),
            token_buckets=_check_buckets(
                "token_buckets",
                token_buckets,
                pk.token_buckets(token_budget, min_tokens=16),
                covers=token_budget,
                what="token_budget",
            ),
            prefill_seqs=max_slots,
            vocab_size=self.cfg.vocab_size,
        )
        self._cache_dtype = model.dtype
        self.caches = init_cache(self.cfg, num_slots=max_slots, max_len=max_len, dtype=model.dtype)
        self._graphdef, self._params = nnx.split(model)
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self.compile_count = 0
        self.stats = dict.fromkeys(
            ("prefill_seconds", "prefill_tokens", "decode_seconds", "decode_tokens"), 0
        )
        self._jitted = jax.jit(self._step, static_argnames=("num_decode",), donate_argnums=(1,))

    # ------------------------------------------------------------------------ one step

    def _step(
        self,
        params,
        caches,
        tokens,
        query_start_loc,
        num_computed,
        slot_ids,
        temperature,
        top_k,
        seed,
        step_index,
        *,
        num_decode,
    ):
        """One step and its sampling: ``(logits[R, V], next_tokens[R], caches)``."""
        self.compile_count += 1  # runs once per trace, i.e. per compiled program
        model = nnx.merge(self._graphdef, params)
        batch = make_forward_batch(
            query_start_loc,
            num_computed,
            slot_ids,
            num_tokens=tokens.shape[0],
            chunk_size=self.cfg.mamba_chunk_size,
            num_decode=num_decode,
        )
        # Each sequence's last token (padding sequences read an arbitrary row).
        last_rows = jnp.maximum(query_start_loc[1:] - 1, 0)
        logits, caches = model.forward(tokens, batch, caches, logits_rows=last_rows)
        # A fresh key per step of a generation, from data: no program per seed or step.
        key = jax.random.fold_in(jax.random.key(seed), step_index)
        return logits, sample_tokens(logits, key, temperature, top_k), caches

    def _run(
        self,
        arrays: StepArrays,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int = 0,
        step_index: int = 0,
    ) -> tuple[jax.Array, jax.Array]:
        """Runs one built step and samples from it: ``(logits[R, V], tokens[R])``, on the
        device (``R`` sequence rows, padding included)."""
        rows = arrays.slot_ids.shape[0]
        start = time.perf_counter()
        try:
            logits, tokens, self.caches = self._jitted(
                self._params,
                self.caches,
                arrays.tokens,
                arrays.query_start_loc,
                arrays.num_computed_tokens,
                arrays.slot_ids,
                np.full(rows, temperature, np.float32),
                np.full(rows, top_k or 0, np.int32),  # 0: no top-k restriction
                np.uint32(seed),
                np.int32(step_index),
                num_decode=arrays.num_decode,
            )
        except BaseException:
            self._recover_caches()
            raise
        if arrays.num_requests:  # warm-up steps are not traffic
            jax.block_until_ready((logits, tokens))
            self._count(arrays, time.perf_counter() - start)
        return logits, tokens

    def _recover_caches(self) -> None:
        """After a step that raised: the caches were donated to it, and if it consumed them
        (an interrupt or a device error after dispatch) fresh zero caches replace them, so
        the engine stays usable. Slots' states are lost then, which is harmless for slots
        given back, since a new sequence never reads its slot's old state."""
        if any(leaf.is_deleted() for leaf in jax.tree.leaves(self.caches)):
            self.caches = init_cache(
                self.cfg,
                num_slots=self.builder.num_slots,
                max_len=self.builder.max_len,
                dtype=self._cache_dtype,
            )

    def _count(self, arrays: StepArrays, seconds: float) -> None:
        decode_tokens = arrays.num_decode_requests
        prefill_tokens = arrays.num_tokens - decode_tokens
        # A mixed step runs decode rows and prompt tokens through the same program; every
        # token costs about the same in the projections, which dominate, so the step's time
        # is shared in proportion to the tokens.
        self.stats["decode_tokens"] += decode_tokens
        self.stats["prefill_tokens"] += prefill_tokens
        self.stats["decode_seconds"] += seconds * decode_tokens / arrays.num_tokens
        self.stats["prefill_seconds"] += seconds * prefill_tokens / arrays.num_tokens

    def step(self, arrays: StepArrays) -> jax.Array:
        """Runs one built step; returns the last-token logits of every sequence row,
        ``[R, V]`` fp32, on the device (a 256-row step's logits are 128 MiB at V = 128k:
        copying them to the host would take longer than the step; sample on the device)."""
        return self._run(arrays)[0]

    def warmup(self) -> int:
        """Compiles every program a generation can use, one per bucket with its sampling
        (all-padding steps change no cache); returns the count."""
        for num_decode, token_bucket in self.builder.buckets():
            self._run(self.builder.dummy(num_decode, token_bucket))
        return self.compile_count

    # ------------------------------------------------------------------------ slots

    def allocate_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError("no free cache slot")
        return self._free_slots.pop()

    def release_slot(self, slot: int) -> None:
        """Frees a slot. Its stale state is never read: the next sequence there starts with
        num_computed = 0 (no initial conv/SSM state) and kv_lens bound its attention."""
        if slot in self._free_slots or not 0 <= slot < self.builder.num_slots:
            raise ValueError(f"slot {slot} is not in use")
        self._free_slots.append(slot)

    # ------------------------------------------------------------------------ generate

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int = 0,
        eos_id: int | None = None,
        progress: bool | None = None,
    ) -> list[list[int]]:
        """Generates up to ``max_new_tokens`` per prompt; the new tokens only, in order.

        Greedy at ``temperature=0``; otherwise samples from the softmax of
        ``logits / temperature`` over the ``top_k`` largest (all when None), with keys from
        ``seed`` (an int in ``[0, 2**32)``). Every argument and prompt (token ids in
        ``[0, vocab_size)``) is checked before any slot or cache is touched; the slots
        taken come back however the call ends (an error, an interrupt), so the engine
        stays usable. No prompts or ``max_new_tokens=0`` give empty results.
        """
        prompts = self._check_prompts(prompts)
        max_new_tokens = _check_int("max_new_tokens", max_new_tokens, low=0)
        if top_k is not None:
            top_k = _check_int("top_k", top_k, low=1)
        if not isinstance(temperature, numbers.Real) or not math.isfinite(temperature):
            raise ValueError(f"temperature={temperature!r} must be a finite number")
        if temperature < 0:
            raise ValueError(f"{temperature=} must be >= 0 (0: greedy)")
        seed = _check_int("seed", seed, low=0)
        if seed >= _SEED_LIMIT:
            raise ValueError(f"{seed=} must be < 2**32")
        if eos_id is not None:
            eos_id = _check_int("eos_id", eos_id)
        for i, prompt in enumerate(prompts):
            if len(prompt) + max_new_tokens > self.builder.max_len:
                raise ValueError(
                    f"prompt {i}: {len(prompt)} tokens + {max_new_tokens} new "
                    f"exceed max_len={self.builder.max_len}"
                )
        if not prompts or max_new_tokens == 0:
            return [[] for _ in prompts]

        waiting = collections.deque(_Sequence(i, p) for i, p in enumerate(prompts))
        running: list[_Sequence] = []
        finished: dict[int, list[int]] = {}
        bar = _Progress(len(prompts) * max_new_tokens, enabled=progress)
        # Every slot this call takes is back in the free list when it returns or raises
        # (however far it got): the free list is restored as it was on entry.
        free_on_entry = list(self._free_slots)
        step_index = 0
        try:
            while waiting or running:
                while waiting and self._free_slots:
                    seq = waiting.popleft()
                    seq.slot = self.allocate_slot()
                    running.append(seq)
                decode = [s for s in running if s.prompt_done]
                budget = max(self.token_budget - len(decode), 0) if decode else self.token_budget
                prefill: list[tuple[_Sequence, int]] = []
                for seq in running:
                    if not seq.prompt_done and budget:
                        count = min(len(seq.prompt) - seq.num_computed, budget)
                        prefill.append((seq, count))
                        budget -= count
                arrays = self.builder.build(
                    [Request(s.slot, [s.generated[-1]], s.num_computed) for s in decode],
                    [
                        Request(
                            s.slot, s.prompt[s.num_computed : s.num_computed + n], s.num_computed
                        )
                        for s, n in prefill
                    ],
                )
                _, tokens = self._run(
                    arrays, temperature=temperature, top_k=top_k, seed=seed, step_index=step_index
                )
                tokens = np.asarray(tokens)
                step_index += 1
                fed = [(s, 1) for s in decode] + prefill
                for (seq, count), row in zip(fed, self.builder.request_rows(arrays), strict=True):
                    seq.num_computed += count
                    if not seq.prompt_done:
                        continue
                    token = int(tokens[row])
                    seq.generated.append(token)
                    bar.advance()
                    if len(seq.generated) == max_new_tokens or token == eos_id:
                        finished[seq.index] = seq.generated
                        running.remove(seq)
                        self.release_slot(seq.slot)
        finally:
            self._free_slots = free_on_entry
            bar.close()
        return [finished[i] for i in range(len(prompts))]

    def _check_prompts(self, prompts: Iterable[Sequence[int]]) -> list[list[int]]:
        """Prompts as lists of ints in ``[0, vocab_size)``; ``ValueError`` naming the first
        bad one."""
        if isinstance(prompts, str | bytes):
            raise ValueError("prompts must be a list of token-id lists, not a string")
        vocab = self.cfg.vocab_size
        checked = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str | bytes):
                raise ValueError(f"prompt {i} is a string; a prompt is a list of int token ids")
            ids = []
            try:
                for token in prompt:
                    if isinstance(token, bool):  # an int to Python, never a token id
                        raise TypeError
                    ids.append(operator.index(token))
            except TypeError:
                raise ValueError(
                    f"prompt {i} must be a list of int token ids, got {reprlib.repr(prompt)}"
                ) from None
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            for position, token in enumerate(ids):
                if not 0 <= token < vocab:
                    raise ValueError(
                        f"prompt {i}: token id {token} at position {position} is outside "
                        f"[0, vocab_size={vocab})"
                    )
            checked.append(ids)
        return checked


def _check_int(name: str, value: object, *, low: int | None = None) -> int:
    """``value`` as an int (bools refused), ``>= low`` when given; ValueError otherwise."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} must be an int") from None
    if low is not None and number < low:
        raise ValueError(f"{name}={number} must be >= {low}")
    return number


def sample_tokens(
    logits: jax.Array,
    key: jax.Array,
    temperature: float | jax.Array = 0.0,
    top_k: int | jax.Array | None = None,
) -> jax.Array:
    """Next token of each row of ``logits[R, V]``, ``int32[R]``, on the device.

    Rows at ``temperature <= 0`` take the argmax; the others draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits (ties at
    the cutoff kept; all when None). ``temperature`` (scalar or ``f32[R]``) and ``top_k``
    (scalar or ``int32[R]``) are data, not static arguments: under ``jax.jit`` one program
    serves every setting (the engine samples inside its step this way). In an array,
    ``top_k < 1`` or ``>= V`` also means no restriction (how a row says None).
    """
    if top_k is not None and not isinstance(top_k, jax.core.Tracer) and np.any(np.less(top_k, 1)):
        raise ValueError(f"top_k={top_k} must be >= 1 or None")
    rows, vocab = logits.shape
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (rows,))
    top_k = jnp.broadcast_to(jnp.asarray(0 if top_k is None else top_k, jnp.int32), (rows,))
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = temperature > 0

    def draw() -> jax.Array:
        scaled = logits.astype(jnp.float32) / jnp.where(sampled, temperature, 1.0)[:, None]
        limited = sampled & (top_k >= 1) & (top_k < vocab)

        def restrict(scaled: jax.Array) -> jax.Array:
            # The k-th largest logit of each row is its cutoff (k is data: a sort, not
            # lax.top_k, whose k is static).
            ascending = jnp.sort(scaled, axis=-1)
            position = (vocab - jnp.clip(top_k, 1, vocab))[:, None]
            cutoff = jnp.take_along_axis(ascending, position, axis=-1)
            return jnp.where(limited[:, None] & (scaled < cutoff), -jnp.inf, scaled)

        # Skip the sort when no row restricts (one branch runs, both are compiled).
        scaled = jax.lax.cond(jnp.any(limited), restrict, lambda s: s, scaled)
        drawn = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
        return jnp.where(sampled, drawn, greedy)

    return jax.lax.cond(jnp.any(sampled), draw, lambda: greedy)


class _Progress:
    """A one-line progress bar on stderr for long generations (auto: TTY and ≥ 256 tokens)."""

    def __init__(self, total: int, *, enabled: bool | None):
        if enabled is None:
            enabled = total >= 256 and sys.stderr.isatty()
        self.total, self.done, self.enabled = total, 0, enabled

    def advance(self) -> None:
        self.done += 1
        if self.enabled and (self.done % 16 == 0 or self.done == self.total):
            filled = 30 * self.done // max(self.total, 1)
            sys.stderr.write(
                f"\rgenerate [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} tokens"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
