"""Grouped-query attention over the slot-indexed or paged KV cache, with full, partial or no
RoPE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from flax_models.batch import ForwardBatch
from flax_models.cache import ATTENTION_CACHE_SPEC as CACHE_SPEC
from flax_models.cache import AttentionCache
from flax_models.config import HybridConfig
from flax_models.layers.linear import Linear, linear_kwargs, matmul, scaled
from flax_models.sharding import psum_tp, shard_call


def apply_rope(x: jax.Array, positions: jax.Array, *, rotary_dim: int, theta: float) -> jax.Array:
    """Rotate-half RoPE on the first ``rotary_dim`` features of x[T, heads, D]."""
    half = rotary_dim // 2
    inv_freq = 1.0 / theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2, rest = xf[..., :half], xf[..., half:rotary_dim], xf[..., rotary_dim:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return rotated.astype(x.dtype)


class Attention(nnx.Module):
    """q/k/v projections → RoPE → write this step's K/V → masked-tail attention → o_proj.

    Falcon-H1's µP multipliers scale the input (``attention_in_multiplier``), the output
    (``attention_out_multiplier``) and the keys (``key_multiplier``, folded into
    ``cfg.scale``); all are 1 in the other families.

    With a ``mesh`` the query heads are split over ``"tp"`` (KV heads too, or copied when
    fewer than tp): attention runs on each device's heads under ``shard_map`` and
    ``o_proj`` sums the partial products over tp.
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
        linear = linear_kwargs(use_bias=cfg.attention_bias, dtype=dtype, rngs=rngs)
        D = cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * D, **linear)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * D, **linear)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * D, **linear)
        self.o_proj = Linear(cfg.num_heads * D, cfg.hidden_size, **linear)

    def __call__(
        self, h: jax.Array, batch: ForwardBatch, cache: AttentionCache
    ) -> tuple[jax.Array, AttentionCache]:
        cfg = self.cfg
        if self.mesh is None:
            out, cache = self._attend(h, batch, cache)
            return scaled(self.o_proj(out), cfg.attention_out_multiplier), cache

        def body(local, h, batch, cache):
            out, cache = local._attend(h, batch, cache)
            kernel = local.o_proj.kernel[...]
            part = matmul(out, kernel, precision=local.o_proj.precision)
            return psum_tp(part, local.implementation, self.mesh), cache

        out, cache = shard_call(
            self, body, (h, batch, cache), (P(), P(), CACHE_SPEC), (P(), CACHE_SPEC)
        )
        if self.o_proj.bias is not None:
            out = out + self.o_proj.bias[...]
        return scaled(out.astype(h.dtype), cfg.attention_out_multiplier), cache

    def _attend(
        self, h: jax.Array, batch: ForwardBatch, cache: AttentionCache
    ) -> tuple[jax.Array, AttentionCache]:
        """Everything before o_proj: the attention output [T, num_heads · head_dim]."""
        cfg, impl = self.cfg, self.implementation
        T, D = h.shape[0], cfg.head_dim
        h = scaled(h, cfg.attention_in_multiplier)
        q = self.q_proj(h).reshape(T, cfg.num_heads, D)
        k = self.k_proj(h).reshape(T, cfg.num_kv_heads, D)
        v = self.v_proj(h).reshape(T, cfg.num_kv_heads, D)
        if cfg.rotary_dim:
            q = apply_rope(q, batch.positions, rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta)
            k = apply_rope(k, batch.positions, rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta)
        k_cache, v_cache = pk.write_kv(
            cache.k,
            cache.v,
            k,
            v,
            query_start_loc=batch.query_start_loc,
            kv_lens=batch.kv_lens,
            slot_ids=batch.slot_ids,
            block_table=batch.block_table,
            implementation=impl,
        )
        out = pk.masked_tail_attention(
            q,
            k_cache,
            v_cache,
            query_start_loc=batch.query_start_loc,
            kv_lens=batch.kv_lens,
            slot_ids=batch.slot_ids,
            block_table=batch.block_table,
            causal=True,
            sm_scale=cfg.scale,
            implementation=impl,
        )
        return out.reshape(T, cfg.num_heads * D), AttentionCache(k=k_cache, v=v_cache)
