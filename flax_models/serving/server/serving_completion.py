"""``POST /v1/completions``: prompts (text or token ids) → engine → a ``CompletionResponse``
or a stream of ``CompletionStreamResponse`` events ending in ``data: [DONE]``."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

from flax_models.serving.server import protocol
from flax_models.serving.server.engine_loop import ChoiceDelta, EngineDeadError
from flax_models.serving.server.serving_engine import (
    SSE_DONE,
    EventStream,
    OpenAIServing,
    Submission,
    sse_event,
    unavailable,
)

__all__ = ["OpenAIServingCompletion"]


class _Choice:
    """One choice's text, tokens and legacy log-probabilities, built up from deltas."""

    def __init__(self, index: int, want_logprobs: bool):
        self.index = index
        self.text = ""
        self.num_tokens = 0
        self.logprobs = protocol.CompletionLogProbs() if want_logprobs else None
        self.offset = 0  # text_offset of the next token
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(
        self,
        request: protocol.CompletionRequest,
        is_disconnected: Callable[[], Awaitable[None]],
    ) -> protocol.CompletionResponse | EventStream | None:
        """The response, or for ``stream`` the iterator of its events; None when the
        client left before the end (nothing to answer). Raises ``OpenAIError``."""
        arrival = time.monotonic()
        self.check_request(request)
        prompts = [self.encode(p) if isinstance(p, str) else list(p) for p in request.prompts()]
        params = [
            self.sampling_params(
                request,
                max_tokens=self.token_limit(len(ids), request.max_tokens, "prompt"),
                logprobs=request.logprobs,
            )
            for ids in prompts
        ]
        request_id = protocol.random_id("cmpl")
        submission = await self.submit(request_id, prompts, params, arrival=arrival)
        created = int(time.time())
        if request.stream:
            return self.event_stream(self._stream(request, submission, created), submission)
        deltas = await self.collect(submission, is_disconnected)
        if deltas is None:
            return None
        choices = {
            i: _Choice(i, request.logprobs is not None) for i in range(len(prompts) * submission.n)
        }
        for delta in deltas:
            for c in delta.choices:
                self._add(choices[submission.choice_index(delta, c.index)], c)
        completion_tokens = sum(c.num_tokens for c in choices.values())
        return protocol.CompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=[self._choice(c) for c in choices.values()],
            usage=protocol.UsageInfo(
                prompt_tokens=submission.num_prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=submission.num_prompt_tokens + completion_tokens,
            ),
        )

    def _add(self, choice: _Choice, delta: ChoiceDelta) -> None:
        choice.text += delta.text
        choice.num_tokens += len(delta.token_ids)
        if choice.logprobs is not None and delta.logprobs is not None:
            self._logprobs(choice, delta, choice.logprobs)
        if delta.finish_reason is not None:
            choice.finish_reason = delta.finish_reason
            choice.stop_reason = delta.stop_reason

    def _logprobs(
        self, choice: _Choice, delta: ChoiceDelta, out: protocol.CompletionLogProbs
    ) -> None:
        """Appends the delta's tokens to ``out`` (legacy format): each token's text, its
        log-probability, the top entries (the sampled token and the most likely) and the
        token's offset in the choice's text."""
        for token, entries in zip(delta.token_ids, delta.logprobs, strict=True):
            text = self.token_text(token)
            out.tokens.append(text)
            out.token_logprobs.append(entries.get(token))
            out.top_logprobs.append({self.token_text(t): lp for t, lp in self.ranked(entries)})
            out.text_offset.append(choice.offset)
            choice.offset += len(text)

    @staticmethod
    def _choice(choice: _Choice) -> protocol.CompletionResponseChoice:
        return protocol.CompletionResponseChoice(
            index=choice.index,
            text=choice.text,
            logprobs=choice.logprobs,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
        )

    async def _stream(
        self, request: protocol.CompletionRequest, submission: Submission, created: int
    ) -> AsyncIterator[str]:
        choices: dict[int, _Choice] = {}
        want_logprobs = request.logprobs is not None
        try:
            async for delta in self.deltas(submission):
                events = []
                for c in delta.choices:
                    index = submission.choice_index(delta, c.index)
                    choice = choices.setdefault(index, _Choice(index, want_logprobs))
                    choice.num_tokens += len(c.token_ids)
                    logprobs = None
                    if want_logprobs and c.logprobs is not None:
                        logprobs = protocol.CompletionLogProbs()
                        self._logprobs(choice, c, logprobs)
                    events.append(
                        protocol.CompletionResponseChoice(
                            index=index,
                            text=c.text,
                            logprobs=logprobs,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                    )
                if events:
                    yield sse_event(
                        protocol.CompletionStreamResponse(
                            id=submission.request_id,
                            created=created,
                            model=self.model_name,
                            choices=events,
                        )
                    )
        except EngineDeadError as error:
            yield sse_event(unavailable(str(error)).response())
            yield SSE_DONE
            return
        if request.stream_options is not None and request.stream_options.include_usage:
            completion_tokens = sum(c.num_tokens for c in choices.values())
            yield sse_event(
                protocol.CompletionStreamResponse(
                    id=submission.request_id,
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=protocol.UsageInfo(
                        prompt_tokens=submission.num_prompt_tokens,
                        completion_tokens=completion_tokens,
                        total_tokens=submission.num_prompt_tokens + completion_tokens,
                    ),
                )
            )
        yield SSE_DONE
