"""Layers of the hybrid models: one module per concept."""

from flax_models.layers.attention import Attention
from flax_models.layers.mamba2 import Mamba2Mixer
from flax_models.layers.mlp import MLP
from flax_models.layers.moe import MoE
from flax_models.layers.norm import RMSNorm
from flax_models.layers.parallel import ParallelHybridMixer

__all__ = ["MLP", "Attention", "Mamba2Mixer", "MoE", "ParallelHybridMixer", "RMSNorm"]
