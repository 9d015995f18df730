"""Tool calling for chat requests, as OpenAI and vLLM: tools, tool_choice, parallel_tool_calls.

- "required" and a named function are enforced by a grammar (structured outputs), so their
  arguments always parse and fit the function's parameters schema: "required" makes the
  model write a JSON list of {"name", "parameters"} (one item when parallel_tool_calls is
  false), a named function makes it write that function's arguments object.
- "auto" lets the model answer freely; the server's tool-call parser (--tool-call-parser,
  with --enable-auto-tool-choice) reads the calls out of its text.
- "none": no calls (the tools are still shown to the template, as vLLM does).

ChoiceTools turns one choice's text into the message (content, tool_calls) and, streamed,
into OpenAI's deltas: content as it becomes certain, and each call with its id and name once
and its arguments (a named function's arguments stream fragment by fragment).
"""

from __future__ import annotations

import json

from jaxserve.config.request_limits import limit_error
from jaxserve.core.structured_output import StructuredOutputsParams
from jaxserve.parsers.tools import ToolCall, ToolParser, load_json


def check_tool_count(count: int, limits) -> None:
    """The request limit max_tools (limits: RequestLimits): a ValueError naming tools."""
    if count > limits.max_tools:
        raise limit_error("tools", "the number of tools", "max_tools", limits.max_tools, count)


def tool_grammar(mode: str, tools: list[dict], name: str | None,
                 parallel: bool) -> StructuredOutputsParams | None:
    """The grammar that enforces tool_choice "required" or a named function."""
    if mode == "named":
        function = next(t["function"] for t in tools if t["function"]["name"] == name)
        return StructuredOutputsParams(json=_parameters(function))
    if mode != "required":
        return None
    items = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": t["function"]["name"]},
                             "parameters": _parameters(t["function"])}} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


class ChoiceTools:
    """One chat choice under a tool mode ("auto", "required" or "named")."""

    def __init__(self, mode: str, parser: ToolParser | None, name: str | None,
                 parallel: bool) -> None:
        self.mode, self.parser, self.name, self.parallel = mode, parser, name, parallel
        self.sent_content = 0
        self.sent_arguments = 0
        self.named_call: ToolCall | None = None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the assistant message, the finish reason) of a finished choice."""
        content, calls = self._parse(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_openai() for call in calls]
        return message, self._finish(calls, finish_reason)

    def deltas(self, text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The deltas the text so far adds (finish_reason None: more to come), and the
        finish reason to send with the last of them."""
        done = finish_reason is not None
        if self.mode == "named":
            return self._named_deltas(text, done), finish_reason
        out = []
        if not done:
            if self.mode == "auto":
                safe = self.parser.safe_prefix(text)
                if safe > self.sent_content:
                    out.append({"content": text[self.sent_content:safe]})
                    self.sent_content = safe
            return out, None
        content, calls = self._parse(text)
        rest = (content or "")[self.sent_content:]
        if rest:
            out.append({"content": rest})
        for index, call in enumerate(calls):
            out.append({"tool_calls": [{"index": index, **call.as_openai()}]})
        return out, self._finish(calls, finish_reason)

    def _named_deltas(self, text: str, done: bool) -> list[dict]:
        out = []
        if self.named_call is None:
            self.named_call = ToolCall(self.name, "")
            out.append({"tool_calls": [{"index": 0, **self.named_call.as_openai()}]})
        piece = text[self.sent_arguments:]
        if piece:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
            self.sent_arguments = len(text)
        return out

    def _parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "named":
            return None, [ToolCall(self.name, text,
                                   **({"id": self.named_call.id} if self.named_call else {}))]
        if self.mode == "required":
            try:
                items = load_json(text)  # ValueError, not RecursionError, when too deep
                calls = [ToolCall(item["name"], json.dumps(item["parameters"],
                                                           ensure_ascii=False))
                         for item in items]
            except (ValueError, TypeError, KeyError, RecursionError):
                # Cut short by max_tokens (or anything else unreadable): the text, as text.
                return text, []
            return None, calls
        return self.parser.parse(text)

    def _finish(self, calls: list[ToolCall], finish_reason: str | None) -> str | None:
        if calls and finish_reason == "stop" and self.mode != "named":
            return "tool_calls"
        return finish_reason
