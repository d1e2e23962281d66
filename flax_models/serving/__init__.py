"""Serving: the ``Engine`` over token ids, ``LLM`` over text, and the parts they are made of.

``engine`` (the facade: construction, ``generate``, ``stream``, ``step``, ``warmup``),
``scheduler`` (admission, slots, prefix-cache planning, landing a step's tokens), ``plan``
(the typed ``StepPlan`` between them), ``runner`` (the step programs: jit, device arrays,
the sampler launch), ``request`` (a request's host-side state), ``outputs`` (token events,
streams, progress, step statistics), ``inputs`` (argument and prompt checks), ``batching``
(bucketed step arrays), ``prefix_cache`` (KV pages, block hashes, snapshots), ``sampling``
(settings and the device sampler), ``text`` (``LLM``), ``detokenize``, ``chat`` (chat
templates) and ``cli`` (``python -m flax_models.generate``).
"""

from flax_models.serving.engine import Engine, TokenEvent
from flax_models.serving.outputs import CompletionOutput, RequestOutput
from flax_models.serving.sampling import SamplingParams, filter_logits, sample_tokens
from flax_models.serving.text import LLM

__all__ = [
    "LLM",
    "CompletionOutput",
    "RequestOutput",
    "Engine",
    "SamplingParams",
    "TokenEvent",
    "filter_logits",
    "sample_tokens",
]
