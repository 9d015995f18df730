"""POST /v1/responses (OpenAI's Responses API) as vLLM declares it: the request schema, its
checks, and its translation into a chat request.

A Responses request becomes a ChatCompletionRequest (protocol.py) and goes through the chat
path unchanged: the admission path, the chat template, tools and tool_choice (flat function
tools become chat's nested ones), structured outputs (`text.format` becomes
`response_format`), the sampling fields. Every field of vLLM's ResponsesRequest is declared,
and the OpenAI fields vLLM lacks that clients send; each is honoured or, set to anything but
its default, refused with a 400 naming it (`_REFUSED`). Refusals the chat path raises name
the chat field; `RENAMED` maps them back to this API's names.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from jaxserve.core.sampling_params import INT32_MAX, INT64_MAX, INT64_MIN, MAX_LOGPROBS
from jaxserve.server.errors import APIError, from_validation_error
from jaxserve.server.openai.protocol import MAX_CACHE_SALT, ChatCompletionRequest
from jaxserve.server.responses.items import continues_last
from jaxserve.server.schema_base import Body, ParamError

LOGPROBS = "message.output_text.logprobs"  # the one `include` value served
# OpenAI's bounds on metadata: 16 pairs, keys of 64 characters, values of 512.
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
TOOL_CHOICES = ("auto", "none", "required")
# Chat fields (as the chat path's refusals name them) -> this API's.
RENAMED = {"messages": "input", "prompt": "input", "continue_final_message": "input",
           "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "logprobs": "top_logprobs",
           "reasoning_effort": "reasoning.effort", "truncate_prompt_tokens": "truncation"}
_RENAMED_WORDS = re.compile(r"\b(" + "|".join(RENAMED) + r"|structured_outputs)\b")


def _set(value) -> bool:
    return value is not None


# Fields of features jaxserve does not have: (is it set?, why it is refused).
_REFUSED: dict[str, tuple[Any, str]] = {
    "background": (bool, "background responses are not supported: each response is answered "
                   "in its own request (stream=true streams it)"),
    "max_tool_calls": (_set, "max_tool_calls bounds calls to built-in tools, and this server "
                       "runs none"),
    "prompt": (_set, "prompt templates (stored prompts) are not supported; send input and "
               "instructions"),
    "service_tier": (lambda v: v not in ("auto", "default"), "service tiers are not offered: "
                     "every request is served alike ('auto' or 'default')"),
    "mm_processor_kwargs": (_set, "this server takes text only (no multimodal processor)"),
    "enable_response_messages": (bool, "the raw input and output messages are not returned"),
    "previous_input_messages": (_set, "previous_input_messages (Harmony messages) is not "
                                "supported; use previous_response_id"),
    "previous_response": (_set, "previous_response (stateless turns carried by encrypted "
                          "reasoning) is not supported; use previous_response_id"),
    "vllm_xargs": (_set, "no engine extension takes vllm_xargs"),
    "conversation": (_set, "conversations are not supported; use previous_response_id"),
    "context_management": (_set, "context_management (compaction) is not supported"),
    "prompt_cache_retention": (lambda v: v not in (None, "in_memory"), "the prefix cache "
                               "lives in memory ('in_memory'); it is not kept for 24h"),
}


class FunctionTool(Body):
    """A function tool in the Responses API's flat form."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class TextFormat(Body):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(Body):
    include_obfuscation: bool | None = None


