"""``HybridLM``: embeddings, a stack of blocks following the layer pattern, final norm, head.

A block is ``x + mixer(norm(x))`` with the mixer a Mamba2 mixer (``M``), attention (``*``)
or an MLP (``-``); with ``mlp_per_layer`` (Bamba, Granite) a mixer block is followed by
``x + mlp(mlp_norm(x))``. Residual branches are scaled by ``residual_multiplier`` (Granite;
1 elsewhere). Every layer runs on the packed kernel API: ``forward`` takes packed tokens, a
``ForwardBatch`` and slot-indexed caches (the serving path), ``__call__`` wraps a dense
``[B, L]`` batch into that form (research and tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels as pk
from flax_models.batch import ForwardBatch, make_forward_batch
from flax_models.cache import LayerCache, init_cache
from flax_models.config import HybridConfig
from flax_models.layers import MLP, Attention, Mamba2Mixer, RMSNorm
from flax_models.layers.linear import linear_kwargs


class Block(nnx.Module):
    """One residual block of the layer pattern."""

    def __init__(
        self, cfg: HybridConfig, kind: str, *, dtype: jnp.dtype, implementation: str, rngs: nnx.Rngs
    ):
        self.kind = kind
        self.residual_multiplier = cfg.residual_multiplier
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype)
        mixers = {"M": Mamba2Mixer, "*": Attention}
        if kind == "-":
            self.mixer = MLP(cfg, dtype=dtype, rngs=rngs)
        else:
            self.mixer = mixers[kind](cfg, dtype=dtype, implementation=implementation, rngs=rngs)
        has_mlp = cfg.mlp_per_layer and kind != "-"
        self.mlp_norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype) if has_mlp else None
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs) if has_mlp else None

    def __call__(
        self, h: jax.Array, batch: ForwardBatch, cache: LayerCache
    ) -> tuple[jax.Array, LayerCache]:
        if self.kind == "-":  # an MLP block carries no state
            out = self.mixer(self.norm(h))
        else:
            out, cache = self.mixer(self.norm(h), batch, cache)
        h = h + out * self.residual_multiplier
        if self.mlp is not None:
            h = h + self.mlp(self.mlp_norm(h)) * self.residual_multiplier
        return h, cache


class HybridLM(nnx.Module):
    """Hybrid Mamba2/attention causal language model."""

    def __init__(
        self,
        cfg: HybridConfig,
        *,
        dtype: jnp.dtype = jnp.float32,
        implementation: str = "auto",
        rngs: nnx.Rngs,
    ):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.implementation = implementation
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs
        )
        self.layers = nnx.List(
            [
                Block(cfg, kind, dtype=dtype, implementation=implementation, rngs=rngs)
                for kind in cfg.layer_pattern
            ]
        )
        self.final_norm = RMSNorm(cfg.hidden_size, eps=cfg.norm_eps, dtype=dtype)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nnx.Linear(
                cfg.hidden_size,
                cfg.vocab_size,
                **linear_kwargs(use_bias=False, dtype=dtype, rngs=rngs),
            )
        )

    def forward(
        self,
        tokens: jax.Array,
        batch: ForwardBatch,
        caches: tuple[LayerCache, ...],
        *,
        logits_rows: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[LayerCache, ...]]:
        """Packed tokens[T] → (logits[T, V] in fp32, updated caches); with
        ``logits_rows[R]`` only those rows' logits, ``[R, V]`` (a serving step needs each
        sequence's last token, not T × V logits)."""
        h = self.embed(tokens) * jnp.asarray(self.cfg.embedding_multiplier, self.dtype)
        new_caches = []
        for layer, cache in zip(self.layers, caches, strict=True):
            h, cache = layer(h, batch, cache)
            new_caches.append(cache)
        if logits_rows is not None:
            h = h[logits_rows]
        h = self.final_norm(h)
        if self.lm_head is None:  # tied: the embedding table is the head
            table = self.embed.embedding[...]
            logits = jnp.dot(h, table.T, precision=pk.matmul_precision(table.dtype))
        else:
            logits = self.lm_head(h)
        return logits.astype(jnp.float32) / self.cfg.logits_scaling, tuple(new_caches)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """input_ids[B, L] → logits[B, L, V] (fp32), every row a fresh sequence."""
        num_seqs, length = input_ids.shape
        batch = make_forward_batch(
            jnp.arange(num_seqs + 1, dtype=jnp.int32) * length,
            jnp.zeros((num_seqs,), jnp.int32),
            jnp.arange(num_seqs, dtype=jnp.int32),
            num_tokens=num_seqs * length,
            chunk_size=self.cfg.mamba_chunk_size,
        )
        caches = init_cache(self.cfg, num_slots=num_seqs, max_len=length, dtype=self.dtype)
        logits, _ = self.forward(input_ids.reshape(-1), batch, caches)
        return logits.reshape(num_seqs, length, -1)
