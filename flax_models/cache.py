"""Slot-indexed caches in the layout the kernels use.

Per Mamba2 layer: the conv state ``[S, K−1, conv_dim]`` (last K−1 inputs, oldest first)
and the SSM state ``[S, H, P, N]`` (fp32 by default); per attention layer the K/V caches,
contiguous ``[S, max_len, Hkv, D]`` or, for the engine, a pool of pages
``[num_blocks, block_size, Hkv, D]`` that block tables index
(``flax_models.serving.prefix_cache``); per parallel layer (Falcon-H1's ``P``) both, in a
``ParallelCache``. MLP-only layers have none. With prefix caching each Mamba2 layer also
keeps a snapshot pool, ``[Q, K−1, conv_dim]`` and ``[Q, H, P, N]``: the states at the ends
of published blocks, restored into a slot when a prompt starts from that prefix. The whole
cache is one pytree returned from every step, so its buffers can be donated and updated in
place. With a mesh (``flax_models.sharding``) the caches are split over ``"tp"`` as the
mixers' heads are: conv channels in the tp-major layout, SSM heads, KV heads (copies of one
KV head per device when tp > num_kv_heads); the engine's caches on a mesh with a ``"dp"``
axis are also split over dp on their leading axis (``groups``: slots, pages and snapshot
entries in dp equal groups, each held by its group's devices).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from flax_models.config import HybridConfig
from flax_models.sharding import TP, dp_size, local_config, split_groups, tp_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MambaCache:
    conv_state: jax.Array  # [S, K-1, conv_dim]
    ssm_state: jax.Array  # [S, H, P, N]
    snapshot_conv: jax.Array | None = None  # [Q, K-1, conv_dim], prefix caching only
    snapshot_ssm: jax.Array | None = None  # [Q, H, P, N]

    @property
    def has_snapshots(self) -> bool:
        return self.snapshot_ssm is not None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionCache:
    k: jax.Array  # [S, max_len, Hkv, D], or pages [num_blocks, block_size, Hkv, D]
    v: jax.Array  # the same shape


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
    num_blocks: int | None = None,
    block_size: int | None = None,
    num_snapshots: int = 0,
    groups: int = 1,
) -> tuple[LayerCache, ...]:
    """Zero caches for every layer (``None`` for MLP-only layers); with ``mesh``, created
    straight into their shards over ``"tp"``.

    ``groups > 1`` (the engine on a mesh with ``"dp"`` of that size): slots, pages and
    snapshot entries are split over ``"dp"`` in ``groups`` equal, contiguous groups.

    ``num_blocks`` and ``block_size`` given: the attention caches are page pools
    ``[num_blocks, block_size, Hkv, D]`` (``max_len`` then bounds nothing here).
    ``num_snapshots > 0``: each Mamba2 layer gets a snapshot pool of that many entries.
    """
    tp = tp_size(mesh)
    if groups > 1:
        if groups != dp_size(mesh):
            raise ValueError(f"{groups=} needs a mesh with dp={groups}")
        for name, rows in (("num_slots", num_slots), ("num_blocks", num_blocks)):
            if rows is not None and rows % groups:
                raise ValueError(f"{name}={rows} must be divisible by {groups=}")
        if num_snapshots % groups:
            raise ValueError(f"{num_snapshots=} must be divisible by {groups=}")
    local = local_config(cfg, tp)
    # tp-major layouts: each device's conv channels and (possibly copied) KV heads.
    conv_dim, kv_heads = tp * local.mamba_conv_dim, tp * local.num_kv_heads

    if (num_blocks is None) != (block_size is None):
        raise ValueError(f"give both or neither of {num_blocks=} and {block_size=}")

    def mamba() -> MambaCache:
        conv = (cfg.mamba_conv_kernel - 1, conv_dim)
        ssm = (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_size)
        snapshots = {}
        if num_snapshots:
            snapshots = dict(
                snapshot_conv=jnp.zeros((num_snapshots, *conv), dtype),
                snapshot_ssm=jnp.zeros((num_snapshots, *ssm), ssm_dtype),
            )
        return MambaCache(
            conv_state=jnp.zeros((num_slots, *conv), dtype),
            ssm_state=jnp.zeros((num_slots, *ssm), ssm_dtype),
            **snapshots,
        )

    def attention() -> AttentionCache:
        rows, length = (num_slots, max_len) if num_blocks is None else (num_blocks, block_size)
        shape = (rows, length, kv_heads, cfg.head_dim)
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
        cache_specs(cfg, snapshots=num_snapshots > 0, groups=groups),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )
    return jax.jit(create, out_shardings=shardings)()


def restore_snapshots(
    caches: tuple[LayerCache, ...], slot_ids: jax.Array, snapshot_ids: jax.Array
) -> tuple[LayerCache, ...]:
    """Copies snapshot ``snapshot_ids[b]`` into slot ``slot_ids[b]`` of every Mamba2 layer's
    conv and SSM states (jittable; ``snapshot_ids[b] < 0`` or a padding slot copies
    nothing). Caches without snapshot pools come back unchanged."""

    def restore(cache: MambaCache) -> MambaCache:
        if not cache.has_snapshots:
            return cache
        dst = jnp.where((snapshot_ids >= 0) & (slot_ids >= 0), slot_ids, -1)
        src = jnp.clip(snapshot_ids, 0, cache.snapshot_ssm.shape[0] - 1)
        return dataclasses.replace(
            cache,
            conv_state=pk.slots.scatter_states(cache.conv_state, cache.snapshot_conv[src], dst),
            ssm_state=pk.slots.scatter_states(cache.ssm_state, cache.snapshot_ssm[src], dst),
        )

    def layer(cache: LayerCache) -> LayerCache:
        if isinstance(cache, MambaCache):
            return restore(cache)
        if isinstance(cache, ParallelCache):
            return dataclasses.replace(cache, mamba=restore(cache.mamba))
        return cache

    return tuple(layer(cache) for cache in caches)


# Caches are split as the mixers' heads: conv channels (tp-major x | B | C), SSM heads, KV
# heads (copies of one KV head per device when tp > num_kv_heads).
# Page pools [num_blocks, block_size, Hkv, D] split over Hkv like the slot layout; snapshot
# pools like the slot states they are copies of.
MAMBA_CACHE_SPEC = MambaCache(conv_state=P(None, None, TP), ssm_state=P(None, TP))
MAMBA_SNAPSHOT_CACHE_SPEC = MambaCache(
    conv_state=P(None, None, TP),
    ssm_state=P(None, TP),
    snapshot_conv=P(None, None, TP),
    snapshot_ssm=P(None, TP),
)
ATTENTION_CACHE_SPEC = AttentionCache(k=P(None, None, TP), v=P(None, None, TP))


def mamba_cache_spec(cache: MambaCache) -> MambaCache:
    """The spec tree of one Mamba2 layer's cache, with or without its snapshot pool."""
    return MAMBA_SNAPSHOT_CACHE_SPEC if cache.has_snapshots else MAMBA_CACHE_SPEC


def cache_specs(
    cfg: HybridConfig, *, snapshots: bool = False, groups: int = 1
) -> tuple[LayerCache, ...]:
    """The ``PartitionSpec`` of every cache array, in ``init_cache``'s tree (``snapshots``:
    the Mamba2 layers carry snapshot pools; ``groups > 1``: the leading axis, slots, pages
    or snapshot entries, is split over ``"dp"``)."""
    mamba = MAMBA_SNAPSHOT_CACHE_SPEC if snapshots else MAMBA_CACHE_SPEC
    specs = {
        "M": mamba,
        "*": ATTENTION_CACHE_SPEC,
        "P": ParallelCache(mamba=mamba, attention=ATTENTION_CACHE_SPEC),
    }
    specs = tuple(specs.get(kind) for kind in cfg.layer_pattern)
    return split_groups(specs) if groups > 1 else specs
