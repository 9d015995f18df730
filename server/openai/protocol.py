"""OpenAI request schemas (pydantic) as vLLM declares them, and their translation to
SamplingParams.

Every field of vLLM 0.33.0's CompletionRequest and ChatCompletionRequest is declared here
(tests/server/test_vllm_fields.py holds the two lists). Each either works as in vLLM or, when set to
anything but its default, gets a 400 naming it (`_REFUSED`: features jaxserve does not have,
or not yet). Messages and tools: chat_messages.py; the shared base: schema_base.py. A field outside vLLM's schema is accepted, as OpenAI clients send some, and
logged once per name. Structured outputs come from structured_outputs, response_format
(json_object, json_schema) or the guided_* fields vLLM had before 0.12 (it now ignores them;
here they still constrain). Wrong types and out-of-range values are 400s.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from jaxserve.core.sampling_params import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    SamplingParams,
)
from jaxserve.core.structured_output import StructuredOutputsParams
from jaxserve.server.openai.chat_messages import ChatMessage, ChatTool, NamedToolChoice
from jaxserve.server.schema_base import Body, ParamError

COMPLETION_MAX_TOKENS = 16  # completions' default max_tokens (OpenAI and vLLM)
MAX_CACHE_SALT = 128  # characters, as vLLM checks it


class StreamOptions(Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# Fields of features jaxserve does not have (yet): (is it set?, why it is refused).
def _set(value) -> bool:
    return value is not None


_REFUSED: dict[str, tuple[Any, str]] = {
    "suffix": (_set, "suffix (insertion) is not supported"),
    "use_beam_search": (bool, "beam search is not supported"),
    "length_penalty": (lambda v: v != 1.0, "length_penalty applies to beam search, which is "
                       "not supported"),
    "watermarking": (bool, "watermarking is not supported"),
    "logprob_token_ids": (_set, "logprob_token_ids is not supported; use logprobs"),
    "prompt_embeds": (_set, "prompt_embeds is not supported; send text or token ids"),
    "session_id": (_set, "session_id is not supported"),
    "return_weight_versions": (bool, "weight versions are not reported"),
    "routed_experts_prompt_start": (bool, "routed experts are not reported"),
    "return_token_offsets": (bool, "return_token_offsets is not supported"),
    "kv_transfer_params": (_set, "disaggregated prefill (KV transfer) is not supported"),
    "ec_transfer_params": (_set, "encoder-cache transfer is not supported"),
    "vllm_xargs": (_set, "no engine extension takes vllm_xargs"),
    "repetition_detection": (_set, "repetition_detection is not supported"),
    "thinking_token_budget": (lambda v: v is not None and v != -1,
                              "thinking_token_budget needs a reasoning parser, which is not "
                              "supported yet"),
    "mm_processor_kwargs": (_set, "this server takes text only (no multimodal processor)"),
    "media_io_kwargs": (_set, "this server takes text only (no media loading)"),
}
# vLLM's older structured-output fields (before 0.12): still honoured here.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_BACKENDS = ("auto", "guidance", "llguidance")  # guided_decoding_backend values served


class JsonSchemaFormat(Body):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class _Request(Body):
    """The fields completions and chat share (vLLM's names, types and defaults)."""

    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    presence_penalty: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None  # an end-user id for the caller's records; no effect (as vLLM)
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    request_id: str | None = Field(None, min_length=1, max_length=256)
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    return_weight_versions: bool = False
    routed_experts_prompt_start: int = Field(0, ge=0)
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"  # no multimodal output: either holds
    return_mm_kwargs: bool | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)
    kv_transfer_params: dict | None = None
    ec_transfer_params: dict | None = None
    vllm_xargs: dict | None = None
    repetition_detection: dict | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = Field(None, ge=1)

    # ---- checks shared by both kinds ------------------------------------------------------
    def _refuse_unsupported(self) -> None:
        for name, (is_set, why) in _REFUSED.items():
            if name in type(self).model_fields and is_set(getattr(self, name)):
                raise ParamError(name, f"{name}: {why}.")
        if self.response_format is not None and self.response_format.type == "structural_tag":
            raise ParamError("response_format", "response_format type 'structural_tag' is not "
                             "supported; use json_schema, json_object or structured_outputs.")
        if self.guided_decoding_backend not in (None, *_BACKENDS):
            raise ParamError("guided_decoding_backend", "guided_decoding_backend: this server "
                             f"constrains with llguidance; use one of {list(_BACKENDS)}.")
        if self.cache_salt is not None and any(c in self.cache_salt for c in "@/\\\0"):
            raise ParamError("cache_salt", "cache_salt must not contain '@', '/', '\\' or NUL.")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with stream=true")
        if self.stream and self.prompt_logprobs is not None:
            raise ParamError("prompt_logprobs", "prompt_logprobs are not available when "
                             "stream=true.")


    @property
    def structured_field(self) -> str | None:
        """The field that asks for structured output (the one its errors name)."""
        fields = [name for name in ("structured_outputs", *_GUIDED)
                  if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            fields.append("response_format")
        if len(fields) > 1:
            raise ParamError(fields[1], f"give one of {', '.join(fields)}: each asks for a "
                             "structured output.")
        return fields[0] if fields else None

    def _structured(self) -> StructuredOutputsParams | None:
        field = self.structured_field
        if field is None:
            return None
        try:
            if field == "structured_outputs":
                return StructuredOutputsParams.from_dict(self.structured_outputs)
            extra = {}
            if self.guided_whitespace_pattern is not None:
                extra["whitespace_pattern"] = self.guided_whitespace_pattern
            if field in _GUIDED:
                return StructuredOutputsParams(**{_GUIDED[field]: getattr(self, field)},
                                               **extra)
            fmt = self.response_format
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True, **extra)
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise ValueError("type 'json_schema' needs json_schema.schema.")
            return StructuredOutputsParams(json=fmt.json_schema.schema_, **extra)
        except (TypeError, ValueError) as err:
            raise ParamError(field, f"{field}: {err}") from None

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            ids = {int(key): value for key, value in self.logit_bias.items()}
        except ValueError:
            bad = [k for k in self.logit_bias if not k.strip().lstrip("-").isdigit()][:3]
            raise ParamError("logit_bias", f"logit_bias keys must be token ids; got {bad}.") \
                from None
        # As vLLM (and OpenAI's documented range): each bias clamped to [-100, 100].
        return {token: min(100.0, max(-100.0, bias)) for token, bias in ids.items()}

    def _common(self, defaults: dict) -> dict:
        """The fields every request kind shares; a sampling field the request leaves unset
        takes the model's default (generation_config.json), else SamplingParams'. The
        request limits (n, stops, logprobs, ...) are the admission path's to check."""
        self._refuse_unsupported()
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ParamError("prompt_logprobs", f"prompt_logprobs must be in [0, "
                             f"{MAX_LOGPROBS}].")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        values = dict(n=self.n, seed=self.seed, stop=stops,
                      stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                      min_tokens=self.min_tokens,
                      skip_special_tokens=(True if self.skip_special_tokens is None
                                           else self.skip_special_tokens),
                      spaces_between_special_tokens=self.spaces_between_special_tokens,
                      include_stop_str_in_output=self.include_stop_str_in_output,
                      logit_bias=self._logit_bias(), allowed_token_ids=self.allowed_token_ids,
                      bad_words=list(dict.fromkeys(self.bad_words)) or None,
                      truncate_prompt_tokens=self.truncate_prompt_tokens,
                      truncation_side=self.truncation_side or "left",
                      prompt_logprobs=self.prompt_logprobs,
                      structured_outputs=self._structured())
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

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = COMPLETION_MAX_TOKENS
    suffix: str | None = None
    best_of: int | None = None  # OpenAI's; vLLM no longer declares it: only best_of == n
    prompt_embeds: Any = None
    add_special_tokens: bool = True

    @property
    def scores_prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated."""
        return bool(self.echo) and self.max_tokens == 0

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """defaults: the model's sampling defaults (generation_config.json)."""
        defaults = defaults or {}
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of", "best_of other than n is not supported")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ParamError("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.echo and self.suffix is not None:
            raise ParamError("echo", "echo is not supported with suffix.")
        values = self._common(defaults)
        if self.echo and values["prompt_logprobs"] is None:
            values["prompt_logprobs"] = self.logprobs  # the echoed prompt carries logprobs
        max_tokens = _capped(self.max_tokens if self.max_tokens is not None else
                             COMPLETION_MAX_TOKENS, defaults)
        if self.scores_prompt_only:
            max_tokens = 1  # computed and dropped: the response holds the prompt alone
        elif max_tokens < 1:
            raise ParamError("max_tokens", "max_tokens must be at least 1 (0 only with "
                             "echo=true, to score the prompt).")
        return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **values)


