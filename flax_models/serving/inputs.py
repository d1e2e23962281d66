"""Checks of what callers hand the engine: bucket settings, prompts, sampling settings and
eos ids. Every check raises ``ValueError`` naming the argument or the request, before any
slot or cache is touched."""

from __future__ import annotations

import numbers
import operator
import reprlib
from collections.abc import Iterable, Sequence

import numpy as np

import pallas_kernels as pk
from flax_models.serving.sampling import SamplingParams

__all__ = ["check_buckets", "check_eos_ids", "check_prompts", "check_sampling"]


def check_buckets(
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


def check_sampling(
    sampling: SamplingParams | Sequence[SamplingParams] | None,
    num_prompts: int,
    *,
    default: SamplingParams | None = None,
) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt from one for all, one each, or None: ``default``,
    else greedy, 16 tokens (the engine's token-id API keeps its greedy default)."""
    if sampling is None or isinstance(sampling, SamplingParams):
        if sampling is None:
            sampling = default or SamplingParams(temperature=0.0, seed=0)
        params = [sampling] * num_prompts
    else:
        params = list(sampling)
        if len(params) != num_prompts:
            raise ValueError(
                f"{len(params)} SamplingParams for {num_prompts} prompts: give one, or "
                "one per prompt"
            )
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling {i} is a {type(p).__name__}, not SamplingParams")
    return params


def check_eos_ids(eos_ids: int | Iterable[int] | None) -> frozenset[int]:
    """The eos ids as a set of ints (one id, several, or None for none)."""
    if eos_ids is None:
        eos_ids = ()
    elif isinstance(eos_ids, numbers.Integral):
        eos_ids = (eos_ids,)
    return frozenset(pk.check_int("eos_id", t) for t in eos_ids)


def check_prompts(prompts: object, vocab_size: int) -> list[list[int]]:
    """Prompts as lists of ints in ``[0, vocab_size)``; ``ValueError`` naming the first
    bad one. A prompt is a list of ints or a 1-D NumPy/JAX integer array; ``prompts``
    is a list of them or a 2-D integer array."""
    if isinstance(prompts, str | bytes):
        raise ValueError("prompts must be a list of token-id lists, not a string")
    if hasattr(prompts, "__array__") and not isinstance(prompts, list | tuple):
        prompts = np.asarray(prompts)
        if prompts.ndim == 1:
            raise ValueError(
                f"prompts is a flat array of {prompts.shape[0]} token ids; pass a list of "
                "prompts or a 2-D array [prompts, tokens], e.g. [ids]"
            )
        if prompts.ndim != 2:
            raise ValueError(
                f"a prompts array must be 2-D [prompts, tokens], got shape {prompts.shape}"
            )
        prompts = list(prompts)
    try:
        prompts = list(prompts)
    except TypeError:
        raise ValueError(
            f"prompts must be a list of token-id lists, got {reprlib.repr(prompts)}"
        ) from None
    if prompts and all(_is_token(p) for p in prompts):
        raise ValueError(
            f"prompts={reprlib.repr(prompts)} is a flat list of token ids; pass a list of "
            "prompts, e.g. [[1, 2, 3]]"
        )
    checked = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str | bytes):
            raise ValueError(f"prompt {i} is a string; a prompt is a list of int token ids")
        ids = _token_ids(prompt)
        if ids is None:
            raise ValueError(
                f"prompt {i} must be a list or 1-D array of int token ids (not floats or "
                f"bools), got {reprlib.repr(prompt)}"
            )
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        for position, token in enumerate(ids):
            if not 0 <= token < vocab_size:
                raise ValueError(
                    f"prompt {i}: token id {token} at position {position} is outside "
                    f"[0, vocab_size={vocab_size})"
                )
        checked.append(ids)
    return checked


def _is_token(value: object) -> bool:
    """An int-like scalar (a Python, NumPy or 0-d array integer), not a prompt."""
    if isinstance(value, bool):
        return False
    if isinstance(value, numbers.Integral):
        return True
    return getattr(value, "ndim", None) == 0


def _token_ids(prompt: object) -> list[int] | None:
    """``prompt`` as a list of ints, or None when it is not a sequence of integer ids
    (floats, bools, nested lists and scalars are refused)."""
    if hasattr(prompt, "__array__") and not isinstance(prompt, list | tuple):
        array = np.asarray(prompt)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            return None
        return [int(t) for t in array.tolist()]
    ids = []
    try:
        for token in prompt:
            if isinstance(token, bool | np.bool_):  # an int to Python, never a token id
                return None
            if hasattr(token, "dtype") and np.dtype(token.dtype).kind not in "iu":
                return None
            ids.append(operator.index(token))
    except TypeError:
        return None
    return ids
