"""Flax NNX hybrid Mamba2/attention models built on ``pallas_kernels``.

``HybridConfig`` describes a model, ``HybridLM`` is the model (``model(input_ids[B, L])``
gives logits), ``load_hf_checkpoint`` reads a Hugging Face directory, ``Engine`` serves
variable-length requests of token ids through static-shape buckets, and ``LLM`` serves text
(a Hugging Face tokenizer around an engine) with per-request ``SamplingParams``.
"""

from flax_models.batch import ForwardBatch, make_forward_batch
from flax_models.cache import AttentionCache, MambaCache, ParallelCache, init_cache
from flax_models.checkpoint import load_hf_checkpoint
from flax_models.config import HybridConfig
from flax_models.model import HybridLM, layer_implementation
from flax_models.save import save_hf_checkpoint
from flax_models.serving.batching import BatchBuilder, Request, StepArrays
from flax_models.serving.engine import Engine, TokenEvent
from flax_models.serving.outputs import CompletionOutput, RequestOutput
from flax_models.serving.sampling import SamplingParams, sample_tokens
from flax_models.serving.text import LLM

__all__ = [
    "LLM",
    "AttentionCache",
    "BatchBuilder",
    "CompletionOutput",
    "RequestOutput",
    "Engine",
    "ForwardBatch",
    "HybridConfig",
    "HybridLM",
    "MambaCache",
    "ParallelCache",
    "Request",
    "SamplingParams",
    "StepArrays",
    "TokenEvent",
    "init_cache",
    "layer_implementation",
    "load_hf_checkpoint",
    "make_forward_batch",
    "sample_tokens",
    "save_hf_checkpoint",
]
