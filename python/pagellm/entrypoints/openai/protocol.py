"""Pydantic models of the OpenAI-compatible API (OpenAI's field names, plus vLLM's extras).

Requests: unknown fields are ignored (OpenAI SDKs send fields we do not know), known fields are
validated strictly (no "0.5" -> 0.5 coercion, no bool for int) and range-checked, and every string
in a request body must be valid Unicode (no lone UTF-16 surrogates); any failure is a 400 with an
OpenAI-style error body (see api_server.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator
from pydantic_core import PydanticCustomError

from pagellm.entrypoints.openai.input_checks import find_lone_surrogate, lone_surrogate_message, quote_input
from pagellm.sampling_params import SamplingParams

# OpenAI caps logprobs at 5 for completions and top_logprobs at 20 for chat; we allow 20 for both.
MAX_LOGPROBS = 20


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, protected_namespaces=())


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class RequestModel(OpenAIBaseModel):
    """A request body: refused as a whole if any string in it (or key) is not valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        found = find_lone_surrogate(data)
        if found is not None:
            raise PydanticCustomError("invalid_unicode", lone_surrogate_message(*found))
        return data


class HealthResponse(OpenAIBaseModel):
    status: Literal["ok", "draining", "dead"]
    message: str | None = None


class VersionResponse(OpenAIBaseModel):
    version: str


# ---------------------------------------------------------------------------- shared
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int | None = 0
    total_tokens: int = 0


# logit_bias: {"<token id>": bias in [-100, 100]}, as OpenAI; ids are checked against the vocabulary later.
LogitBiasKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]
LogitBiasValue = Annotated[float, Field(ge=-100.0, le=100.0)]


class _SamplingFields(RequestModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[LogitBiasKey, LogitBiasValue] | None = None
    seed: int | None = None
    user: str | None = None
    # vLLM extras
    # keep the last k prompt tokens; -1: as many as fit next to max_tokens (prompt_truncation.py)
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | Literal[-1] | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    priority: int = 0

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    def _common_sampling_kwargs(self) -> dict[str, Any]:
        logit_bias = None
        if self.logit_bias:
            try:
                logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError as e:
                raise ValueError("logit_bias keys must be token ids (integers as strings)") from e
        return dict(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=logit_bias,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )


# ---------------------------------------------------------------------------- completions
PromptType = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: PromptType
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of != n is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 is only allowed with echo=true (prompt scoring)")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)

    def to_sampling_params(self) -> SamplingParams:
        """max_tokens=None is left for the input processor to fill in (up to max_model_len)."""
        echo_only = self.echo and self.max_tokens == 0
        max_tokens = self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        kw = self._common_sampling_kwargs()
        if echo_only:  # score the prompt: one throw-away greedy token
            kw.update(temperature=0.0, n=1, stop=None, min_tokens=0)
        return SamplingParams(max_tokens=1 if echo_only else max_tokens, logprobs=self.logprobs,
                              prompt_logprobs=prompt_logprobs, **kw)


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


# ---------------------------------------------------------------------------- chat
class ChatContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ChatContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.type != "text":
                raise ValueError(f"content part type {quote_input(p.type)} is not supported (text only)")
            parts.append(p.text or "")
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)  # documented as minItems 1 (and still checked below)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self):
        if not self.messages:
            raise ValueError("messages must be a non-empty list")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def to_sampling_params(self) -> SamplingParams:
        """max_tokens=None is left for the input processor to fill in (up to max_model_len)."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        n_logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(max_tokens=max_tokens, logprobs=n_logprobs, **self._common_sampling_kwargs())


class ChatLogProbTop(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbContent(ChatLogProbTop):
    top_logprobs: list[ChatLogProbTop] = Field(default_factory=list)


class ChatChoiceLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbContent] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


# ---------------------------------------------------------------------------- models
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagellm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------- tokenize
class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
