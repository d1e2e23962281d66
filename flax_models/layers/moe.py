"""Mixture of experts: a router picks k of E experts per token, the experts run as two
grouped matmuls over the token copies sorted by expert, and their outputs are summed with
the router weights in fp32, plus an optional always-on shared expert.

Routers (``HybridConfig.moe_router``; one function each, in ``ROUTERS``):

- ``softmax`` (GraniteMoeHybrid, Mixtral style): top-k of the router logits; the weights are
  the softmax over those k (= the softmax probabilities renormalised over the k), or with
  ``norm_topk_prob=False`` the plain softmax probabilities of the k.
- ``sigmoid`` (DeepSeek-V3 style, Nemotron-H): scores ``s = sigmoid(logits)``; experts are
  chosen on ``s + score_correction_bias`` (the bias steers selection only): with
  ``topk_group < n_group``, the ``topk_group`` groups whose two best biased scores sum
  highest, then the top k inside them. The weights are the unbiased ``s`` of the chosen,
  renormalised (``norm_topk_prob``) and scaled by ``routed_scaling_factor``.

Experts (``moe_activation``): ``silu`` ``down(silu(gate) · up)`` with gate|up fused in one
``[E, K, 2I]`` weight (Granite), or ``relu2`` ``down(relu(up)²)`` without a gate (Nemotron-H).

Dispatch, e.g. T = 3 tokens, k = 2, E = 3 experts (rows of the flat ids are ``t * k + j``)::

    expert ids        [[2, 0], [0, 1], [2, 1]]  → flat [2, 0, 0, 1, 2, 1]
    order             argsort(flat, stable)     = [1, 2, 3, 5, 0, 4]
    sorted ids        flat[order]               = [0, 0, 1, 1, 2, 2]
    group_sizes       bincount(flat, length=E)  = [2, 2, 2]
    token of row      order // k                = [0, 1, 1, 2, 0, 2]

``y_sorted = grouped_matmul(act(grouped_matmul(x[order // k], up)), down)``; unsorting puts
row i back at flat position ``order[i]``, and ``out[t] = Σ_j w[t, j] · y[t * k + j]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from flax_models.config import HybridConfig
from flax_models.layers.mlp import MLP
from flax_models.sharding import psum_tp, shard_call

Router = Callable[[jax.Array, jax.Array | None, HybridConfig], tuple[jax.Array, jax.Array]]


def softmax_topk(
    logits: jax.Array, bias: jax.Array | None, cfg: HybridConfig
) -> tuple[jax.Array, jax.Array]:
    """logits[T, E] (fp32) → weights[T, k] (fp32), expert ids[T, k]."""
    del bias  # the softmax router has none
    top_logits, ids = jax.lax.top_k(logits, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:  # softmax over the chosen k = the k probabilities renormalised
        weights = jax.nn.softmax(top_logits, axis=-1)
    else:
        weights = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), ids, axis=-1)
    return weights * cfg.routed_scaling_factor, ids


def sigmoid_grouped_topk(
    logits: jax.Array, bias: jax.Array | None, cfg: HybridConfig
) -> tuple[jax.Array, jax.Array]:
    """logits[T, E] (fp32), bias[E] (selection only) → weights[T, k] (fp32), expert ids[T, k]."""
    scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias
    if cfg.topk_group < cfg.n_group:  # group-limited: keep the best topk_group groups
        T, E = logits.shape
        grouped = choice.reshape(T, cfg.n_group, E // cfg.n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, n_group]
        _, kept = jax.lax.top_k(group_scores, cfg.topk_group)  # [T, topk_group]
        kept_mask = jnp.any(kept[:, :, None] == jnp.arange(cfg.n_group), axis=1)  # [T, n_group]
        in_kept_group = jnp.repeat(kept_mask, E // cfg.n_group, axis=-1)  # [T, E]
        choice = jnp.where(in_kept_group, choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


ROUTERS: dict[str, Router] = {"softmax": softmax_topk, "sigmoid": sigmoid_grouped_topk}


def _swiglu(h: jax.Array) -> jax.Array:  # h[M, 2I] gate | up → [M, I]
    gate, up = jnp.split(h, 2, axis=-1)
    return jax.nn.silu(gate) * up


def _relu2(h: jax.Array) -> jax.Array:  # h[M, I]
    return jnp.square(jax.nn.relu(h))


# activation → (function on the up projection's output, up width in units of I)
_EXPERT_ACTIVATIONS: dict[str, tuple[Callable[[jax.Array], jax.Array], int]] = {
    "silu": (_swiglu, 2),
    "relu2": (_relu2, 1),
}


def _shared_expert_config(cfg: HybridConfig) -> HybridConfig:
    """The shared expert is an ``MLP`` of its own width with the routed experts' activation."""
    return dataclasses.replace(
        cfg,
        intermediate_size=cfg.shared_expert_intermediate_size,
        mlp_activation=cfg.moe_activation,
    )


