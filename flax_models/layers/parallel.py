"""Falcon-H1's parallel hybrid mixer (layer pattern letter ``P``): attention and a Mamba2
mixer side by side.

Both read the same normed input and their outputs are summed into the residual::

    out = mamba(x) · ssm_out + attention(x · attn_in) · attn_out

(the µP multipliers are the mixers' own, from ``HybridConfig``: ``mamba_out_multiplier``,
``attention_in_multiplier``, ``attention_out_multiplier``). The block around it is the
ordinary one: ``x + out``, then with ``mlp_per_layer`` ``x + mlp(mlp_norm(x))``, which is
Falcon-H1's ``input_layernorm`` → (mamba ∥ self_attn) → ``pre_ff_layernorm`` →
``feed_forward``. The layer's state is a ``ParallelCache``: the Mamba2 conv/SSM state and
the KV cache of the same slot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from flax_models.batch import ForwardBatch
from flax_models.cache import ParallelCache
from flax_models.config import HybridConfig
from flax_models.layers.attention import Attention
from flax_models.layers.mamba2 import Mamba2Mixer


class ParallelHybridMixer(nnx.Module):
    """Mamba2 mixer ∥ attention on the same input, outputs summed."""

    def __init__(
        self,
        cfg: HybridConfig,
        *,
        dtype: jnp.dtype,
        implementation: str | tuple[str, ...],
        rngs: nnx.Rngs,
        mesh: Mesh | None = None,
    ):
        self.implementation = implementation
        options = dict(dtype=dtype, implementation=implementation, rngs=rngs, mesh=mesh)
        self.mamba = Mamba2Mixer(cfg, **options)
        self.attention = Attention(cfg, **options)

    def __call__(
        self, h: jax.Array, batch: ForwardBatch, cache: ParallelCache
    ) -> tuple[jax.Array, ParallelCache]:
        ssm_out, mamba_cache = self.mamba(h, batch, cache.mamba)
        attention_out, attention_cache = self.attention(h, batch, cache.attention)
        return ssm_out + attention_out, ParallelCache(mamba=mamba_cache, attention=attention_cache)
