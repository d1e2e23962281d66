"""Training a ``HybridLM``: next-token cross-entropy on padded or packed batches, a train step.

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

:func:`train_step` is one optimizer step: ``nnx.value_and_grad`` of the loss with respect to
the model's ``nnx.Param`` leaves, then ``nnx.Optimizer.update`` (AdamW by default, from
:func:`default_optimizer`), jitted with the model and optimizer donated (updated in place).
Activation memory is set by the model's ``remat`` (``HybridLM(..., remat="block")``, or
``model.remat = "block"`` on a loaded checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from flax_models.batch import make_forward_batch
from flax_models.cache import init_cache
from flax_models.model import HybridLM

# Labels equal to this score nothing (Hugging Face's and PyTorch's ``ignore_index``).
IGNORE_INDEX: Final = -100


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
    labels = tokens if labels is None else jnp.asarray(labels)
    # A sequence's first token is no target of the row before it (the previous sequence's
    # last); padding rows are no targets. (An empty sequence's start is the next one's.)
    row = jnp.arange(num_tokens)
    starts = jnp.zeros((num_tokens,), bool).at[qsl[:-1]].set(True, mode="drop")
    labels = jnp.where(starts | (row >= qsl[-1]), IGNORE_INDEX, labels)
    return next_token_cross_entropy(logits[None], labels[None])


def default_optimizer(
    learning_rate: float | optax.Schedule = 3e-4,
    *,
    weight_decay: float = 0.1,
    b1: float = 0.9,
    b2: float = 0.95,
    clip_norm: float | None = 1.0,
) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay) after global-norm gradient clipping, the usual recipe
    for language models, with its state in fp32 whatever the parameters' dtype
    (:func:`fp32_state`)."""
    adamw = optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay)
    if clip_norm is not None:
        adamw = optax.chain(optax.clip_by_global_norm(clip_norm), adamw)
    return fp32_state(adamw)


def fp32_state(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` run in fp32: its state (Adam's moments) is created from fp32 copies of the
    parameters, gradients and parameters are cast to fp32 before each update, and the
    updates come back in the gradients' dtype. For bf16 parameters: the moments keep fp32
    precision (optax would keep the second moment in the parameters' dtype); the
    parameters themselves stay bf16."""

    def fp32(tree):
        return jax.tree.map(
            lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
        )

    def init(params):
        return tx.init(fp32(params))

    def update(updates, state, params=None):
        new, state = tx.update(fp32(updates), state, None if params is None else fp32(params))
        return jax.tree.map(lambda n, u: n.astype(u.dtype), new, updates), state

    return optax.GradientTransformation(init, update)


def make_optimizer(
    model: HybridLM, tx: optax.GradientTransformation | None = None
) -> nnx.Optimizer:
    """An ``nnx.Optimizer`` over the model's ``nnx.Param`` leaves; ``tx`` defaults to
    :func:`default_optimizer`."""
    return nnx.Optimizer(model, default_optimizer() if tx is None else tx, wrt=nnx.Param)


LossFn = Callable[..., jax.Array]


def _train_step(
    model: HybridLM, optimizer: nnx.Optimizer, batch: tuple[jax.Array, ...], loss: LossFn
) -> jax.Array:
    value, grads = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, nnx.Param))(model, *batch)
    optimizer.update(model, grads)
    return value


_train_step_jit = nnx.jit(_train_step, donate_argnums=(0, 1), static_argnames="loss")


def train_step(
    model: HybridLM, optimizer: nnx.Optimizer, *batch: jax.Array, loss: LossFn = loss_fn
) -> jax.Array:
    """One optimizer step on ``loss(model, *batch)``: the loss before the update, fp32.

    ``batch`` defaults to :func:`loss_fn`'s ``input_ids[B, L]`` and optional
    ``labels[B, L]``; for packed sequences pass ``tokens[T], query_start_loc[B + 1]`` and
    ``loss=functools.partial(packed_loss_fn, max_len=...)``. ``loss`` is a static argument:
    make it once and pass the same object to every step (a ``functools.partial`` compares
    by identity, so a new one compiles again). ``model`` and ``optimizer`` (from
    :func:`make_optimizer`, over the same model) are updated in place; the step is jitted
    (one compilation per loss and batch shape) with their buffers donated, so parameters
    and optimizer state are not held twice.
    """
    return _train_step_jit(model, optimizer, tuple(jnp.asarray(a) for a in batch), loss=loss)
