"""``POST /v1/chat/completions``: a conversation rendered with the checkpoint's chat
template → engine → a ``ChatCompletionResponse`` or a stream of
``ChatCompletionStreamResponse`` events (a first ``role`` delta per choice, then content
deltas, the finish reason on the last) ending in ``data: [DONE]``."""

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
    bad_request,
    sse_event,
    unavailable,
)

__all__ = ["OpenAIServingChat"]


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self,
        request: protocol.ChatCompletionRequest,
        is_disconnected: Callable[[], Awaitable[None]],
    ) -> protocol.ChatCompletionResponse | EventStream | None:
        """The response, or for ``stream`` the iterator of its events; None when the
        client left before the end. Raises ``OpenAIError``."""
        arrival = time.monotonic()
        self.check_request(request)
        try:
            text = self.llm.apply_chat_template(
                request.conversation(), add_generation_prompt=request.add_generation_prompt
            )
        except Exception as error:  # noqa: BLE001 (no template, or the template raised)
            raise bad_request(f"the chat template failed: {error}", "messages") from None
        # The template writes the special tokens (BOS, role markers) itself.
        ids = self.encode(text, add_special_tokens=False)
        top = (request.top_logprobs or 0) if request.logprobs else None
        params = self.sampling_params(
            request,
            max_tokens=self.token_limit(len(ids), request.token_limit(), "messages"),
            logprobs=top,
        )
        request_id = protocol.random_id("chatcmpl")
        submission = await self.submit(request_id, [ids], [params], arrival=arrival)
        created = int(time.time())
        if request.stream:
            return self.event_stream(self._stream(request, submission, created, top), submission)
        deltas = await self.collect(submission, is_disconnected)
        if deltas is None:
            return None
        n = submission.n
        texts = [""] * n
        tokens = [0] * n
        logprobs = [
            None if top is None else protocol.ChatChoiceLogprobs(content=[]) for _ in range(n)
        ]
        finish: list[str | None] = [None] * n
        stop_reason: list[int | str | None] = [None] * n
        for delta in deltas:
            for c in delta.choices:
                texts[c.index] += c.text
                tokens[c.index] += len(c.token_ids)
                if logprobs[c.index] is not None and c.logprobs is not None:
                    logprobs[c.index].content.extend(self._logprobs(c, top))
                if c.finish_reason is not None:
                    finish[c.index], stop_reason[c.index] = c.finish_reason, c.stop_reason
        completion_tokens = sum(tokens)
        return protocol.ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=[
                protocol.ChatCompletionResponseChoice(
                    index=i,
                    message=protocol.ChatResponseMessage(content=texts[i]),
                    logprobs=logprobs[i],
                    finish_reason=finish[i],
                    stop_reason=stop_reason[i],
                )
                for i in range(n)
            ],
            usage=protocol.UsageInfo(
                prompt_tokens=submission.num_prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=submission.num_prompt_tokens + completion_tokens,
            ),
        )

    def _logprobs(self, delta: ChoiceDelta, top: int) -> list[protocol.ChatTokenLogprob]:
        """One entry per token of the delta: its text, log-probability and bytes, and the
        ``top`` most likely tokens at its position."""
        out = []
        for token, entries in zip(delta.token_ids, delta.logprobs, strict=True):
            text = self.token_text(token)
            out.append(
                protocol.ChatTokenLogprob(
                    token=text,
                    logprob=entries.get(token, float("-inf")),
                    bytes=list(text.encode("utf-8", errors="replace")),
                    top_logprobs=[
                        protocol.TopLogprob(
                            token=self.token_text(t),
                            logprob=lp,
                            bytes=list(self.token_text(t).encode("utf-8", errors="replace")),
                        )
                        for t, lp in self.ranked(entries)[:top]
                    ],
                )
            )
        return out

    async def _stream(
        self,
        request: protocol.ChatCompletionRequest,
        submission: Submission,
        created: int,
        top: int | None,
    ) -> AsyncIterator[str]:
        def chunk(choices, usage=None) -> str:
            return sse_event(
                protocol.ChatCompletionStreamResponse(
                    id=submission.request_id,
                    created=created,
                    model=self.model_name,
                    choices=choices,
                    usage=usage,
                )
            )

        tokens = [0] * submission.n
        # OpenAI's first event of each choice: the role, empty content.
        yield chunk(
            [
                protocol.ChatCompletionStreamChoice(
                    index=i, delta=protocol.DeltaMessage(role="assistant", content="")
                )
                for i in range(submission.n)
            ]
        )
        try:
            async for delta in self.deltas(submission):
                choices = []
                for c in delta.choices:
                    tokens[c.index] += len(c.token_ids)
                    logprobs = None
                    if top is not None and c.logprobs is not None:
                        logprobs = protocol.ChatChoiceLogprobs(content=self._logprobs(c, top))
                    choices.append(
                        protocol.ChatCompletionStreamChoice(
                            index=c.index,
                            delta=protocol.DeltaMessage(content=c.text),
                            logprobs=logprobs,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                        )
                    )
                if choices:
                    yield chunk(choices)
        except EngineDeadError as error:
            yield sse_event(unavailable(str(error)).response())
            yield SSE_DONE
            return
        if request.stream_options is not None and request.stream_options.include_usage:
            completion_tokens = sum(tokens)
            yield chunk(
                [],
                protocol.UsageInfo(
                    prompt_tokens=submission.num_prompt_tokens,
                    completion_tokens=completion_tokens,
                    total_tokens=submission.num_prompt_tokens + completion_tokens,
                ),
            )
        yield SSE_DONE