class RouterBias(nnx.Variable):
    """The sigmoid router's score-correction bias: set by load balancing, not by gradients
    (a buffer in transformers), so it is not an ``nnx.Param`` that ``nnx.grad`` or an
    optimizer would touch."""


class MoE(nnx.Module):
    """Router → experts on the token copies sorted by expert → weighted sum (+ shared expert).

    Parameters (E experts, K hidden, I expert width):
      router: ``nnx.Linear`` [K, E], evaluated in fp32 whatever the model dtype.
      score_correction_bias: ``RouterBias`` [E] fp32 (sigmoid router only;
        ``e_score_correction_bias``).
      experts_up: [E, K, 2I] gate|up (gated experts) or [E, K, I].
      experts_down: [E, I, K].
      shared_expert: an ``MLP`` of width ``shared_expert_intermediate_size`` and the experts'
        activation, or None.
    """

    def __init__(
        self,
        cfg: HybridConfig,
        *,
        dtype: jnp.dtype,
        implementation: str | tuple[str, ...],
        rngs: nnx.Rngs,
        mesh: Mesh | None = None,
    ):
        self.cfg = cfg
        self.dtype = dtype
        self.implementation = implementation
        self.mesh = mesh
        self.route = ROUTERS[cfg.moe_router]
        self.activation, up_factor = _EXPERT_ACTIVATIONS[cfg.moe_activation]
        E, K, inner = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        # Routing in fp32: near-ties must not flip with the compute dtype.
        self.router = nnx.Linear(
            K,
            E,
            use_bias=False,
            dtype=jnp.float32,
            param_dtype=dtype,
            precision=pk.matmul_precision(jnp.float32),
            rngs=rngs,
        )
        self.score_correction_bias = (
            RouterBias(jnp.zeros((E,), jnp.float32)) if cfg.moe_router == "sigmoid" else None
        )
        self.experts_up = nnx.Param(
            jax.random.normal(rngs.params(), (E, K, up_factor * inner), dtype) * K**-0.5
        )
        self.experts_down = nnx.Param(
            jax.random.normal(rngs.params(), (E, inner, K), dtype) * inner**-0.5
        )
        self.shared_expert = (
            MLP(_shared_expert_config(cfg), dtype=dtype, rngs=rngs)
            if cfg.shared_expert_intermediate_size
            else None
        )

    def __call__(self, x: jax.Array, *, groups: int = 1) -> jax.Array:  # x[T, K] → [T, K]
        """``groups > 1``: x holds a grouped batch's tokens (``ForwardBatch.groups``), whose
        rows stay split over ``"dp"`` (each group routes its own tokens)."""
        if self.mesh is None:
            out = self._routed(x)
        else:  # expert widths split over tp: every device routes, sums its partial outputs
            out = shard_call(
                self,
                lambda local, x: psum_tp(local._routed(x), local.implementation, self.mesh),
                (x,),
                (P(),),
                P(),
                groups=groups,
            )
        if self.shared_expert is not None:  # an MLP: column/row parallel through XLA
            out = out + self.shared_expert(x)
        return out

    def _routed(self, x: jax.Array) -> jax.Array:
        """The routed experts' weighted sum [T, K] (no shared expert)."""
        cfg, impl = self.cfg, self.implementation
        T, k = x.shape[0], cfg.num_experts_per_tok
        # 1) Route: weights[T, k] (fp32) and expert ids[T, k].
        bias = None if self.score_correction_bias is None else self.score_correction_bias[...]
        weights, ids = self.route(self.router(x), bias, cfg)

        # 2) Sort the T·k token copies by expert; group_sizes has the static length E.
        flat_ids = ids.reshape(-1)
        order = jnp.argsort(flat_ids, stable=True)
        group_sizes = jnp.bincount(flat_ids, length=cfg.num_experts).astype(jnp.int32)

        # 3) Experts: two grouped matmuls over the sorted rows.
        h = pk.grouped_matmul(x[order // k], self.experts_up[...], group_sizes, implementation=impl)
        y = pk.grouped_matmul(
            self.activation(h), self.experts_down[...], group_sizes, implementation=impl
        )

        # 4) Unsort (row i goes back to flat position order[i]) and combine in fp32.
        unsort = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
        y = y[unsort].reshape(T, k, -1).astype(jnp.float32)
        return jnp.sum(y * weights[:, :, None], axis=1).astype(x.dtype)
