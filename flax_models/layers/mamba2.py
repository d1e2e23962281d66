"""Mamba2 mixer (Dao & Gu, arXiv 2405.21060) over packed variable-length batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import pallas_kernels as pk
from flax_models.batch import ForwardBatch
from flax_models.cache import MambaCache
from flax_models.config import HybridConfig


class Mamba2Mixer(nnx.Module):
    """in_proj → causal conv + SiLU on xBC → SSD scan → gated RMSNorm → out_proj.

    ``A_log``, ``D`` and ``dt_bias`` stay fp32 whatever the compute dtype.
    """

    def __init__(self, cfg: HybridConfig, *, dtype: jnp.dtype, implementation: str, rngs: nnx.Rngs):
        self.cfg = cfg
        self.implementation = implementation
        H, K = cfg.mamba_num_heads, cfg.mamba_conv_kernel
        linear = dict(use_bias=cfg.mamba_proj_bias, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.in_proj = nnx.Linear(cfg.hidden_size, cfg.mamba_in_proj_dim, **linear)
        self.conv_weight = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.mamba_conv_dim, K), dtype) * K**-0.5
        )
        self.conv_bias = (
            nnx.Param(jnp.zeros((cfg.mamba_conv_dim,), dtype)) if cfg.mamba_conv_bias else None
        )
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, H + 1, dtype=jnp.float32)))
        self.D = nnx.Param(jnp.ones((H,), jnp.float32))
        self.dt_bias = nnx.Param(jnp.full((H,), -2.0, jnp.float32))
        self.norm_weight = nnx.Param(jnp.ones((cfg.mamba_d_inner,), dtype))
        self.out_proj = nnx.Linear(cfg.mamba_d_inner, cfg.hidden_size, **linear)

    def __call__(
        self, h: jax.Array, batch: ForwardBatch, cache: MambaCache
    ) -> tuple[jax.Array, MambaCache]:
        cfg, impl = self.cfg, self.implementation
        T = h.shape[0]
        H, P, N, G = (
            cfg.mamba_num_heads,
            cfg.mamba_head_dim,
            cfg.mamba_state_size,
            cfg.mamba_groups,
        )
        d_inner, conv_dim = cfg.mamba_d_inner, cfg.mamba_conv_dim

        # 1) Parallel projection: z | xBC | dt.
        zxbcdt = self.in_proj(h)
        z, xbc, dt = jnp.split(zxbcdt, [d_inner, d_inner + conv_dim], axis=-1)

        # 2) Causal depthwise conv + SiLU over x, B, C, continuing each slot's conv state.
        bias = None if self.conv_bias is None else self.conv_bias[...]
        xbc, conv_state = pk.causal_conv1d(
            xbc,
            self.conv_weight[...],
            bias,
            query_start_loc=batch.query_start_loc,
            conv_state_cache=cache.conv_state,
            slot_ids=batch.slot_ids,
            has_initial_state=batch.has_initial_state,
            activation="silu",
            implementation=impl,
        )
        x, B, C = jnp.split(xbc, [d_inner, d_inner + G * N], axis=-1)

        # 3) Chunk-aligned SSD scan from each sequence's cached state.
        slots = jnp.maximum(batch.slot_ids, 0)
        initial = jnp.where(
            batch.has_initial_state[:, None, None, None],
            cache.ssm_state[slots].astype(jnp.float32),
            0.0,
        )
        y, final = pk.ssd_scan(
            x.reshape(T, H, P),
            dt,
            -jnp.exp(self.A_log[...].astype(jnp.float32)),
            B.reshape(T, G, N),
            C.reshape(T, G, N),
            metadata=batch.chunks,
            chunk_size=cfg.mamba_chunk_size,
            D=self.D[...],
            dt_bias=self.dt_bias[...],
            dt_softplus=True,
            dt_limit=cfg.time_step_limit,
            initial_states=initial,
            state_dtype=cache.ssm_state.dtype,
            implementation=impl,
        )
        num_slots = cache.ssm_state.shape[0]
        ssm_state = cache.ssm_state.at[
            jnp.where(batch.slot_ids >= 0, batch.slot_ids, num_slots)
        ].set(final, mode="drop")

        # 4) Gated grouped RMSNorm (groups of d_inner / G), then the output projection.
        y = pk.gated_rms_norm(
            y.reshape(T, d_inner),
            z,
            self.norm_weight[...],
            group_size=d_inner // G,
            eps=cfg.norm_eps,
            implementation=impl,
        )
        return self.out_proj(y), MambaCache(conv_state=conv_state, ssm_state=ssm_state)
