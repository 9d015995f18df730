"""Tool-call parsers: a model's text -> (content, tool calls), under vLLM's parser names.

- hermes (Qwen2.5/Qwen3 and many fine-tunes): <tool_call>{"name": ..., "arguments": {...}}
  </tool_call>, any number, after optional content.
- llama3_json (Llama 3.1+): the whole answer is a JSON call {"name": ..., "parameters": {...}}
  (optionally after <|python_tag|>), several separated by ";".
- mistral: [TOOL_CALLS] followed by a JSON list of {"name", "arguments"}, or (newer
  tokenizers) by name[ARGS]{...} pairs.
- phi4_mini_json (Phi-4-mini): functools[ followed by the rest of a JSON list of
  {"name", "arguments"} objects, after optional content.
- pythonic (Gemma 3, Llama 3.2 / Llama 4 with their pythonic templates): the whole answer is
  a Python list of calls with keyword arguments, [get_weather(city="Paris"), now()],
  optionally between <|python_start|> and <|python_end|>; the arguments are Python literals
  (strings, numbers, True/False/None, lists, dicts), read without evaluating anything.
- deepseek_v3 (DeepSeek-V3, R1): <｜tool▁calls▁begin｜>, then per call
  <｜tool▁call▁begin｜>function<｜tool▁sep｜>name, a ```json fenced arguments object and
  <｜tool▁call▁end｜>; <｜tool▁calls▁end｜> closes the section.
- deepseek_v31 (DeepSeek-V3.1): the same section, each call
  <｜tool▁call▁begin｜>name<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>.
- kimi_k2 (Kimi K2): <|tool_calls_section_begin|>, then per call
  <|tool_call_begin|>functions.name:index<|tool_call_argument_begin|>{arguments}
  <|tool_call_end|>, and <|tool_calls_section_end|>; the call keeps "functions.name:index"
  as its id, which Kimi's chat template writes back with the tool's result.

A call that does not parse is left in the content, as text: whatever the model wrote (JSON
nested thousands deep included), parsing never raises. For streaming, safe_prefix says
how much of the text so far is certainly content (it never changes once sent); the calls
are read from the whole text when it ends, so the streamed pieces join up to exactly the
non-streamed answer.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import uuid

from jaxserve.inputs import bounded_json

# What reading a model's text can raise: it is then content, never a failed response
# (SyntaxError: Python's parser on text that is not a call list, or nests past its limit).
_PARSE_ERRORS = (ValueError, RecursionError, TypeError, SyntaxError, MemoryError)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def load_json(text: str):
    """json.loads of model text; ValueError when it is not JSON or nests deeper than
    bounded_json's limit (never RecursionError)."""
    return bounded_json.loads(text, "model output")


