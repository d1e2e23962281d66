"""Optimizers for ``HybridLM``: AdamW in fp32, learning-rate schedules, gradient accumulation.

:func:`make_optimizer` builds the ``nnx.Optimizer`` that :func:`~flax_models.training.train_step`
updates: over the model's ``nnx.Param`` leaves by default, or over the variables a
``trainable`` filter selects (``nnx.LoRAParam``: the adapters of ``flax_models.lora``
alone; the other weights then get no gradient, no update and no optimizer state).
``accumulate=k`` wraps the transformation in ``optax.MultiSteps``: k calls of ``train_step``
make one update, on the mean of their k gradients (accumulated in fp32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from flax_models.model import HybridLM


def warmup_cosine(
    learning_rate: float,
    *,
    warmup_steps: int,
    total_steps: int,
    end_fraction: float = 0.1,
) -> optax.Schedule:
    """Linear warm-up from 0 to ``learning_rate`` over ``warmup_steps``, then a cosine
    decay to ``end_fraction · learning_rate`` at ``total_steps`` (and flat after it); the
    usual language-model schedule (``optax.warmup_cosine_decay_schedule``). Steps count
    optimizer updates (with accumulation, one per ``accumulate`` micro-batches)."""
    if not 0 <= warmup_steps <= total_steps or total_steps < 1:
        raise ValueError(f"need 0 <= {warmup_steps=} <= {total_steps=} and total_steps >= 1")
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=learning_rate,
        warmup_steps=warmup_steps,
        decay_steps=total_steps,
        end_value=learning_rate * end_fraction,
    )


def default_optimizer(
    learning_rate: float | optax.Schedule = 3e-4,
    *,
    weight_decay: float = 0.1,
    b1: float = 0.9,
    b2: float = 0.95,
    clip_norm: float | None = 1.0,
    warmup_steps: int | None = None,
    total_steps: int | None = None,
) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay) after global-norm gradient clipping, the usual recipe
    for language models, with its state in fp32 whatever the parameters' dtype
    (:func:`fp32_state`).

    ``learning_rate`` is a float or an ``optax`` schedule; with ``total_steps`` (and
    ``warmup_steps``, default 0) a float becomes :func:`warmup_cosine`'s schedule peaking
    at it."""
    if total_steps is not None:
        if callable(learning_rate):
            raise ValueError("total_steps builds a schedule: pass a float learning_rate")
        learning_rate = warmup_cosine(
            learning_rate, warmup_steps=warmup_steps or 0, total_steps=total_steps
        )
    elif warmup_steps is not None:
        raise ValueError(f"{warmup_steps=} needs total_steps (the cosine decay's end)")
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
    model: HybridLM,
    tx: optax.GradientTransformation | None = None,
    *,
    trainable: nnx.filterlib.Filter = nnx.Param,
    accumulate: int = 1,
) -> nnx.Optimizer:
    """An ``nnx.Optimizer`` over the model's ``trainable`` variables (default every
    ``nnx.Param``; ``nnx.LoRAParam`` for the adapters alone); ``tx`` defaults to
    :func:`default_optimizer`.

    ``accumulate=k > 1``: ``optax.MultiSteps`` around ``tx``; each ``train_step`` adds its
    gradient to an fp32 sum and every k-th applies ``tx`` to their mean (the parameters
    change only then). Equal to one step on the k micro-batches together when each
    scores the same number of targets (the loss is a mean per micro-batch)."""
    tx = default_optimizer() if tx is None else tx
    if accumulate < 1:
        raise ValueError(f"{accumulate=} must be >= 1")
    if accumulate > 1:
        tx = fp32_state(optax.MultiSteps(tx, every_k_schedule=accumulate))
    return nnx.Optimizer(model, tx, wrt=trainable)
