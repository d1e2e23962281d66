"""What the completions and chat handlers share: request checks, sampling settings, the
submission of a request's prompts to the engine loop, following them to the end (with
aborts when the client goes away), log-probabilities and server-sent events.

A request with several prompts (a completions batch) or ``n`` completions becomes one
engine request per prompt, ``<request id>-<prompt index>``, each of ``n`` completions;
its choices are numbered ``prompt index * n + completion index``, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from pydantic import BaseModel

from flax_models.serving.sampling import SamplingParams
from flax_models.serving.server import protocol
from flax_models.serving.server.engine_loop import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestDelta,
    RequestStream,
)

__all__ = ["SSE_DONE", "EventStream", "OpenAIError", "OpenAIServing", "Submission", "sse_event"]

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | Mapping[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


class OpenAIError(Exception):
    """An error the API answers with ``status`` and OpenAI's error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "BadRequestError",
        param: str | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.type, self.param = message, status, type, param

    def response(self) -> protocol.ErrorResponse:
        return protocol.ErrorResponse(
            error=protocol.ErrorInfo(
                message=self.message, type=self.type, param=self.param, code=self.status
            )
        )


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(message, status=400, type="BadRequestError", param=param)


def unavailable(message: str) -> OpenAIError:
    return OpenAIError(message, status=503, type="ServiceUnavailableError")


@dataclasses.dataclass
class EventStream:
    """A streamed response: its server-sent events, and what to call when the response
    ends however it ends (aborts what is left of its requests)."""

    events: AsyncIterator[str]
    abort: Callable[[], None]


@dataclasses.dataclass
class Submission:
    """The engine requests of one API request: ``request_ids[p]`` serves prompt ``p``."""

    request_id: str
    request_ids: list[str]
    prompt_token_ids: list[list[int]]
    stream: RequestStream
    n: int

    @functools.cached_property
    def prompt_index(self) -> dict[str, int]:
        return {rid: p for p, rid in enumerate(self.request_ids)}

    def choice_index(self, delta: RequestDelta, completion: int) -> int:
        return self.prompt_index[delta.request_id] * self.n + completion

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_token_ids)


