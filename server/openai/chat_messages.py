"""Chat messages and tools as OpenAI and vLLM take them, and how a chat template sees them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from jaxserve.inputs import bounded_json
from jaxserve.server.schema_base import Body, ParamError


class TextPart(Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(Body):
    name: str
    arguments: str | dict = "{}"


class ToolCall(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Body):
    """A message as OpenAI and vLLM take it; what a chat template may read is passed on
    (name, tool_call_id, tool_calls with their arguments as objects, reasoning)."""

    role: str = Field(min_length=1, max_length=64)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None  # vLLM's older name for reasoning
    tools: list[dict] | None = None  # a developer message's tools

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content):
        """Images, audio and files are refused by the part's type (every model jaxserve
        serves reads text: Gemma 3's vision tower is not loaded), not as a bad string."""
        if isinstance(content, list):
            for i, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind is not None and kind != "text":
                    raise ValueError(f"content part {i} has type {str(kind)[:40]!r}: only "
                                     "text parts are supported (jaxserve serves text, not "
                                     "images, audio or files)")
        return content

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def as_template_message(self) -> dict:
        message: dict[str, Any] = {"role": self.role, "content": self.text}
        for name in ("name", "tool_call_id", "tools"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = reasoning
        if self.tool_calls is not None:
            message["tool_calls"] = [_template_tool_call(call, i)
                                     for i, call in enumerate(self.tool_calls)]
        return message


def _template_tool_call(call: ToolCall, index: int) -> dict:
    """Chat templates read a call's arguments as an object (vLLM parses the JSON string)."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:  # JSON inside a string: the body's depth bound applies to it too
            arguments = bounded_json.loads(arguments, f"tool_calls[{index}].function."
                                           "arguments") if arguments.strip() else {}
        except ValueError as err:
            raise ParamError("messages", f"messages: {err}") from None
    out = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        out["id"] = call.id
    return out


class FunctionDefinition(Body):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ChatTool(Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"] = "function"
    function: NamedFunction
