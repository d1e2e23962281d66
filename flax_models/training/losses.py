"""Next-token cross-entropy of a ``HybridLM`` on padded or packed batches.

A training batch is the dense layout of ``HybridLM.__call__``: ``input_ids[B, L]``, every
row one sequence starting at position 0, **right**-padded to ``L``. The models are causal,
so the padding after a sequence's last token changes none of its logits; the loss leaves
the padded positions out through ``labels`` (Hugging Face's convention): ``labels[B, L]``
is aligned with ``input_ids``, the logits at position ``t`` are scored against
``labels[:, t + 1]``, and a label equal to :data:`IGNORE_INDEX` (-100) scores nothing.
:func:`pad_sequences` builds both from token lists::

    sequences = [[5, 6, 7, 8], [9, 3]]
    input_ids = [[5, 6, 7, 8], [9, 3, 0, 0]]        pad_id 0 after the short sequence
    labels    = [[5, 6, 7, 8], [9, 3, -100, -100]]  scored targets: 6 7 8 | 3

The loss is the mean over the scored targets of the whole batch (every real token weighs
the same, whatever its sequence's length), computed in fp32 from the fp32 logits.

Packed batches waste no compute on padding: :func:`packed_loss_fn` takes ``tokens[T]`` with
``query_start_loc[B + 1]`` (the kernels' varlen layout, ``HybridLM.forward``) and gives
the loss the same sequences would give padded.

:func:`pack_documents` fills rows of a fixed length with several documents each, in that
packed layout: a document's loss and gradients do not depend on its neighbours.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flax_models.batch import make_forward_batch
from flax_models.cache import init_cache
from flax_models.model import HybridLM

# Labels equal to this score nothing (Hugging Face's and PyTorch's ``ignore_index``).
IGNORE_INDEX: Final = -100

LossFn = Callable[..., jax.Array]


def pad_sequences(
    sequences: Sequence[Sequence[int]], *, length: int | None = None, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Token lists → right-padded ``(input_ids[B, L], labels[B, L])``, int32.

    Args:
      sequences: B token lists, each of at least one token (no token ids are checked
        against a vocabulary here; ``HybridLM`` checks concrete ids).
      length: L, at least the longest sequence; default the longest sequence.
      pad_id: the token placed after each sequence (any valid id: no logit depends on it).

    Returns:
      ``input_ids`` with ``pad_id`` after each sequence and ``labels`` equal to them with
      :data:`IGNORE_INDEX` at the padding.
    """
    lengths = [len(s) for s in sequences]
    if not sequences or min(lengths) < 1:
        raise ValueError(f"sequences must be one or more non-empty token lists, got {lengths=}")
    longest = max(lengths)
    length = longest if length is None else length
    if length < longest:
        raise ValueError(f"{length=} must be at least the longest sequence ({longest})")
    input_ids = np.full((len(sequences), length), pad_id, np.int32)
    labels = np.full((len(sequences), length), IGNORE_INDEX, np.int32)
    for row, tokens in enumerate(sequences):
        input_ids[row, : len(tokens)] = tokens
        labels[row, : len(tokens)] = tokens
    return input_ids, labels


