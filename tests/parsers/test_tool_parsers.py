"""Tool-call parsers on crafted model outputs: text only, text and calls, several calls,
malformed calls left as text; streamed at every split position, the pieces join up to the
non-streamed answer."""

from __future__ import annotations

import json

import pytest

from jaxserve.inputs.bounded_json import DEFAULT_MAX_DEPTH as MAX_JSON_DEPTH
from jaxserve.parsers.tools import PARSERS, tool_parser
from jaxserve.server.openai.tool_calls import ChoiceTools

CASES = {
    "hermes": [
        ("Just text, no call.", "Just text, no call.", []),
        ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
         "</tool_call>", "Let me look.\n", [("get_weather", {"city": "Paris"})]),
        ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b",'
         ' "arguments": {}}</tool_call>', None, [("a", {"x": 1}), ("b", {})]),
        ('<tool_call>{"name": "a", "arguments": {"x": </tool_call>', None, None),  # malformed
        ("a < b <tool", "a < b <tool", []),  # a marker's start that never completes
    ],
    "llama3_json": [
        ("The answer is 4.", "The answer is 4.", []),
        ('{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [("add", {"a": 1, "b": 2})]),
        ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"q": "x"}}',
         None, [("a", {}), ("b", {"q": "x"})]),
        ('{"name": "add", "parameters": {"a": 1', None, None),  # malformed
        ("{not json at all}", None, None),
    ],
    "mistral": [
        ("Plain answer.", "Plain answer.", []),
        ('Sure. [TOOL_CALLS][{"name": "f", "arguments": {"k": [1, 2]}}]', "Sure. ",
         [("f", {"k": [1, 2]})]),
        ('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"z": 0}}]',
         None, [("f", {}), ("g", {"z": 0})]),
        ('[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', None, [("f", {"a": 1}), ("g", {})]),
        ("[TOOL_CALLS][{broken", None, None),
    ],
    "phi4_mini_json": [
        ("No tools needed.", "No tools needed.", []),
        ('functools[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', None,
         [("get_weather", {"city": "Oslo"})]),
        ('Checking. functools[{"name": "a", "arguments": {}}, {"name": "b", "arguments": '
         '{"n": 2}}]', "Checking. ", [("a", {}), ("b", {"n": 2})]),
        ('functools[{"name": "a", "arguments": {"x": 1}', None, None),  # malformed
        ("func tools [x]", "func tools [x]", []),
    ],
    "pythonic": [  # Gemma 3 / Llama 3.2 pythonic outputs
        ("It is sunny in Paris.", "It is sunny in Paris.", []),
        ('[get_weather(city="San Francisco", unit="celsius")]', None,
         [("get_weather", {"city": "San Francisco", "unit": "celsius"})]),
        ("[search(query='jax paged attention', top_k=3, exact=False), now()]", None,
         [("search", {"query": "jax paged attention", "top_k": 3, "exact": False}),
          ("now", {})]),
        ('<|python_start|>[book(seats=[1, 2], meta={"vip": None})]<|python_end|>', None,
         [("book", {"seats": [1, 2], "meta": {"vip": None}})]),
        ("[get_weather(city=__import__('os').getcwd())]", None, None),  # not a literal
        ("[f(1, 2)]", None, None),  # positional arguments: not a call this format writes
        ("[f(x=1e999)]", None, None),  # inf: not JSON
        ("[f(x={1, 2})]", None, None),  # a set: not JSON
        ("[1, 2, 3] are the numbers.", None, None),
    ],
    "deepseek_v3": [
        ("No call here.", "No call here.", []),
        ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
         'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>'
         "function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
         "Let me check.", [("get_weather", {"city": "Paris"}), ("now", {})]),
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
         '{"x": [1, 2]}\n```<｜tool▁call▁end｜>', None, [("f", {"x": [1, 2]})]),  # no end
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
         '{"x": \n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None, None),  # malformed
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>retrieval<｜tool▁sep｜>f\n```json\n{}\n```"
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, None),  # not a function
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{}\n```"
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜> and then text", None, None),
    ],
    "deepseek_v31": [
        ("Plain.", "Plain.", []),
        ('Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": '
         '"Oslo"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜>'
         "<｜tool▁calls▁end｜>", "Sure.", [("get_weather", {"city": "Oslo"}), ("now", {})]),
        ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": <｜tool▁call▁end｜>',
         None, None),  # malformed
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>[1]<｜tool▁call▁end｜>",
         None, None),  # arguments that are not an object
    ],
    "kimi_k2": [
        ("Nothing to call.", "Nothing to call.", []),
        ("OK <|tool_calls_section_begin|> <|tool_call_begin|>functions.get_weather:0 "
         '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>'
         "functions.now:1<|tool_call_argument_begin|>{}<|tool_call_end|> "
         "<|tool_calls_section_end|>", "OK ", [("get_weather", {"city": "Paris"}), ("now", {})]),
        ("<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
         '{"q": <|tool_call_end|><|tool_calls_section_end|>', None, None),  # malformed
        ("<|tool_calls_section_begin|><|tool_call_begin|>not an id<|tool_call_argument_begin|>"
         "{}<|tool_call_end|><|tool_calls_section_end|>", None, None),
        ("Hm.<|tool_call_section_begin|><|tool_call_begin|>functions.ns:get-time:2"
         '<|tool_call_argument_begin|>{"tz": "UTC"}<|tool_call_end|><|tool_call_section_end|>',
         "Hm.", [("ns:get-time", {"tz": "UTC"})]),  # the singular markers; ":" in a name
        ("<|tool_calls_section_begin|><|tool_call_begin|>" + " " * 5000 + "<|tool_call_end|>",
         None, None),  # a long run of whitespace: content, at once
    ],
}


def _cases():
    for name, cases in CASES.items():
        for i, case in enumerate(cases):
            yield pytest.param(name, *case, id=f"{name}-{i}")


@pytest.mark.parametrize("name, text, content, calls", list(_cases()))
def test_parse_and_stream_at_every_split(name, text, content, calls):
    parser = tool_parser(name)
    got_content, got_calls = parser.parse(text)
    if calls is None:  # malformed: the whole text stays content, no call
        assert (got_content, got_calls) == (text, [])
    else:
        assert got_content == content
        assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for split in range(len(text) + 1):
        streamed = ""
        for piece in (text[:split], text):  # the text so far, at two moments
            safe = parser.safe_prefix(piece)
            assert piece[:safe].startswith(streamed), (split, piece, safe)
            streamed = piece[:safe]
        final_content, _ = parser.parse(text)
        assert (final_content or "").startswith(streamed), (split, streamed)


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="tool-call-parser"):
        tool_parser("nope")


DEEP = "[" * 5000 + "]" * 5000  # json.loads raises RecursionError on it
DEEP_CALLS = {
    "hermes": ['<tool_call>{"name": "f", "arguments": ' + DEEP + "}</tool_call>",
               'Hi <tool_call>{"name": "f", "arguments": {"x": ' + DEEP + "}}</tool_call>",
               '<tool_call>{"name": "f", "arguments": ' + json.dumps(DEEP) + "}</tool_call>"],
    "llama3_json": ['{"name": "f", "parameters": ' + DEEP + "}",
                    '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": '
                    '{"x": ' + DEEP + "}}"],
    "mistral": ['[TOOL_CALLS][{"name": "f", "arguments": ' + DEEP + "}]",
                "[TOOL_CALLS]" + DEEP,
                '[TOOL_CALLS]f[ARGS]{"x": ' + DEEP + "}"],
    "phi4_mini_json": ['functools[{"name": "f", "arguments": ' + DEEP + "}]",
                       "functools" + DEEP],
    "pythonic": ["[f(x=" + DEEP + ")]", DEEP, "[f(x=" + "(" * 5000 + ")" * 5000 + ")]",
                 "[f(x=" + "9" * 10_000 + ")]"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
                    + DEEP + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"],
    "deepseek_v31": ['<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"x": ' + DEEP
                     + "}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"],
    "kimi_k2": ["<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                "<|tool_call_argument_begin|>" + DEEP + "<|tool_call_end|>"],
}


def test_kimi_k2_calls_keep_their_ids():
    """Kimi K2's template writes a tool's result back under the call's own id."""
    text = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3"
            '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|>'
            "<|tool_calls_section_end|>")
    _, calls = tool_parser("kimi_k2").parse(text)
    assert [c.as_openai()["id"] for c in calls] == ["functions.get_weather:3"]


def test_every_parser_has_deep_cases():
    assert set(DEEP_CALLS) == set(PARSERS)


@pytest.mark.parametrize("name, text", [pytest.param(name, text, id=f"{name}-{i}")
                                        for name, texts in DEEP_CALLS.items()
                                        for i, text in enumerate(texts)])
def test_deeply_nested_json_is_content_not_an_error(name, text):
    """Model text can nest JSON thousands deep: it is not a call (the whole text is content),
    and neither parsing nor streaming raises."""
    parser = tool_parser(name)
    assert parser.parse(text) == (text, [])
    for cut in (len(text) // 2, len(text)):
        assert 0 <= parser.safe_prefix(text[:cut]) <= cut


def test_json_nested_up_to_the_limit_still_parses():
    def hermes(depth):  # the call object and its arguments object count as two levels
        inner = "[" * (depth - 2) + "]" * (depth - 2)
        return '<tool_call>{"name": "f", "arguments": {"x": ' + inner + "}}</tool_call>"

    content, calls = tool_parser("hermes").parse(hermes(MAX_JSON_DEPTH))
    assert content is None and [c.name for c in calls] == ["f"]
    assert tool_parser("hermes").parse(hermes(MAX_JSON_DEPTH + 1)) == (hermes(MAX_JSON_DEPTH + 1),
                                                                      [])
    # Brackets inside strings (escaped quotes included) are not nesting.
    args = {"s": '\\"' + "[" * 500 + "{" * 500}
    text = '<tool_call>{"name": "f", "arguments": ' + json.dumps(args) + "}</tool_call>"
    content, calls = tool_parser("hermes").parse(text)
    assert content is None and json.loads(calls[0].arguments) == args


def test_required_mode_with_deeply_nested_text_is_content():
    text = '[{"name": "f", "parameters": ' + DEEP + "}]"
    message, finish = ChoiceTools("required", None, None, True).message(text, "stop")
    assert message == {"role": "assistant", "content": text}
    assert finish == "stop"
    deltas, finish = ChoiceTools("required", None, None, True).deltas(text, "stop")
    assert deltas == [{"content": text}] and finish == "stop"
