"""OpenAI request schemas (pydantic) and their translation to SamplingParams.

Field names and defaults follow the OpenAI API, plus vLLM's extra sampling fields (top_k,
min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...). Unknown fields are
ignored, as the OpenAI clients send some; wrong types and out-of-range values are errors.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.sampling_params import INT32_MAX, MAX_LOGPROBS, SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


class RequestLimits(BaseModel):
    """Server-side caps on what one request may ask for."""

    max_n: int = 16
    max_prompts: int = 256  # prompts in one (batched) completion request
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_length: int = MAX_STOP_LENGTH


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def _stops(self, limits: RequestLimits) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > limits.max_stop_strings:
            raise ParamError("stop", f"at most {limits.max_stop_strings} stop strings")
        if any(len(s) > limits.max_stop_length for s in stops):
            raise ParamError("stop", f"stop strings of at most {limits.max_stop_length} chars")
        return stops

    def _common(self, limits: RequestLimits, defaults: dict) -> dict:
        """The fields every request kind shares; a sampling field the request leaves unset
        takes the model's default (generation_config.json), else SamplingParams'."""
        if self.n > limits.max_n:
            raise ParamError("n", f"n must be at most {limits.max_n}")
        if self.logit_bias:
            raise ParamError("logit_bias", "logit_bias is not supported yet")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with stream=true")
        values = dict(n=self.n, seed=self.seed, stop=self._stops(limits),
                      stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                      min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
                      include_stop_str_in_output=self.include_stop_str_in_output)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                values[name] = value
        return values

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None  # None: as many as fit in the context
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def sampling_params(self, limits: RequestLimits, defaults: dict | None = None
                        ) -> SamplingParams:
        """defaults: the model's sampling defaults (generation_config.json)."""
        defaults = defaults or {}
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of", "best_of other than n is not supported")
        if self.logprobs is not None and self.logprobs > MAX_LOGPROBS:
            raise ParamError("logprobs", f"logprobs must be at most {MAX_LOGPROBS}")
        prompt_logprobs = self.logprobs if (self.echo and self.logprobs is not None) else None
        max_tokens = self.max_tokens if self.max_tokens is not None else \
            defaults.get("max_tokens")
        return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs,
                              prompt_logprobs=prompt_logprobs,
                              **self._common(limits, defaults))


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list | None = None
    add_generation_prompt: bool = True

    def sampling_params(self, limits: RequestLimits, defaults: dict | None = None
                        ) -> SamplingParams:
        """defaults: the model's sampling defaults (generation_config.json)."""
        defaults = defaults or {}
        if self.response_format is not None and self.response_format.type != "text":
            raise ParamError("response_format",
                             f"response_format type {self.response_format.type[:32]!r} is not "
                             "supported yet; only 'text' is")
        if self.tools:
            raise ParamError("tools", "tools are not supported yet")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ParamError("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_tokens
        if self.max_completion_tokens is not None:
            if not 1 <= self.max_completion_tokens <= INT32_MAX:
                raise ParamError("max_completion_tokens", "max_completion_tokens must be an "
                                 f"integer in [1, {INT32_MAX}]")
            max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                              **self._common(limits, defaults))

    def template_messages(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class ParamError(ValueError):
    """A request field with an unacceptable value; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
