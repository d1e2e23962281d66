"""Serving beyond the engine's step: sampling settings and the device sampler, text in and
text out (``LLM``), incremental detokenisation, chat templates, and the KV page pool and
prefix cache (``prefix_cache.BlockManager``).

``flax_models.engine`` (the jitted step and the scheduler) samples with
``serving.sampling``; ``serving.llm`` wraps an engine with a Hugging Face tokenizer.
"""

from flax_models.serving.sampling import SamplingParams, filter_logits, sample_tokens

__all__ = ["LLM", "Completion", "SamplingParams", "filter_logits", "sample_tokens"]


def __getattr__(name: str):
    # LLM imports the engine, which imports serving.sampling: loading it on first use keeps
    # `import flax_models.engine` free of an import cycle.
    if name in ("LLM", "Completion"):
        from flax_models.serving import llm

        return getattr(llm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