class OpenAIServing:
    """The base of ``OpenAIServingCompletion`` and ``OpenAIServingChat``.

    Args:
      llm: the ``LLM`` (its tokenizer, chat template and generation defaults).
      engine: the ``AsyncEngine`` around ``llm.engine``.
      served_model_names: the names requests may give as ``model`` (the first is the one
        responses carry).
      max_model_len: prompt + generated tokens a request may hold.
    """

    def __init__(
        self,
        llm,
        engine: AsyncEngine,
        *,
        served_model_names: list[str],
        max_model_len: int,
    ):
        self.llm = llm
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.max_model_len = max_model_len
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------ checks

    def check_request(self, request: protocol.SamplingRequest) -> None:
        if request.model is not None and request.model not in self.served_model_names:
            raise OpenAIError(
                f"The model `{request.model}` does not exist.",
                status=404,
                type="NotFoundError",
                param="model",
            )
        unsupported = request.unsupported_field()
        if unsupported is not None:
            raise bad_request(f"{unsupported} is not supported by this server", unsupported)
        ignored = request.ignored_fields()
        if ignored:
            logger.warning("fields present in the request but ignored: %s", ignored)

    def token_limit(self, prompt_len: int, max_tokens: int | None, where: str) -> int:
        """``max_tokens`` checked against the model length (None: all that is left)."""
        if max_tokens is None:
            max_tokens = self.max_model_len - prompt_len
        if prompt_len + max_tokens > self.max_model_len or max_tokens < 0:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {prompt_len + max_tokens} tokens ({prompt_len} in "
                f"the {where}, {max_tokens} in the completion). Please reduce the length of "
                f"the {where} or completion.",
                "max_tokens" if prompt_len < self.max_model_len else where,
            )
        return max_tokens

    def sampling_params(
        self,
        request: protocol.SamplingRequest,
        *,
        max_tokens: int,
        logprobs: int | None,
    ) -> SamplingParams:
        """The request's settings; the fields it leaves out take the checkpoint's
        ``generation_config.json`` values (through the ``LLM``), as in vLLM."""
        given: dict[str, Any] = dict(n=request.n, max_tokens=max_tokens)
        for name in ("temperature", "top_p", "top_k", "seed", "stop_token_ids"):
            value = getattr(request, name)
            if value is not None:
                given[name] = value
        if request.stop_strings():
            given["stop"] = request.stop_strings()
        if request.ignore_eos:
            given["ignore_eos"] = True
        if logprobs is not None:
            given["logprobs"] = logprobs
        try:
            params = SamplingParams(**given)
            return params.with_defaults(self.llm.generation_defaults)
        except ValueError as error:
            raise bad_request(str(error), _field_of(str(error), given)) from None

    # ------------------------------------------------------------------ the engine

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[list[int]],
        params: list[SamplingParams],
        *,
        arrival: float,
    ) -> Submission:
        """Adds one engine request per prompt; if any is refused, those already added are
        aborted and the error is raised as the API's."""
        stream = RequestStream(request_id)
        ids = [f"{request_id}-{p}" for p in range(len(prompt_token_ids))]
        added: list[str] = []
        try:
            for rid, prompt, p in zip(ids, prompt_token_ids, params, strict=True):
                await self.engine.add_request(rid, prompt, p, arrival=arrival, stream=stream)
                added.append(rid)
        except BaseException as error:
            for rid in added:
                self.engine.abort(rid)
            if isinstance(error, ValueError):
                raise bad_request(str(error)) from None
            if isinstance(error, EngineOverloadedError):
                raise unavailable(str(error)) from None
            if isinstance(error, EngineDeadError):
                raise unavailable(str(error)) from None
            raise
        return Submission(request_id, ids, prompt_token_ids, stream, n=params[0].n)

    def event_stream(self, events: AsyncIterator[str], submission: Submission) -> EventStream:
        return EventStream(events, lambda: self.abort(submission))

    def abort(self, submission: Submission) -> None:
        """Aborts whatever of ``submission`` still runs (finished requests are ignored)."""
        if not submission.stream.finished:
            for rid in submission.request_ids:
                self.engine.abort(rid)

    async def collect(
        self,
        submission: Submission,
        is_disconnected: Callable[[], Awaitable[None]],
    ) -> list[RequestDelta] | None:
        """Every delta of ``submission`` until it ends; if ``is_disconnected`` returns
        first (the client went away), the requests are aborted and ``None`` is returned."""
        deltas: list[RequestDelta] = []

        async def gather() -> None:
            async for delta in submission.stream:
                deltas.append(delta)

        work = asyncio.ensure_future(gather())
        watch = asyncio.ensure_future(is_disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                logger.info("client of %s disconnected: aborted", submission.request_id)
                return None
            work.result()  # an engine failure
            return deltas
        except EngineDeadError as error:
            raise unavailable(str(error)) from None
        finally:
            for task in (work, watch):
                task.cancel()
            self.abort(submission)

    async def deltas(self, submission: Submission) -> AsyncIterator[RequestDelta]:
        """The deltas of ``submission`` as they come; aborts what is left on exit."""
        try:
            async for delta in submission.stream:
                yield delta
        finally:
            self.abort(submission)

    # ------------------------------------------------------------------ tokens

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.llm.encode(text, add_special_tokens=add_special_tokens)

    def token_text(self, token_id: int) -> str:
        """A token's own text (special tokens kept), as log-probabilities show it."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self.llm.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def ranked(self, logprobs: Mapping[int, float]) -> list[tuple[int, float]]:
        return sorted(logprobs.items(), key=lambda item: -item[1])


def _field_of(message: str, given: Mapping[str, Any]) -> str | None:
    """The field a ``SamplingParams`` error names (its messages start with it)."""
    head = message.split("=", 1)[0].split(" ", 1)[0]
    return head if head in given or head in ("n", "max_tokens") else None
