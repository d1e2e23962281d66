"""Slot-indexed caches in the layout the kernels use.

Per Mamba2 layer: the conv state ``[S, K−1, conv_dim]`` (last K−1 inputs, oldest first)
and the SSM state ``[S, H, P, N]`` (fp32 by default); per attention layer the K/V caches
``[S, max_len, Hkv, D]``; per parallel layer (Falcon-H1's ``P``) both, in a
``ParallelCache``. MLP-only layers have none. The whole cache is one pytree returned from
every step, so its buffers can be donated and updated in place. With a mesh
(``flax_models.sharding``) the caches are split over ``"tp"`` as the mixers' heads are:
conv channels in the tp-major layout, SSM heads, KV heads (copies of one KV head per
device when tp > num_kv_heads).
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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ParallelCache:
    """A parallel layer's states: its Mamba2 mixer's and its attention's, side by side."""

    mamba: MambaCache
    attention: AttentionCache


LayerCache = MambaCache | AttentionCache | ParallelCache | None


def init_cache(
    cfg: HybridConfig,
    *,
    num_slots: int,
    max_len: int,
    dtype: jnp.dtype = jnp.float32,
    ssm_dtype: jnp.dtype = jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[LayerCache, ...]:
    """Zero caches for every layer (``None`` for MLP-only layers); with ``mesh``, created
    straight into their shards over ``"tp"``."""
    from flax_models.sharding import cache_specs, local_config, tp_size

    tp = tp_size(mesh)
    local = local_config(cfg, tp)
    # tp-major layouts: each device's conv channels and (possibly copied) KV heads.
    conv_dim, kv_heads = tp * local.mamba_conv_dim, tp * local.num_kv_heads

    def mamba() -> MambaCache:
        return MambaCache(
            conv_state=jnp.zeros((num_slots, cfg.mamba_conv_kernel - 1, conv_dim), dtype),
            ssm_state=jnp.zeros(
                (num_slots, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_size),
                ssm_dtype,
            ),
        )

    def attention() -> AttentionCache:
        shape = (num_slots, max_len, kv_heads, cfg.head_dim)
        return AttentionCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))

    def create() -> tuple[LayerCache, ...]:
        caches: list[LayerCache] = []
        for kind in cfg.layer_pattern:
            if kind == "M":
                caches.append(mamba())
            elif kind == "*":
                caches.append(attention())
            elif kind == "P":
                caches.append(ParallelCache(mamba=mamba(), attention=attention()))
            else:
                caches.append(None)
        return tuple(caches)

    if mesh is None:
        return create()
    shardings = jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(mesh, spec),
        cache_specs(cfg),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )
    return jax.jit(create, out_shardings=shardings)()
