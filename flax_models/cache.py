"""Slot-indexed caches in the layout the kernels use.

Per Mamba2 layer: the conv state ``[S, K−1, conv_dim]`` (last K−1 inputs, oldest first)
and the SSM state ``[S, H, P, N]`` (fp32 by default); per attention layer the K/V caches
``[S, max_len, Hkv, D]``. MLP-only layers have none. The whole cache is one pytree
returned from every step, so its buffers can be donated and updated in place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flax_models.config import HybridConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MambaCache:
    conv_state: jax.Array  # [S, K-1, conv_dim]
    ssm_state: jax.Array  # [S, H, P, N]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionCache:
    k: jax.Array  # [S, max_len, Hkv, D]
    v: jax.Array  # [S, max_len, Hkv, D]


LayerCache = MambaCache | AttentionCache | None


def init_cache(
    cfg: HybridConfig,
    *,
    num_slots: int,
    max_len: int,
    dtype: jnp.dtype = jnp.float32,
    ssm_dtype: jnp.dtype = jnp.float32,
) -> tuple[LayerCache, ...]:
    """Zero caches for every layer (``None`` for MLP-only layers)."""
    caches: list[LayerCache] = []
    for kind in cfg.layer_pattern:
        if kind == "M":
            caches.append(
                MambaCache(
                    conv_state=jnp.zeros(
                        (num_slots, cfg.mamba_conv_kernel - 1, cfg.mamba_conv_dim), dtype
                    ),
                    ssm_state=jnp.zeros(
                        (num_slots, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_size),
                        ssm_dtype,
                    ),
                )
            )
        elif kind == "*":
            shape = (num_slots, max_len, cfg.num_kv_heads, cfg.head_dim)
            caches.append(AttentionCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype)))
        else:
            caches.append(None)
    return tuple(caches)
