"""Flax NNX hybrid Mamba2/attention models built on ``pallas_kernels``.

``HybridConfig`` describes a model, ``HybridLM`` is the model (``model(input_ids[B, L])``
gives logits), ``load_hf_checkpoint`` reads a Hugging Face directory, and ``Engine`` serves
variable-length requests through static-shape buckets.
"""

from flax_models.batch import ForwardBatch, make_forward_batch
from flax_models.batching import BatchBuilder, Request, StepArrays
from flax_models.cache import AttentionCache, MambaCache, init_cache
from flax_models.checkpoint import load_hf_checkpoint
from flax_models.config import HybridConfig
from flax_models.engine import Engine, sample_tokens
from flax_models.model import HybridLM, layer_implementation

__all__ = [
    "AttentionCache",
    "BatchBuilder",
    "Engine",
    "ForwardBatch",
    "HybridConfig",
    "HybridLM",
    "MambaCache",
    "Request",
    "StepArrays",
    "init_cache",
    "layer_implementation",
    "load_hf_checkpoint",
    "make_forward_batch",
    "sample_tokens",
]
