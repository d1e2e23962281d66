"""Serving: a jitted step over slot-indexed caches, and a scheduler that generates.

Each step packs decode rows (one token per running sequence, through the single-step
conv/SSM update kernels) and prefill chunks (prompt tokens within the per-step token
budget, through the chunked conv and SSD scan, continuing from the cached state) into one
bucketed batch. Caches are donated to the jitted step and updated in place. Requests join
as slots free up and leave when done (continuous batching); a prompt longer than the
budget is spread over several steps (chunked prefill). After ``warmup()`` every bucket is
compiled and ``compile_count`` stays put.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import time
from collections.abc import Sequence

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


class Engine:
    """Serves a ``HybridLM`` over ``max_slots`` cache slots of ``max_len`` tokens.

    Args:
      model: the model (its ``implementation`` picks the kernels).
      max_slots: sequences in flight at once; more requests wait.
      max_len: tokens per sequence (prompt + generated).
      token_budget: prompt tokens per step (decode rows come on top).
      decode_buckets: allowed decode-row counts; powers of two up to ``max_slots``.
      token_buckets: allowed prefill token counts; powers of two up to ``token_budget``.
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
        if token_budget < 1:
            raise ValueError(f"{token_budget=} must be >= 1")
        self.cfg = model.cfg
        self.token_budget = token_budget
        self.builder = BatchBuilder(
            num_slots=max_slots,
            max_len=max_len,
            decode_buckets=tuple(decode_buckets or pk.sequence_buckets(max_slots)),
            token_buckets=tuple(token_buckets or pk.token_buckets(token_budget, min_tokens=16)),
            prefill_seqs=max_slots,
        )
        self.caches = init_cache(self.cfg, num_slots=max_slots, max_len=max_len, dtype=model.dtype)
        self._graphdef, self._params = nnx.split(model)
        self._free_slots = list(range(max_slots - 1, -1, -1))
        self.compile_count = 0
        # Wall time and real tokens of steps with prompt tokens ("prefill") and without.
        self.stats = dict.fromkeys(
            ("prefill_seconds", "prefill_tokens", "decode_seconds", "decode_tokens"), 0
        )
        self._jitted = jax.jit(self._step, static_argnames=("num_decode",), donate_argnums=(1,))

    # ------------------------------------------------------------------------ one step

    def _step(self, params, caches, tokens, query_start_loc, num_computed, slot_ids, *, num_decode):
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
        return model.forward(tokens, batch, caches, logits_rows=last_rows)

    def step(self, arrays: StepArrays) -> jax.Array:
        """Runs one built step; returns the last-token logits of every sequence row,
        ``[R, V]`` fp32, on the device (a 256-row step's logits are 128 MiB at V = 128k:
        copying them to the host would take longer than the step; sample on the device)."""
        start = time.perf_counter()
        logits, self.caches = self._jitted(
            self._params,
            self.caches,
            arrays.tokens,
            arrays.query_start_loc,
            arrays.num_computed_tokens,
            arrays.slot_ids,
            num_decode=arrays.num_decode,
        )
        if arrays.num_requests:  # warm-up steps are not traffic
            logits.block_until_ready()
            kind = "prefill" if arrays.bucket[1] else "decode"
            self.stats[f"{kind}_seconds"] += time.perf_counter() - start
            self.stats[f"{kind}_tokens"] += arrays.num_tokens
        return logits

    def warmup(self) -> int:
        """Compiles every bucket (all-padding steps change no cache); returns the count."""
        for num_decode, token_bucket in self.builder.buckets():
            self.step(self.builder.dummy(num_decode, token_bucket))
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
        prompts: list[list[int]],
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
        ``logits / temperature`` over the ``top_k`` largest (all when None). Every prompt
        is checked before any step runs.
        """
        if max_new_tokens < 1:
            raise ValueError(f"{max_new_tokens=} must be >= 1")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k={top_k} must be >= 1 or None")
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if len(prompt) + max_new_tokens > self.builder.max_len:
                raise ValueError(
                    f"prompt {i}: {len(prompt)} tokens + {max_new_tokens} new "
                    f"exceed max_len={self.builder.max_len}"
                )
        key = jax.random.key(seed)
        waiting = collections.deque(_Sequence(i, list(p)) for i, p in enumerate(prompts))
        running: list[_Sequence] = []
        finished: dict[int, list[int]] = {}
        bar = _Progress(len(prompts) * max_new_tokens, enabled=progress)
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
                    Request(s.slot, s.prompt[s.num_computed : s.num_computed + n], s.num_computed)
                    for s, n in prefill
                ],
            )
            key, step_key = jax.random.split(key)
            tokens = np.asarray(sample_tokens(self.step(arrays), step_key, temperature, top_k))
            fed = [(s, 1) for s in decode] + prefill
            for (seq, count), row in zip(
                fed, self.builder.request_rows(arrays, len(decode)), strict=True
            ):
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
        bar.close()
        return [finished[i] for i in range(len(prompts))]


def sample_tokens(
    logits: jax.Array, key: jax.Array, temperature: float = 0.0, top_k: int | None = None
) -> jax.Array:
    """Next token of each row of ``logits[R, V]``, ``int32[R]``, on the device: the argmax at
    ``temperature <= 0``; otherwise a draw from ``softmax(logits / temperature)`` restricted
    to the ``top_k`` largest logits (all when None)."""
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 or None")
    if temperature <= 0.0:
        return _greedy(logits)
    top_k = None if top_k is None or top_k >= logits.shape[-1] else int(top_k)
    return _draw(logits, key, jnp.float32(temperature), top_k=top_k)


@jax.jit
def _greedy(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("top_k",))
def _draw(logits: jax.Array, key: jax.Array, temperature: jax.Array, *, top_k: int | None):
    scaled = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        cutoff = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        scaled = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)


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
