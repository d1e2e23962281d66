"""Sampling settings per request, and the device sampler the engine's step runs.

``SamplingParams`` is what a request asks for (as in vLLM): how many tokens, temperature,
top-k, top-p, its seed, and what stops it. It is checked once, when it is made.

``sample_tokens`` draws the next token of every row of a step's logits on the device, with
every setting as data (one value per row), so one compiled step serves any mix of
requests. Each row draws with its own key, ``request_keys(seeds, counters)``: the key of a
request's ``n``-th generated token is ``fold_in(key(seed), n)``, so a request's tokens
depend on its own seed and prompt only, never on the requests it is batched with, nor on
the step its token happens to be drawn in.

Filtering follows transformers' and vLLM's order: divide by the temperature, keep the
``top_k`` largest logits, then the smallest set of the largest whose probabilities (after
top-k) sum to at least ``top_p``; ties at either cutoff are kept.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk

# Seeds are 32-bit: the step builds keys from uint32 data (not constants, so one program
# serves every seed); jax.random.key(seed) gives the same key for these seeds.
SEED_LIMIT = 2**32


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} must be a number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be finite")
    return value


def _strings(name: str, value: str | Iterable[str]) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else tuple(value)
    for item in items:
        if not isinstance(item, str) or not item:
            raise ValueError(f"{name}={value!r} must be non-empty strings")
    return items


_UNSET: Any = object()  # a field the caller did not give (generation_config.json may)


@dataclasses.dataclass(frozen=True, init=False)
class SamplingParams:
    """How one request generates, with vLLM's names and meanings (checked on construction:
    ``ValueError`` names the field). Fields left unset take the checkpoint's
    ``generation_config.json`` values where ``LLM`` finds them (``with_defaults``).

    Attributes:
      n: completions to generate for the prompt (>= 1); with prefix caching they share
        the prompt's prefill.
      temperature: 0 is greedy (argmax); otherwise the softmax of ``logits / temperature``
        (finite, >= 0).
      top_p: keep the smallest set of largest-probability tokens whose probabilities sum
        to at least ``top_p`` (in (0, 1]; 1: all).
      top_k: keep the ``top_k`` largest logits (an int >= 1; -1 or 0: all).
      seed: the request's random seed, an int in ``[0, 2**32)``, or None (the engine
        draws one from its own seed). The same seed and prompt give the same tokens,
        whatever else runs in the same batch.
      stop: strings that end the completion when the generated text contains one (it may
        span several tokens); the text is cut before it.
      stop_token_ids: token ids that end the completion (on top of the checkpoint's eos),
        with ``finish_reason="stop"``; the stopping token is kept in ``token_ids``.
      max_tokens: tokens to generate at most (>= 0; ``max_new_tokens`` is an alias).
      logprobs: return the log-probability of each sampled token and of the ``logprobs``
        most likely tokens at its position (fp32 log-softmax of the model's logits; an
        int in ``[0, MAX_LOGPROBS]``), or None for none.
      ignore_eos: keep generating past the checkpoint's eos tokens (``stop_token_ids``
        still stop).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    logprobs: int | None = None
    ignore_eos: bool = False
    unset: frozenset[str] = dataclasses.field(default=frozenset(), compare=False, repr=False)

    def __init__(
        self,
        n: int = _UNSET,
        temperature: float = _UNSET,
        top_p: float | None = _UNSET,
        top_k: int | None = _UNSET,
        seed: int | None = _UNSET,
        stop: str | Iterable[str] | None = _UNSET,
        stop_token_ids: int | Iterable[int] | None = _UNSET,
        max_tokens: int = _UNSET,
        logprobs: int | None = _UNSET,
        ignore_eos: bool = _UNSET,
        *,
        max_new_tokens: int = _UNSET,
        unset: frozenset[str] = frozenset(),
    ):
        if max_new_tokens is not _UNSET:
            if max_tokens is not _UNSET:
                raise ValueError("give max_tokens or its alias max_new_tokens, not both")
            # Checked under the name the caller gave.
            max_tokens = pk.check_int("max_new_tokens", max_new_tokens, low=0)
        given = dict(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            stop_token_ids=stop_token_ids,
            max_tokens=max_tokens,
            logprobs=logprobs,
            ignore_eos=ignore_eos,
        )
        missing = {name for name, value in given.items() if value is _UNSET}
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in given}
        values = {name: defaults[name] if name in missing else v for name, v in given.items()}
        for name, value in _checked(values).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "unset", frozenset(missing) | frozenset(unset))

    @property
    def max_new_tokens(self) -> int:
        """``max_tokens`` (the older name)."""
        return self.max_tokens

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_defaults(self, defaults: Mapping[str, object]) -> SamplingParams:
        """These settings with each unset field taken from ``defaults`` (field name ->
        value, e.g. from ``generation_config.json``) where it has one."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        del fields["unset"]
        taken = {k: v for k, v in defaults.items() if k in self.unset and k in fields}
        return SamplingParams(**(fields | taken), unset=self.unset - set(taken))


# The most log-probabilities a request may ask for (vLLM's default max_logprobs).
MAX_LOGPROBS = 20


def _checked(values: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``SamplingParams`` checked and canonicalised."""
    out = dict(values)
    out["n"] = pk.check_int("n", values["n"], low=1)
    out["max_tokens"] = pk.check_int("max_tokens", values["max_tokens"], low=0)
    temperature = _number("temperature", values["temperature"])
    if temperature < 0:
        raise ValueError(f"{temperature=} must be >= 0 (0: greedy)")
    out["temperature"] = temperature
    top_k = values["top_k"]
    out["top_k"] = -1 if top_k is None else pk.check_int("top_k", top_k, low=-1)
    if out["top_k"] == 0:
        out["top_k"] = -1  # 0 means off too (vLLM)
    top_p = 1.0 if values["top_p"] is None else _number("top_p", values["top_p"])
    if not 0 < top_p <= 1:
        raise ValueError(f"{top_p=} must be in (0, 1]")
    out["top_p"] = top_p
    seed = values["seed"]
    if seed is not None:
        seed = pk.check_int("seed", seed, low=0)
        if seed >= SEED_LIMIT:
            raise ValueError(f"{seed=} must be < 2**32")
    out["seed"] = seed
    ids = values["stop_token_ids"]
    ids = () if ids is None else (ids,) if isinstance(ids, numbers.Integral) else ids
    try:
        out["stop_token_ids"] = tuple(pk.check_int("stop_token_ids", t, low=0) for t in ids)
    except TypeError:
        raise ValueError(f"stop_token_ids={ids!r} must be ints") from None
    out["stop"] = () if values["stop"] is None else _strings("stop", values["stop"])
    logprobs = values["logprobs"]
    if logprobs is not None:
        logprobs = pk.check_int("logprobs", logprobs, low=0)
        if logprobs > MAX_LOGPROBS:
            raise ValueError(f"{logprobs=} must be at most {MAX_LOGPROBS}")
    out["logprobs"] = logprobs
    if not isinstance(values["ignore_eos"], bool):
        raise ValueError(f"ignore_eos={values['ignore_eos']!r} must be a bool")
    return out