class ResponsesRequest(Body):
    """vLLM's ResponsesRequest fields (OpenAI's order, then vLLM's own), then OpenAI's
    fields vLLM lacks."""

    background: bool | None = False
    include: list[str] | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None
    logit_bias: dict[str, float] | None = None
    parallel_tool_calls: bool | None = True
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    prompt: dict | None = None
    reasoning: ReasoningConfig | None = None
    service_tier: str = "auto"
    store: bool | None = True
    stream: bool | None = False
    temperature: float | None = None
    text: TextConfig | None = None
    tool_choice: str | dict = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_logprobs: int | None = 0
    top_p: float | None = None
    top_k: int | None = None
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_cache_key: str | None = None  # a cache-routing hint: one prefix cache serves all
    request_id: str | None = Field(None, min_length=1, max_length=256)
    mm_processor_kwargs: dict | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT)
    enable_response_messages: bool = False
    previous_input_messages: list | None = None
    previous_response: dict | None = None
    structured_outputs: dict | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    vllm_xargs: dict | None = None
    # OpenAI's, not in vLLM's schema
    conversation: Any = None
    context_management: Any = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None  # an end-user id, logged as `user` is
    stream_options: StreamOptions | None = None

    # ---- checks -------------------------------------------------------------------------
    def check(self) -> None:
        """Everything that can be refused from the body alone (a ParamError naming the
        field). The request limits (items, tools) are the serving side's."""
        for name, (is_set, why) in _REFUSED.items():
            if is_set(getattr(self, name)):
                raise ParamError(name, f"{name}: {why}.")
        for entry in self.include or ():
            if entry != LOGPROBS:
                raise ParamError("include", f"include: {str(entry)[:60]!r} is not supported; "
                                 f"this server can include {LOGPROBS!r} only.")
        if not 0 <= (self.top_logprobs or 0) <= MAX_LOGPROBS:
            raise ParamError("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}].")
        if self.top_logprobs and not self.wants_logprobs:
            raise ParamError("top_logprobs", f"top_logprobs needs include [{LOGPROBS!r}].")
        if self.max_output_tokens is not None and \
                not 1 <= self.max_output_tokens <= INT32_MAX:
            raise ParamError("max_output_tokens", "max_output_tokens must be an integer in "
                             f"[1, {INT32_MAX}].")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise ParamError("stream_options", "stream_options.include_obfuscation: stream "
                             "events are not padded here; leave it out or false.")
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed with "
                             "stream=true.")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise ParamError("text.verbosity", "text.verbosity: this server has no verbosity "
                             "control; leave it out or 'medium'.")
        if self.reasoning is not None and (self.reasoning.summary or
                                           self.reasoning.generate_summary):
            raise ParamError("reasoning.summary", "reasoning.summary: no summaries are "
                             "written; the reasoning parser (--reasoning-parser) returns the "
                             "thinking itself as reasoning items.")
        self._check_metadata()
        self._check_format()

    def _check_metadata(self) -> None:
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA:
            raise ParamError("metadata", f"metadata holds at most {MAX_METADATA} pairs, got "
                             f"{len(metadata)}.")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ParamError("metadata", f"metadata keys are at most {MAX_METADATA_KEY} "
                                 f"characters and values at most {MAX_METADATA_VALUE}.")

    def _check_format(self) -> None:
        fmt = self.format
        if fmt is None or fmt.type == "text":
            return
        if self.structured_outputs is not None:
            raise ParamError("text.format", "give one of text.format and structured_outputs: "
                             "each asks for a structured output.")
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise ParamError("text.format", "text.format of type 'json_schema' needs its "
                             "schema.")

    @property
    def format(self) -> TextFormat | None:
        return self.text.format if self.text is not None else None

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ())

    @property
    def grammar_field(self) -> str:
        """The field a structured-output problem is reported on."""
        if self.structured_outputs is not None:
            return "structured_outputs"
        if self.format is not None and self.format.type != "text":
            return "text.format"
        return "tools"

    def function_tools(self) -> list[FunctionTool]:
        """The tools, each a function tool (others refused, naming the tool)."""
        tools = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                shown = repr(str(kind)[:40]) if kind is not None else "none"
                raise ParamError("tools", f"tools[{i}]: tools of type {shown} are not "
                                 "supported; this server serves function tools only.")
            try:
                tools.append(FunctionTool.model_validate(tool))
            except ValidationError as err:
                raise ParamError("tools", f"tools[{i}].{from_validation_error(err).message}") \
                    from None
        return tools

    def chat_tool_choice(self) -> str | dict | None:
        choice = self.tool_choice
        if isinstance(choice, str):
            if choice not in TOOL_CHOICES:
                raise ParamError("tool_choice", f"tool_choice must be one of {TOOL_CHOICES} "
                                 "or {'type': 'function', 'name': ...}.")
            return choice
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ParamError("tool_choice", "tool_choice: this server serves function tools "
                             "only: 'auto', 'none', 'required' or {'type': 'function', "
                             "'name': ...}.")
        return {"type": "function", "function": {"name": choice["name"]}}

    # ---- the chat request -----------------------------------------------------------------
    def chat_request(self, messages: list[dict]) -> ChatCompletionRequest:
        """The chat request this request runs as: messages is the conversation
        (instructions first, then a previous response's turns, then the input), as
        truncation "auto" kept it (server/responses/truncation.py)."""
        tools = [{"type": "function", "function": t.model_dump(exclude={"type"},
                                                                exclude_none=True)}
                 for t in self.function_tools()]
        choice = self.chat_tool_choice()
        continues = continues_last(self.input)
        values = dict(
            model=self.model, messages=messages, logit_bias=self.logit_bias, seed=self.seed,
            stop=self.stop, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs, priority=self.priority,
            request_id=self.request_id, cache_salt=self.cache_salt,
            logprobs=self.wants_logprobs, top_logprobs=self.top_logprobs or 0,
            max_completion_tokens=self.max_output_tokens, tools=tools or None,
            tool_choice=choice if tools or choice not in ("auto", "none") else None,
            parallel_tool_calls=self.parallel_tool_calls,
            reasoning_effort=self.reasoning.effort if self.reasoning is not None else None,
            response_format=self._response_format(),
            continue_final_message=continues, add_generation_prompt=not continues)
        try:
            return ChatCompletionRequest.model_validate(
                {k: v for k, v in values.items() if v is not None})
        except ValidationError as err:
            raise renamed(from_validation_error(err), self.grammar_field) from None

    def _response_format(self) -> dict | None:
        fmt = self.format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {
            "name": fmt.name, "description": fmt.description, "schema": fmt.schema_,
            "strict": fmt.strict}}

    def prompt_limit(self, max_model_len: int) -> int:
        """The most prompt tokens that leave room for max_output_tokens (or for one token
        when it is not set): what truncation "auto" fits the conversation into."""
        return max_model_len - (self.max_output_tokens or 1)

    # ---- echoed in the response ---------------------------------------------------------
    def echoed(self) -> dict:
        """The request's fields as a Response object repeats them."""
        text = self.text.model_dump(by_alias=True, exclude_none=True) if self.text else {}
        text.setdefault("format", {"type": "text"})
        return {
            "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": None, "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "reasoning": (self.reasoning.model_dump(exclude_none=True)
                          if self.reasoning is not None else None),
            "service_tier": self.service_tier, "store": self.store is not False,
            "text": text, "tool_choice": self.tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in self.function_tools()],
            "top_logprobs": self.top_logprobs or 0, "truncation": self.truncation or "disabled",
            "user": self.user, "metadata": self.metadata or {},
            "prompt_cache_key": self.prompt_cache_key,
            "safety_identifier": self.safety_identifier}


def renamed(err: APIError, grammar_field: str) -> APIError:
    """A refusal from the chat path with the chat fields it names turned into this API's
    (structured_outputs into the field that asked for the grammar)."""
    names = {**RENAMED, "structured_outputs": grammar_field}

    def swap(match: re.Match) -> str:
        return names[match.group(1)]

    param = err.param
    if param is not None:
        head, dot, rest = param.partition(".")
        param = names.get(head, head) + (dot + rest if head not in ("messages",) else "")
    message = err.message.replace("the input messages", "the input")
    return APIError(err.status, _RENAMED_WORDS.sub(swap, message), param=param,
                    code=err.code, headers=err.headers)
