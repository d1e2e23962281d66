"""Feed-forward blocks: gated SwiGLU (Bamba, Granite, Falcon-H1) or ungated relu² (Nemotron-H)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from flax_models.config import HybridConfig
from flax_models.layers.linear import linear_kwargs, scaled

# XLA's GPU dot merger turns gate(x) and up(x) into one product over the concatenated
# weights once they are small enough, as each GPU's halves of Bamba-9B's are at tp = 2. One
# kernel suits steps of few rows, which read weights and whose kernel launches bound the step;
# from about this many rows on the products compute, and the merged Triton gemm is the slower
# (five Bamba-9B layers, tp = 2, two H200s: 3.59 ms a step merged, 3.33 ms apart at 256 rows;
# 1.96 merged, 2.23 apart at one row). A barrier on up's operand keeps them apart there.
SEPARATE_GATE_UP_ROWS = 128


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
            # Past a few rows XLA's dot merger would hurt: see SEPARATE_GATE_UP_ROWS.
            rows = math.prod(x.shape[:-1])
            x_up = lax.optimization_barrier(x) if rows >= SEPARATE_GATE_UP_ROWS else x
            up = self.up(x_up)
            y = self.down(jax.nn.silu(gate) * up)
        else:
            y = self.down(jnp.square(jax.nn.relu(self.up(x))))
        return scaled(y, self.down_multiplier)
