"""Reasoning parsers on crafted outputs, whole and streamed at every split position."""

from __future__ import annotations

import pytest

from jaxserve.parsers.reasoning import reasoning_parser

CASES = [
    ("qwen3", "<think>Let me add.</think>The sum is 4.", "Let me add.", "The sum is 4."),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<think>\n\n</think>\n\nDirect.", "\n\n", "\n\nDirect."),
    ("deepseek_r1", "First 2+2.</think>It is 4.", "First 2+2.", "It is 4."),
    ("deepseek_r1", "<think>x</think>y", "x", "y"),
    ("deepseek_r1", "Still thinking when cut off", "Still thinking when cut off", None),
]


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_split_whole_and_streamed(name, text, reasoning, content):
    parser = reasoning_parser(name)
    assert parser.split(text, final=True) == (reasoning, content)
    for cut in range(len(text) + 1):
        sent_r = sent_c = ""
        for piece, final in ((text[:cut], False), (text, True)):
            r, c = parser.split(piece, final)
            r, c = r or "", c or ""
            assert r.startswith(sent_r) and c.startswith(sent_c), (cut, piece)
            sent_r, sent_c = r, c
        assert (sent_r, sent_c) == (reasoning or "", content or "")


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning-parser"):
        reasoning_parser("nope")
