"""One optimizer step: the loss's gradient with respect to the optimizer's variables, then
``nnx.Optimizer.update``, jitted with the model and optimizer donated (updated in place).

Activation memory is set by the model's ``remat`` (``HybridLM(..., remat="block")``, or
``model.remat = "block"`` on a loaded checkpoint).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flax_models.model import HybridLM
from flax_models.training.losses import LossFn, loss_fn


def _train_step(
    model: HybridLM, optimizer: nnx.Optimizer, batch: tuple[jax.Array, ...], loss: LossFn
) -> jax.Array:
    # Gradients of the variables the optimizer updates only (its ``wrt``): with LoRA's
    # nnx.LoRAParam no weight gradient of the frozen base is computed.
    grad_fn = nnx.value_and_grad(loss, argnums=nnx.DiffState(0, optimizer.wrt))
    value, grads = grad_fn(model, *batch)
    optimizer.update(model, grads)
    return value


_train_step_jit = nnx.jit(_train_step, donate_argnums=(0, 1), static_argnames="loss")


def train_step(
    model: HybridLM, optimizer: nnx.Optimizer, *batch: jax.Array, loss: LossFn = loss_fn
) -> jax.Array:
    """One optimizer step on ``loss(model, *batch)``: the loss before the update, fp32.

    ``batch`` defaults to :func:`~flax_models.training.loss_fn`'s ``input_ids[B, L]`` and
    optional ``labels[B, L]``; for packed sequences pass ``tokens[T], query_start_loc[B +
    1]`` (and ``labels[T]``; a ``PackedBatch`` unpacked) with
    ``loss=packed_loss(max_len)``. ``loss`` is a static argument: make it once and pass
    the same object to every step (a ``functools.partial`` compares by identity, so a new
    one compiles again; ``packed_loss`` caches them). ``model`` and ``optimizer`` (from
    ``make_optimizer``, over the same model) are updated in place; the step is jitted (one
    compilation per loss and batch shape) with their buffers donated, so parameters and
    optimizer state are not held twice.
    """
    return _train_step_jit(model, optimizer, tuple(jnp.asarray(a) for a in batch), loss=loss)
