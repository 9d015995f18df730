"""Responses API items -> chat messages, as vLLM builds them (construct_input_messages).

An input is a string (one user message) or a list of items: messages (role user, system,
developer or assistant; content a string or input_text / output_text parts), function_call
items (call_id, name, arguments), function_call_output items (call_id, output) and reasoning
items (their reasoning_text content, or summary). A response's own output items are items of
the same kinds, so a stored response's output continues a conversation through the same
translation (previous_response_id).

Consecutive assistant items merge into one assistant message, as vLLM merges them: a
function_call joins the assistant message before it (its tool_calls), a reasoning item
becomes that message's reasoning and an assistant message its content when it has none yet.
Anything else (images, files, audio, refusals, item references, hosted tools' calls,
encrypted reasoning) is refused with a 400 naming the item, never dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError

from jaxserve.server.errors import from_validation_error
from jaxserve.server.schema_base import Body, ParamError

ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
_TEXT_PARTS = ("input_text", "output_text")


class _Part(Body):
    type: str
    text: str | None = None
    annotations: list | None = None  # an output_text part's, sent back: not read
    logprobs: list | None = None  # likewise


class _Message(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Part]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class _FunctionCall(Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class _FunctionCallOutput(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[_Part]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class _ReasoningText(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class _Reasoning(Body):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[_ReasoningText] = Field(default_factory=list)
    content: list[_ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


_MODELS = {"message": _Message, "function_call": _FunctionCall,
           "function_call_output": _FunctionCallOutput, "reasoning": _Reasoning}


def to_messages(items: str | list[Any], field: str = "input") -> list[dict]:
    """The chat messages of an input (or of a stored response's output items)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, raw in enumerate(items):
        item = _parse(raw, f"{field}[{i}]")
        message = _message(item, messages[-1] if messages else None, f"{field}[{i}]")
        if message is not None:
            messages.append(message)
    return messages


def continues_last(items: str | list[Any]) -> bool:
    """Whether the input ends with an assistant message (or reasoning) still in progress
    or cut short: the model continues it instead of opening a new turn (vLLM's
    should_continue_final_message)."""
    if isinstance(items, str) or not items or not isinstance(items[-1], dict):
        return False
    last = items[-1]
    kind = last.get("type", "message")
    if kind == "message" and last.get("role") != "assistant":
        return False
    return kind in ("message", "reasoning") and last.get("status") in ("in_progress",
                                                                        "incomplete")


def _parse(raw, where: str):
    if not isinstance(raw, dict):
        raise ParamError("input", f"{where}: an item must be an object, got "
                         f"{type(raw).__name__}.")
    kind = raw.get("type", "message" if "role" in raw else None)
    model = _MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        shown = repr(kind[:40]) if isinstance(kind, str) else "none"
        raise ParamError("input", f"{where}: items of type {shown} are not supported; this "
                         f"server takes {', '.join(ITEM_KINDS)} items (text only, no hosted "
                         "tools or item references).")
    try:
        item = model.model_validate(raw)
    except ValidationError as err:
        inner = from_validation_error(err)
        raise ParamError("input", f"{where}.{inner.message}") from None
    if isinstance(item, _Reasoning) and item.encrypted_content is not None:
        raise ParamError("input", f"{where}: encrypted_content is not supported (this server "
                         "neither encrypts nor decrypts reasoning); send its content.")
    return item


def _text(parts: str | list[_Part], path: str) -> str:
    """path: where the parts are (input[2].content)."""
    if isinstance(parts, str):
        return parts
    for j, part in enumerate(parts):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise ParamError("input", f"{path}[{j}]: parts of type "
                             f"{part.type[:40]!r} are not supported; this server takes text "
                             f"({' and '.join(_TEXT_PARTS)} parts), not images, files, audio "
                             "or refusals.")
    return "\n".join(part.text for part in parts)


def _message(item, previous: dict | None, where: str) -> dict | None:
    """A new chat message for the item, or None when it merged into `previous`."""
    assistant = previous if previous is not None and previous["role"] == "assistant" else None
    if isinstance(item, _Message):
        text = _text(item.content, f"{where}.content")
        if item.role == "assistant" and assistant is not None and \
                assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": item.role, "content": text}
    if isinstance(item, _FunctionCall):
        call = {"id": item.call_id, "type": "function",
                "function": {"name": item.name, "arguments": item.arguments}}
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if isinstance(item, _FunctionCallOutput):
        output = _text(item.output, f"{where}.output")
        return {"role": "tool", "tool_call_id": item.call_id, "content": output}
    texts = item.content if item.content else item.summary
    reasoning = texts[0].text if texts else ""
    if assistant is not None and assistant.get("reasoning") is None:
        assistant["reasoning"] = reasoning
        return None
    return {"role": "assistant", "content": None, "reasoning": reasoning}
