"""Feed-forward blocks: gated SwiGLU (Bamba, Granite, Falcon-H1) or ungated relu² (Nemotron-H)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flax_models.config import HybridConfig
from flax_models.layers.linear import linear_kwargs, scaled


class MLP(nnx.Module):
    """``down(silu(gate(x)) · up(x))`` or ``down(relu(up(x))²)``; with Falcon-H1's µP
    multipliers ``down(silu(gate(x) · g) · up(x)) · d`` (``mlp_gate_multiplier`` g,
    ``mlp_down_multiplier`` d, both 1 elsewhere)."""

    def __init__(self, cfg: HybridConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.activation = cfg.mlp_activation
        self.gate_multiplier = cfg.mlp_gate_multiplier
        self.down_multiplier = cfg.mlp_down_multiplier
        linear = linear_kwargs(use_bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        if self.activation == "silu":
            self.gate = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, **linear)
        self.up = nnx.Linear(cfg.hidden_size, cfg.intermediate_size, **linear)
        self.down = nnx.Linear(cfg.intermediate_size, cfg.hidden_size, **linear)

    def __call__(self, x: jax.Array) -> jax.Array:  # x[T, D]
        if self.activation == "silu":
            gate = scaled(self.gate(x), self.gate_multiplier)
            y = self.down(jax.nn.silu(gate) * self.up(x))
        else:
            y = self.down(jnp.square(jax.nn.relu(self.up(x))))
        return scaled(y, self.down_multiplier)