def _capped(max_tokens: int | None, defaults: dict) -> int | None:
    """As vLLM: the model's max_new_tokens (generation_config.json) caps a request's
    max_tokens and is the default when the request sets none."""
    limit = defaults.get("max_tokens")
    if limit is None or (max_tokens is not None and max_tokens < 1):
        return max_tokens
    return limit if max_tokens is None else min(max_tokens, limit)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | \
        None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True  # false: at most one call
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict | None = None
    mm_processor_kwargs: dict | None = None
    return_prompt_text: bool | None = None

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """defaults: the model's sampling defaults (generation_config.json)."""
        defaults = defaults or {}
        top = self.top_logprobs or 0
        if not 0 <= top <= MAX_LOGPROBS:
            raise ParamError("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}]")
        if top and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs=true")
        if self.continue_final_message and self.add_generation_prompt and \
                "add_generation_prompt" in self.model_fields_set:
            raise ParamError("continue_final_message", "Cannot set both continue_final_message "
                             "and add_generation_prompt to true.")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ParamError("continue_final_message", "continue_final_message needs the last "
                             "message to be the assistant's.")
        logprobs = top if self.logprobs else None
        values = self._common(defaults)
        grammar = self.tool_grammar()
        if grammar is not None:
            if values["structured_outputs"] is not None:
                raise ParamError("tool_choice", f"tool_choice {self.tool_mode!r} writes the "
                                 f"calls with a grammar; it cannot be combined with "
                                 f"{self.structured_field}.")
            values["structured_outputs"] = grammar
        max_tokens = self.max_tokens
        if self.max_completion_tokens is not None:
            if not 1 <= self.max_completion_tokens <= INT32_MAX:
                raise ParamError("max_completion_tokens", "max_completion_tokens must be an "
                                 f"integer in [1, {INT32_MAX}]")
            max_tokens = self.max_completion_tokens
        return SamplingParams(max_tokens=_capped(max_tokens, defaults), logprobs=logprobs,
                              **values)

    @property
    def tool_mode(self) -> str | None:
        """None (no tools, or tool_choice "none"), "auto", "required" or "named"; checks
        tools and tool_choice as vLLM does."""
        if self.tools is not None and not self.tools:
            raise ParamError("tools", "tools must not be empty; leave it out instead.")
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise ParamError("tool_choice", "tool_choice other than 'none' needs tools.")
            return None
        if choice is None:
            return "auto"  # OpenAI's default when tools are given
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in self.tool_names:
                raise ParamError("tool_choice", f"tool_choice names {choice.function.name!r}, "
                                 f"which is not among the tools ({', '.join(self.tool_names)}).")
            return "named"
        return None if choice == "none" else choice

    @property
    def tool_names(self) -> list[str]:
        return [tool.function.name for tool in self.tools or []]

    @property
    def named_tool(self) -> str | None:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template reads them (OpenAI's shape)."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def tool_grammar(self) -> StructuredOutputsParams | None:
        from jaxserve.server.openai.tool_calls import tool_grammar

        mode = self.tool_mode
        if mode not in ("required", "named"):
            return None
        try:
            return tool_grammar(mode, self.template_tools(), self.named_tool,
                                self.parallel_tool_calls is not False)
        except ValueError as err:
            raise ParamError("tools", f"tools: {err}") from None

    @property
    def adds_generation_prompt(self) -> bool:
        """continue_final_message renders the last message open (no new turn), as vLLM."""
        return self.add_generation_prompt and not self.continue_final_message

    def template_messages(self) -> list[dict]:
        return [m.as_template_message() for m in self.messages]

    def template_kwargs(self, server_defaults: dict, tools_when_none: bool = True) -> dict:
        """What the chat template sees besides the messages: the server's defaults, then the
        request's chat_template_kwargs, then the typed fields (vLLM's order). With
        tools_when_none False (--exclude-tools-when-tool-choice-none), tool_choice "none"
        keeps the tools out of the prompt."""
        kwargs = dict(server_defaults)
        # Names the template call sets itself are refused where the template is rendered
        # (inputs/chat_template.check_template_kwargs), for every front end.
        kwargs.update(self.chat_template_kwargs or {})
        # The typed fields win (and add_generation_prompt is passed on its own).
        kwargs.pop("add_generation_prompt", None)
        kwargs["continue_final_message"] = self.continue_final_message
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.tools and (tools_when_none or self.tool_choice != "none"):
            kwargs["tools"] = self.template_tools()
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    @property
    def echo_text(self) -> str:
        """Chat echo (vLLM's): the last message's content, when it has the role the answer
        takes (the assistant's, or the last message's own when no new turn is opened)."""
        last = self.messages[-1]
        role = "assistant" if self.adds_generation_prompt else last.role
        return last.text if self.echo and last.role == role else ""


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]
