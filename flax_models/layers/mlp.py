"""Feed-forward blocks: gated SwiGLU (Bamba, Granite) or ungated relu² (Nemotron-H)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flax_models.config import HybridConfig
from flax_models.layers.linear import linear_kwargs


class MLP(nnx.Module):
    """``down(silu(gate(x)) · up(x))`` or ``down(relu(up(x))²)``."""

    def __init__(self, cfg: HybridConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.activation = cfg.mlp_activation
        linear = linear_kwargs(use_bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        if self.activation == "silu":
            self.gate = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, **linear)
        self.up = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, **linear)
        self.down = nnx.Linear(cfg.intermediate_size, cfg.hidden_size, **linear)

    def __call__(self, x: jax.Array) -> jax.Array:  # x[T, D]
        if self.activation == "silu":
            return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
        return self.down(jnp.square(jax.nn.relu(self.up(x))))