def next_token_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy: ``logits[B, L, V]`` at position ``t`` against
    ``labels[B, L]`` at ``t + 1``, over the targets that are not :data:`IGNORE_INDEX`.

    fp32 throughout: ``logsumexp(logits) - logits[label]`` per scored target (the full
    log-softmax ``[B, L, V]`` is never formed). Targets left out are selected away, not
    multiplied by zero, so whatever the logits there (even NaN) they change neither the
    loss nor its gradient. No scored target gives 0 (and zero gradients), not NaN.

    Labels other than :data:`IGNORE_INDEX` must lie in ``[0, V)``; they are not checked
    (they are traced under ``jax.jit``).
    """
    if logits.ndim != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"logits must be [B, L, V] and labels [B, L], got {logits.shape} and {labels.shape}"
        )
    logits = logits[:, :-1].astype(jnp.float32)  # position L - 1 has no next token
    targets = labels[:, 1:]
    scored = targets != IGNORE_INDEX
    # Unscored rows are replaced before anything reads them: selecting only the result
    # would still backpropagate 0 · (their softmax), NaN where they hold NaN or inf.
    logits = jnp.where(scored[..., None], logits, 0.0)
    safe = jnp.where(scored, targets, 0)  # a valid index for the gather; selected away below
    picked = jnp.take_along_axis(logits, safe[..., None].astype(jnp.int32), axis=-1)[..., 0]
    nll = jnp.where(scored, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0)
    return jnp.sum(nll) / jnp.maximum(jnp.sum(scored), 1).astype(jnp.float32)


def loss_fn(model: HybridLM, input_ids: jax.Array, labels: jax.Array | None = None) -> jax.Array:
    """The model's mean next-token cross-entropy on ``input_ids[B, L]`` (right-padded rows,
    one sequence each), scored against ``labels[B, L]`` (default ``input_ids``: no padding);
    see :func:`next_token_cross_entropy`."""
    return next_token_cross_entropy(model(input_ids), input_ids if labels is None else labels)


def packed_loss_fn(
    model: HybridLM,
    tokens: jax.Array,
    query_start_loc: jax.Array,
    labels: jax.Array | None = None,
    *,
    max_len: int | None = None,
) -> jax.Array:
    """The mean next-token cross-entropy of packed sequences, with no padding between them.

    ``tokens[T]`` holds B sequences back to back, sequence ``b`` in rows
    ``query_start_loc[b]:query_start_loc[b + 1]`` (``int32[B + 1]``, non-decreasing,
    starting at 0; a sequence may be empty); rows from ``query_start_loc[B]`` on are padding
    (any valid ids). Every sequence starts fresh: the model runs the packed kernels on them
    (chunk-aligned SSD scan, varlen conv and attention), so no state or key crosses from one
    to the next, and a token scores the next one only within its own sequence. ``labels[T]``
    (default ``tokens``) follows :func:`next_token_cross_entropy`'s convention; the same
    sequences padded into ``[B, L]`` give the same loss.

    Args:
      max_len: attention keys held per sequence, at least its longest sequence (static;
        default T, always enough). Keys past it would be dropped; a concrete
        ``query_start_loc`` is checked. The attention caches of the differentiated forward
        hold ``B × max_len`` keys per layer: with many short sequences, pass the longest
        sequence's length rather than the default.
    """
    tokens = jnp.asarray(tokens)
    qsl = jnp.asarray(query_start_loc, jnp.int32)
    if tokens.ndim != 1 or qsl.ndim != 1 or qsl.shape[0] < 2:
        raise ValueError(
            f"tokens must be [T] and query_start_loc [B + 1] with B >= 1, got {tokens.shape} "
            f"and {qsl.shape}"
        )
    num_tokens, num_seqs = tokens.shape[0], qsl.shape[0] - 1
    max_len = num_tokens if max_len is None else max_len
    if not isinstance(qsl, jax.core.Tracer):
        host = np.asarray(qsl)
        lengths = np.diff(host)
        if host[0] != 0 or lengths.min() < 0 or host[-1] > num_tokens:
            raise ValueError(f"query_start_loc={host} must rise from 0 to at most T={num_tokens}")
        if lengths.max() > max_len:
            raise ValueError(f"{max_len=} must hold the longest sequence ({lengths.max()})")
    batch = make_forward_batch(
        qsl,
        jnp.zeros((num_seqs,), jnp.int32),
        jnp.arange(num_seqs, dtype=jnp.int32),
        num_tokens=num_tokens,
        chunk_size=model.cfg.mamba_chunk_size,
    )
    caches = init_cache(
        model.cfg, num_slots=num_seqs, max_len=max_len, dtype=model.dtype, mesh=model.mesh
    )
    logits, _ = model.forward(tokens, batch, caches)
    labels = packed_labels(tokens, qsl, labels)
    return next_token_cross_entropy(logits[None], labels[None])


def packed_labels(tokens: jax.Array, query_start_loc: jax.Array, labels: jax.Array | None = None):
    """The labels :func:`packed_loss_fn` scores, ``[T]``: ``labels`` (default ``tokens``)
    with :data:`IGNORE_INDEX` at every sequence's first token (no target of the row before
    it, the previous sequence's last) and at the padding rows from ``query_start_loc[B]``
    on. (An empty sequence's start is the next one's.)"""
    tokens = jnp.asarray(tokens)
    qsl = jnp.asarray(query_start_loc, jnp.int32)
    labels = tokens if labels is None else jnp.asarray(labels)
    row = jnp.arange(tokens.shape[0])
    starts = jnp.zeros(tokens.shape, bool).at[qsl[:-1]].set(True, mode="drop")
    return jnp.where(starts | (row >= qsl[-1]), IGNORE_INDEX, labels)


def scored_targets(batch: Sequence) -> int:
    """How many targets a batch scores: ``(input_ids[B, L], labels[B, L] = input_ids)`` for
    :func:`loss_fn`, ``(tokens[T], query_start_loc[B + 1], labels[T] = tokens)`` for
    :func:`packed_loss_fn` (told apart by the first array's rank)."""
    first = np.asarray(batch[0])
    if first.ndim == 2:
        labels = first if len(batch) < 2 or batch[1] is None else np.asarray(batch[1])
        return int(np.sum(labels[:, 1:] != IGNORE_INDEX))
    labels = np.asarray(packed_labels(*batch[:3]))
    return int(np.sum(labels[1:] != IGNORE_INDEX))


class PackedBatch(NamedTuple):
    """Documents packed into ``R`` rows of ``L`` tokens, in :func:`packed_loss_fn`'s layout.

    ``tokens[R · L]`` and ``labels[R · L]`` are the rows back to back (row-major: reshape
    to ``[R, L]`` to see them); ``query_start_loc[D + 1]`` starts each of the ``D`` sequences
    of the batch (documents, and the padding that ends a row before the next document
    starts; the trailing zero-length ones fill ``D`` up to its static size). Padding scores
    nothing. ``train_step(model, optimizer, *batch, loss=packed_loss(L))`` trains on it.
    """

    tokens: np.ndarray
    query_start_loc: np.ndarray
    labels: np.ndarray


def pack_documents(
    documents: Sequence[Sequence[int]],
    *,
    rows: int,
    length: int,
    max_documents: int | None = None,
    pad_id: int = 0,
) -> list[PackedBatch]:
    """Documents (token lists) packed greedily, in order, into batches of ``rows`` rows of
    ``length`` tokens, several documents per row, each one a sequence of its own::

        documents [5 6 7] [8 9] [1 2 3 4 5 6] [4], rows=2, length=4:
        row 0     5 6 7 _        row 1   8 9 _ _    ...  (_ padding, its own sequence)
        batch 0   tokens [5 6 7 0 8 9 0 0], query_start_loc [0 3 4 6]
        batch 1   [1 2 3 4 | 5 6 4 _]: a document longer than a row is cut at row ends

    Every sequence starts fresh (no SSM state, conv state or key crosses between them), so
    a document's loss and gradients are those it has alone. A document longer than
    ``length`` is cut into pieces of ``length`` tokens (each piece starts fresh, the way a
    row would); empty documents are skipped.

    Args:
      max_documents: the static number of sequences per batch (``query_start_loc`` has
        ``max_documents + 1`` entries); default the most any of these batches needs, so
        all of them share one shape (one compilation). ``ValueError`` when a batch needs
        more.
    """
    if rows < 1 or length < 1:
        raise ValueError(f"{rows=} and {length=} must be >= 1")
    pieces = [
        list(doc[start : start + length])
        for doc in documents
        for start in range(0, len(doc), length)
    ]
    batches: list[list[list[list[int]]]] = [[[]]]  # batch → row → pieces
    for piece in pieces:
        row = batches[-1][-1]
        if sum(map(len, row)) + len(piece) > length:
            if len(batches[-1]) == rows:
                batches.append([])
            batches[-1].append([])
        batches[-1][-1].append(piece)
    packed = [_pack_rows(batch, length, pad_id) for batch in batches if batch != [[]]]
    needed = max((len(starts) for _, _, starts in packed), default=1)
    max_documents = needed if max_documents is None else max_documents
    if needed > max_documents:
        raise ValueError(f"a batch holds {needed} sequences; {max_documents=} is too few")
    out = []
    for tokens, labels, starts in packed:
        qsl = np.asarray([*starts, len(tokens)], np.int32)  # its last sequence ends the rows
        qsl = np.pad(qsl, (0, max_documents + 1 - len(qsl)), mode="edge")
        pad = rows * length - len(tokens)  # the last row's tail, and rows left empty
        tokens = np.pad(np.asarray(tokens, np.int32), (0, pad), constant_values=pad_id)
        labels = np.pad(np.asarray(labels, np.int32), (0, pad), constant_values=IGNORE_INDEX)
        out.append(PackedBatch(tokens, qsl, labels))
    return out


def _pack_rows(
    rows: list[list[list[int]]], length: int, pad_id: int
) -> tuple[list[int], list[int], list[int]]:
    """One batch's rows of pieces → (tokens, labels, sequence starts), up to the end of its
    last piece. A row that ends short of ``length`` before another row follows is filled
    with a padding sequence (scoring nothing) so the next row starts at its offset."""
    tokens: list[int] = []
    labels: list[int] = []
    starts: list[int] = []
    for r, row in enumerate(rows):
        for piece in row:
            starts.append(len(tokens))
            tokens += piece
            labels += piece
        short = length - sum(map(len, row))
        if r + 1 < len(rows) and short:
            starts.append(len(tokens))
            tokens += [pad_id] * short
            labels += [IGNORE_INDEX] * short
    return tokens, labels, starts


@functools.cache
def packed_loss(max_len: int) -> LossFn:
    """:func:`packed_loss_fn` with ``max_len`` bound, one object per ``max_len`` (a static
    argument of ``train_step`` and ``evaluate``: the same object compiles once)."""
    return functools.partial(packed_loss_fn, max_len=max_len)
