"""The OpenAI API's request and response bodies (pydantic models, validated at the edge).

Requests follow OpenAI's completions and chat-completions APIs with vLLM's extra sampling
fields (``top_k``, ``ignore_eos``, ``stop_token_ids``; the ``openai`` client sends them
through ``extra_body``). A body that does not validate is answered with status 400 before
anything reaches the engine; so is one that asks for a feature this server does not have
(``unsupported_field``). Unknown fields are kept (``extra="allow"``) and ignored with a
log line, as vLLM does.

Responses are what the ``openai`` client parses: ``Completion`` / ``ChatCompletion`` and,
for ``stream: true``, their ``...Chunk`` forms sent as server-sent events.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flax_models.serving.sampling import MAX_LOGPROBS

__all__ = [
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionStreamResponse",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamResponse",
    "ErrorInfo",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "UsageInfo",
    "random_id",
]


def random_id(prefix: str) -> str:
    """``prefix-<32 hex digits>``, OpenAI's id shape (``cmpl-...``, ``chatcmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept, so the server can name them in a log line and go on.
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


# --------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# --------------------------------------------------------------------------- models


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "flax_models"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class StreamOptions(BaseModel):
    include_usage: bool = False


# --------------------------------------------------------------------------- requests

NonNegative = Annotated[int, Field(ge=0)]
# (field, its neutral values): a request setting the field to anything else gets a 400.
Unsupported = tuple[tuple[str, tuple[Any, ...]], ...]


class SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat share; each maps to the ``SamplingParams`` field of
    the same name (``serving_engine.sampling_params``)."""

    model: str | None = None
    n: int = Field(default=1, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's extra: -1 or 0 is off
    seed: int | None = Field(default=None, ge=0, lt=2**32)
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegative] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI fields this server does not implement; only their neutral values pass.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    UNSUPPORTED: ClassVar[Unsupported] = (
        ("presence_penalty", (None, 0.0)),
        ("frequency_penalty", (None, 0.0)),
        ("logit_bias", (None, {})),
    )

    def unsupported_field(self) -> str | None:
        """The first field set to something this server cannot do, else None."""
        for name, neutral in self.UNSUPPORTED:
            if getattr(self, name) not in neutral:
                return name
        return None

    def stop_strings(self) -> list[str] | None:
        if self.stop is None:
            return None
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt or a batch (text or token ids)."""

    prompt: Prompt
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    UNSUPPORTED: ClassVar[Unsupported] = SamplingRequest.UNSUPPORTED + (
        ("echo", (False,)),
        ("suffix", (None, "")),
    )

    def unsupported_field(self) -> str | None:
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return super().unsupported_field()

    @model_validator(mode="after")
    def _check_prompt(self):
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        for i, p in enumerate(prompt):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch: each prompt text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: a conversation rendered with the chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's extra
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    UNSUPPORTED: ClassVar[Unsupported] = SamplingRequest.UNSUPPORTED + (
        ("tools", (None, [])),
        ("tool_choice", (None, "none")),
        ("response_format", (None, {"type": "text"})),
    )

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def token_limit(self) -> int | None:
        """``max_completion_tokens``, OpenAI's newer name, else ``max_tokens``."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else (self.max_tokens)
        )

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them."""
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# --------------------------------------------------------------------------- responses

FinishReason = Literal["stop", "length", "abort"] | None


class CompletionLogProbs(BaseModel):
    """The completions API's legacy log-probability lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None  # vLLM's extra: the stop string or token


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
