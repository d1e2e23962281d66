"""Held-out loss and perplexity over a stream of batches."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from flax_models.model import HybridLM
from flax_models.training.losses import LossFn, loss_fn, scored_targets


@functools.partial(nnx.jit, static_argnames="loss")
def _batch_loss(model: HybridLM, batch: tuple[jax.Array, ...], loss: LossFn) -> jax.Array:
    return loss(model, *batch)


def evaluate(
    model: HybridLM, batches: Iterable[Sequence], *, loss: LossFn = loss_fn
) -> dict[str, float]:
    """``{"loss", "perplexity", "tokens"}`` of ``model`` on ``batches``: the mean
    next-token cross-entropy over every scored target of all of them (each batch weighed
    by its number of targets, so the result does not depend on how the data is cut into
    batches), ``exp(loss)``, and that number of targets.

    Each batch is what ``train_step`` takes for ``loss``: ``(input_ids[B, L],)`` or
    ``(input_ids, labels)`` for :func:`~flax_models.training.loss_fn`, a ``PackedBatch``
    with ``loss=packed_loss(L)``. No parameter changes; batches of one shape compile once.
    """
    total, count = 0.0, 0
    for batch in batches:
        batch = tuple(jnp.asarray(a) for a in batch)
        n = scored_targets(batch)
        if n:
            total += float(_batch_loss(model, batch, loss=loss)) * n
            count += n
    if not count:
        raise ValueError("the batches score no target (every label is IGNORE_INDEX)")
    mean = total / count
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": count}