def _call(obj, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = load_json(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def held_tail(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker (text a stream
    must hold back: it may still become the marker)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolParser:
    name = ""
    keeps_special_tokens = False  # its markers are special tokens: decode with them kept

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer; (text, []) when its calls cannot be read."""
        try:
            return self._parse(text)
        except _PARSE_ERRORS:
            return text, []

    def _parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def safe_prefix(self, text: str) -> int:
        raise NotImplementedError


class _MarkerParser(ToolParser):
    """Content, then calls after a marker."""

    marker = ""
    other_markers: tuple[str, ...] = ()  # spellings that open the calls too (as marker)

    def _find(self, text: str) -> int:
        """Where the first marker (of any spelling) starts, or -1."""
        found = [at for at in map(text.find, (self.marker, *self.other_markers)) if at >= 0]
        return min(found, default=-1)

    def safe_prefix(self, text: str) -> int:
        at = self._find(text)
        if at >= 0:
            return at
        return len(text) - max(held_tail(text, m) for m in (self.marker, *self.other_markers))

    def _parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        at = self._find(text)
        if at < 0:
            return text, []
        calls = self._calls(self._normal(text[at:]))
        if calls is None:
            return text, []  # malformed: all of it stays text
        return (text[:at] or None), calls

    def _calls(self, region: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def _normal(self, region: str) -> str:
        """The calls' region (from the first marker on) in the parser's main spelling."""
        return region


class HermesParser(_MarkerParser):
    name = "hermes"
    marker = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>|<tool_call>\s*(.*)\s*$", re.S)

    def _calls(self, region: str) -> list[ToolCall] | None:
        calls, end = [], 0
        for match in self._BLOCK.finditer(region):
            if region[end:match.start()].strip():
                return None  # text between calls: not a clean list of calls
            body = match.group(1) if match.group(1) is not None else match.group(2)
            try:
                call = _call(load_json(body), "arguments")
            except ValueError:
                return None
            if call is None:
                return None
            calls.append(call)
            end = match.end()
        if region[end:].strip() or not calls:
            return None
        return calls


class MistralParser(_MarkerParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def _calls(self, region: str) -> list[ToolCall] | None:
        body = region[len(self.marker):].strip()
        if "[ARGS]" in body:  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
            calls = []
            for part in body.split(self.marker):
                name, sep, args = part.strip().partition("[ARGS]")
                if not sep:
                    return None
                try:
                    call = _call({"name": name.strip(), "arguments": load_json(args)},
                                 "arguments")
                except ValueError:
                    return None
                if call is None:
                    return None
                calls.append(call)
            return calls
        try:
            items = load_json(body)
        except ValueError:
            return None
        items = items if isinstance(items, list) else [items]
        calls = [_call(item, "arguments") for item in items]
        return None if not calls or None in calls else calls


class Phi4MiniJsonParser(_MarkerParser):
    name = "phi4_mini_json"
    marker = "functools["

    def _calls(self, region: str) -> list[ToolCall] | None:
        try:
            items = load_json(region[len("functools"):].strip())  # the "[...]" list
        except ValueError:
            return None
        if not isinstance(items, list):
            return None
        calls = [_call(item, "arguments") for item in items]
        return None if not calls or None in calls else calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    _TAG = "<|python_tag|>"

    def _body(self, text: str) -> str | None:
        """The call text when the answer is a call (starts with { or the python tag)."""
        stripped = text.lstrip()
        if stripped.startswith(self._TAG):
            return stripped[len(self._TAG):]
        return stripped if stripped.startswith("{") else None

    def safe_prefix(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self._TAG.startswith(stripped) or self._body(text) is not None:
            return 0  # could still be (or is) a call: hold it
        return len(text)

    def _parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = self._body(text)
        if body is None or bounded_json.too_deep(body):  # raw_decode below recurses like json.loads
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        rest = body.strip()
        while rest:
            try:
                obj, end = decoder.raw_decode(rest)
            except ValueError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            rest = rest[end:].strip()
            if rest.startswith(";"):
                rest = rest[1:].strip()
            elif rest:
                return text, []
        return (None, calls) if calls else (text, [])


class PythonicParser(ToolParser):
    name = "pythonic"
    _START, _END = "<|python_start|>", "<|python_end|>"
    _MAX_CHARS = 200_000  # longer text is content (ast.parse's memory grows with it)

    def _body(self, text: str) -> str | None:
        stripped = text.strip()
        if stripped.startswith(self._START):
            stripped = stripped[len(self._START):].replace(self._END, "").strip()
        return stripped if stripped.startswith("[") else None

    def safe_prefix(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or self._START.startswith(stripped) or self._body(text) is not None:
            return 0  # could still be (or is) a call list: hold it
        return len(text)

    def _parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = self._body(text)
        if body is None or len(body) > self._MAX_CHARS:
            return text, []
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) \
                    or node.args or any(k.arg is None for k in node.keywords):
                return text, []  # only name(keyword=literal, ...)
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            # (allow_nan=False: 1e999 is inf, which JSON cannot hold; sets, bytes and complex
            # numbers raise TypeError: all of them make the text content)
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False,
                                                           allow_nan=False)))
        return None, calls


class _SectionParser(_MarkerParser):
    """Content, then a section of calls between marker and end (the end may be missing when
    the answer stops right after the last call), each call matched whole by _CALL at its
    place; whitespace between calls only."""

    keeps_special_tokens = True
    end = ""
    _CALL: re.Pattern

    def _calls(self, region: str) -> list[ToolCall] | None:
        calls, at = [], len(self.marker)
        while True:
            match = self._CALL.match(region, at)
            if match is None:
                break
            call = self._read(match)
            if call is None:
                return None
            calls.append(call)
            at = match.end()
        rest = region[at:].strip()
        if rest.startswith(self.end):
            rest = rest[len(self.end):].strip()
        return calls if calls and not rest else None

    def _read(self, match: re.Match) -> ToolCall | None:
        raise NotImplementedError

    @staticmethod
    def _arguments(name: str, args: str) -> ToolCall | None:
        try:
            return _call({"name": name.strip(), "arguments": load_json(args)}, "arguments")
        except ValueError:
            return None


class DeepSeekV3Parser(_SectionParser):
    name = "deepseek_v3"
    marker, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    _CALL = re.compile(r"\s*<｜tool▁call▁begin｜>(?P<type>[^<\n]*)<｜tool▁sep｜>(?P<name>[^\n<]*)"
                       r"\n```json\n(?P<args>.*?)\n```\s*<｜tool▁call▁end｜>", re.S)

    def _read(self, match: re.Match) -> ToolCall | None:
        if match["type"].strip() != "function":
            return None
        return self._arguments(match["name"], match["args"])


class DeepSeekV31Parser(DeepSeekV3Parser):
    """V3's section; each call the name, then its arguments object, unfenced."""

    name = "deepseek_v31"
    _CALL = re.compile(r"\s*<｜tool▁call▁begin｜>(?P<name>[^<]*)<｜tool▁sep｜>(?P<args>.*?)"
                       r"<｜tool▁call▁end｜>", re.S)

    def _read(self, match: re.Match) -> ToolCall | None:
        return self._arguments(match["name"], match["args"])


class KimiK2Parser(_SectionParser):
    """Kimi K2 writes the section markers in the plural (its template's) or, at times, the
    singular; both open and close a section."""

    name = "kimi_k2"
    marker, end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    other_markers = ("<|tool_call_section_begin|>",)
    _CALL = re.compile(r"\s*<\|tool_call_begin\|>(?P<id>[^<]*)"
                       r"<\|tool_call_argument_begin\|>(?P<args>.*?)<\|tool_call_end\|>", re.S)
    _ID = re.compile(r"(?:functions\.)?(?P<name>\S+):\d+")

    def _normal(self, region: str) -> str:
        return region.replace(self.other_markers[0], self.marker).replace(
            "<|tool_call_section_end|>", self.end)

    def _read(self, match: re.Match) -> ToolCall | None:
        tool_id = match["id"].strip()
        parsed = self._ID.fullmatch(tool_id)
        call = parsed and self._arguments(parsed["name"], match["args"])
        return dataclasses.replace(call, id=tool_id) if call else None


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser,
                               Phi4MiniJsonParser, DeepSeekV3Parser, DeepSeekV31Parser,
                               KimiK2Parser)}


def tool_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {sorted(PARSERS)}, got {name!r}.")
    return PARSERS[name]()
