"""From landed tokens to ``RequestOutput``s: detokenisation, stop strings, log-probabilities
and finish reasons of the engine's requests (vLLM's output processor)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flax_models.serving.detokenize import IncrementalDetokenizer
from flax_models.serving.outputs import CompletionOutput, RequestOutput, TokenEvent
from flax_models.serving.plan import LaunchedStep
from flax_models.serving.request import RequestState, SequenceState

__all__ = ["OutputProcessor"]


class OutputProcessor:
    """Keeps each request's outputs as its tokens land. ``tokenizer`` (a
    ``tokenizers.Tokenizer``, optional) gives the completions their text and stop strings."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def attach(self, request: RequestState) -> None:
        """Sets up ``request``'s per-completion outputs (its sequences made)."""
        n = len(request.sequences)
        request.finish_reasons = [None] * n
        request.stop_reasons = [None] * n
        request.texts = [""] * n
        if request.params.logprobs is not None:
            request.logprobs = [[] for _ in range(n)]
            request.cumulative_logprob = [0.0] * n
        if self.tokenizer is not None:
            request.detokenizers = [
                IncrementalDetokenizer(
                    self.tokenizer, request.prompt_token_ids, stop=request.params.stop
                )
                for _ in range(n)
            ]
            for seq, detokenizer in zip(request.sequences, request.detokenizers, strict=True):
                seq.stop_check = detokenizer.add  # True once a stop string is in the text
        elif request.params.stop:
            raise ValueError(
                f"request {request.request_id!r}: stop strings need an engine with a tokenizer"
            )

    def process(
        self,
        step: LaunchedStep,
        events: Sequence[TokenEvent],
        sequences: dict[int, SequenceState],
    ) -> list[RequestState]:
        """Lands ``events`` of ``step`` (``sequences``: every live sequence by index) into
        their requests; the requests that advanced, in order of their first event."""
        plan = step.plan
        rows = {f.seq.index: int(r) for f, r in zip(plan.scheduled, plan.rows, strict=True)}
        logprobs = None
        if step.logprobs is not None:
            logprobs = [np.asarray(a) for a in step.logprobs]
        touched: dict[int, RequestState] = {}
        for event in events:
            seq = sequences[event.index]
            request = seq.request
            if request is None:
                continue
            touched.setdefault(id(request), request)
            i = seq.output_index
            k = request.params.logprobs
            if k is not None and logprobs is not None:
                row = rows[event.index]
                sampled, top_ids, top_lp = (a[row] for a in logprobs)
                entry = {int(t): float(v) for t, v in zip(top_ids[:k], top_lp[:k], strict=True)}
                entry[event.token] = float(sampled)
                request.logprobs[i].append(entry)
                request.cumulative_logprob[i] += float(sampled)
            detokenizer = request.detokenizers[i] if request.detokenizers else None
            if event.finish_reason is None:
                if detokenizer is not None:
                    request.texts[i] += detokenizer.release()
                continue
            request.finish_reasons[i] = event.finish_reason
            if detokenizer is not None:
                request.texts[i] += detokenizer.finish()
            if detokenizer is not None and detokenizer.stopped:
                request.stop_reasons[i] = detokenizer.stop_string
            elif event.finish_reason == "stop":
                request.stop_reasons[i] = event.token
        return list(touched.values())

    @staticmethod
    def abort(request: RequestState) -> None:
        """Marks the completions of ``request`` that had not ended as aborted."""
        request.finish_reasons = [r or "abort" for r in request.finish_reasons]

    @staticmethod
    def output(request: RequestState) -> RequestOutput:
        """``request``'s ``RequestOutput`` so far."""
        logprobs = request.params.logprobs is not None
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            outputs=[
                CompletionOutput(
                    index=i,
                    text=request.texts[i],
                    token_ids=list(seq.generated),
                    cumulative_logprob=request.cumulative_logprob[i] if logprobs else None,
                    logprobs=list(request.logprobs[i]) if logprobs else None,
                    finish_reason=request.finish_reasons[i],
                    stop_reason=request.stop_reasons[i],
                )
                for i, seq in enumerate(request.sequences)
            ],
            finished=request.finished,
        )