def request_keys(seeds: jax.Array, counters: jax.Array) -> jax.Array:
    """One key per row, ``fold_in(key(seeds[r]), counters[r])``: ``seeds`` uint32[R] and
    ``counters`` int32[R] (the index of the token being drawn among the request's
    generated tokens) -> keys[R]."""
    return jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seeds, counters)


def filter_logits(
    logits: jax.Array,
    temperature: float | jax.Array = 1.0,
    top_k: int | jax.Array | None = None,
    top_p: float | jax.Array | None = None,
    *,
    restricts: bool | None = None,
) -> jax.Array:
    """``logits[R, V]`` scaled by ``1 / temperature`` (shifted by the row maximum, so a
    tiny temperature cannot overflow) with the tokens top-k and top-p remove set to
    ``-inf``: ``f32[R, V]``, the distribution ``sample_tokens`` draws from. Rows with
    ``temperature <= 0`` are scaled by 1. Array settings: ``top_k < 1`` or ``>= V`` and
    ``top_p`` outside ``(0, 1)`` mean no restriction. ``restricts``: whether some row
    restricts, when the caller knows (``sampler_flags``); None: decided on the device."""
    rows, vocab = logits.shape
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (rows,))
    top_k = jnp.broadcast_to(jnp.asarray(0 if top_k is None else top_k, jnp.int32), (rows,))
    top_p = jnp.broadcast_to(jnp.asarray(1.0 if top_p is None else top_p, jnp.float32), (rows,))
    logits = logits.astype(jnp.float32)
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    scaled = shifted / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    limit_k, limit_p = _restrictions(top_k, top_p, vocab)

    def restrict(scaled: jax.Array) -> jax.Array:
        # k and p are data: one sort per row (lax.top_k's k is static), then each cutoff is
        # a value of the sorted row; a token survives when it is >= both cutoffs.
        descending = -jnp.sort(-scaled, axis=-1)
        kth = jnp.take_along_axis(descending, (jnp.clip(top_k, 1, vocab) - 1)[:, None], axis=-1)
        keep_k = ~limit_k[:, None] | (descending >= kth)
        # Top-p on the distribution left by top-k: a sorted token is kept while the mass
        # before it is below p (the first always is).
        probs = jax.nn.softmax(jnp.where(keep_k, descending, -jnp.inf), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs
        keep = keep_k & (~limit_p[:, None] | (before < top_p[:, None]))
        count = jnp.maximum(jnp.sum(keep, axis=-1), 1)  # kept tokens form a sorted prefix
        cutoff = jnp.take_along_axis(descending, (count - 1)[:, None], axis=-1)
        return jnp.where(scaled < cutoff, -jnp.inf, scaled)

    if restricts is not None:
        return restrict(scaled) if restricts else scaled
    # Skip the sort when no row restricts (one branch runs, both are compiled). On a GPU
    # the host waits for the predicate of a lax.cond: a caller that must not wait (the
    # engine, launching its next step meanwhile) says ``restricts``.
    return jax.lax.cond(jnp.any(limit_k | limit_p), restrict, lambda s: s, scaled)


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """The argmax of each row of ``logits[R, V]``, ``int32[R]`` (the first on ties): what
    ``sample_tokens`` gives every row at ``temperature <= 0``."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sample_tokens(
    logits: jax.Array,
    key: jax.Array,
    temperature: float | jax.Array = 0.0,
    top_k: int | jax.Array | None = None,
    top_p: float | jax.Array | None = None,
    *,
    draws: bool | None = None,
    restricts: bool | None = None,
) -> jax.Array:
    """Next token of each row of ``logits[R, V]``, ``int32[R]``, on the device.

    Rows at ``temperature <= 0`` take the argmax; the others draw from
    ``filter_logits(logits, temperature, top_k, top_p)``. ``key`` is one key per row
    (``keys[R]``, e.g. from ``request_keys``: each row's draw depends on its key and its
    logits only) or a single key (row ``r`` then draws with ``fold_in(key, r)``).
    ``temperature`` (scalar or ``f32[R]``), ``top_k`` (scalar or ``int32[R]``) and
    ``top_p`` (scalar or ``f32[R]``) are data, not static arguments: under ``jax.jit`` one
    program serves every setting (the engine's sampler runs this way, with ``draws`` and
    ``restricts`` given). In an
    array, ``top_k < 1`` or ``>= V`` and ``top_p`` outside ``(0, 1)`` mean no restriction
    (how a row says None); a Python scalar must be valid (``ValueError`` otherwise).

    ``draws`` (some row has ``temperature > 0``) and ``restricts`` (some drawing row has a
    top-k or top-p): static facts of the settings a caller may know on the host
    (``sampler_flags``); None: decided on the device, with a ``lax.cond`` that skips the
    draw and the sort when no row needs them. On a GPU the host waits for a
    ``lax.cond``'s predicate, so a jitted step containing one cannot be launched ahead.
    """
    if isinstance(top_k, numbers.Number) and not (
        isinstance(top_k, numbers.Integral) and top_k >= 1
    ):
        raise ValueError(f"top_k={top_k} must be an int >= 1 or None")
    if isinstance(top_p, numbers.Number) and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] or None")
    rows = logits.shape[0]
    if key.ndim == 0:
        key = jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(rows))
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (rows,))
    greedy = greedy_tokens(logits)
    sampled = temperature > 0

    def draw() -> jax.Array:
        filtered = filter_logits(logits, temperature, top_k, top_p, restricts=restricts)
        drawn = jax.vmap(jax.random.categorical)(key, filtered).astype(jnp.int32)
        return jnp.where(sampled, drawn, greedy)

    if draws is not None:
        return draw() if draws else greedy
    return jax.lax.cond(jnp.any(sampled), draw, lambda: greedy)


def sampler_flags(arrays: dict[str, np.ndarray], vocab_size: int) -> tuple[bool, bool]:
    """``(draws, restricts)`` of ``sample_tokens`` for the rows of ``sampling_arrays``:
    whether some row draws, and whether some drawing row has a top-k or top-p."""
    drawing = arrays["temperature"] > 0
    limit_k, limit_p = _restrictions(arrays["top_k"], arrays["top_p"], vocab_size)
    return bool(drawing.any()), bool((drawing & (limit_k | limit_p)).any())


def _restrictions(top_k, top_p, vocab_size: int):
    """Per row, whether ``top_k`` and ``top_p`` (NumPy or JAX arrays) restrict the
    vocabulary: ``top_k`` in ``[1, V)``, ``top_p`` in ``(0, 1)``."""
    return (top_k >= 1) & (top_k < vocab_size), (top_p > 0) & (top_p < 1)


_GREEDY = SamplingParams(max_tokens=0, temperature=0.0, seed=0)


def sampling_arrays(params: list[SamplingParams | None], counters: list[int]) -> dict:
    """Per-row host arrays for the step's sampler (None: greedy, for a padding row or one
    whose token is not used): temperature f32, top_k int32 (0: none), top_p f32 (1: none),
    seeds uint32, counters int32."""
    real = [_GREEDY if p is None else p for p in params]
    return dict(
        temperature=np.asarray([p.temperature for p in real], np.float32),
        top_k=np.asarray([max(p.top_k, 0) for p in real], np.int32),
        top_p=np.asarray([p.top_p for p in real], np.float32),
        seeds=np.asarray([p.seed for p in real], np.uint32),
        counters=np.asarray(counters, np.int32),
    )
