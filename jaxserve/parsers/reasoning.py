"""Reasoning parsers: a model's text -> (reasoning, content), under vLLM's names.

- qwen3: reasoning inside <think>...</think> at the start of the answer; an answer without
  </think> has no reasoning (thinking was off), so it is all content.
- deepseek_r1: the chat template opens <think> itself, so the answer starts inside the
  reasoning: everything before </think> is reasoning, and an answer that never closes it is
  all reasoning.

For streaming, split() of the text so far never moves text from reasoning to content or
back once the end marker has appeared, and holds back a tail that could be the start of a
marker, so the streamed pieces join up to the non-streamed answer.
"""

from __future__ import annotations

from jaxserve.parsers.tools import held_tail

START, END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    opens_inside = False  # the answer starts inside the reasoning (deepseek_r1)
    end_marker = END

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of the text so far; final: the answer is complete."""
        body = text
        stripped = body.lstrip()
        if not final and START.startswith(stripped):
            return None, None  # could still open a <think>: hold it
        if stripped.startswith(START):
            body = stripped[len(START):]
            inside = True
        else:
            inside = self.opens_inside
        at = body.find(END)
        if at >= 0:
            return body[:at], body[at + len(END):]
        if not final:
            keep = len(body) - held_tail(body, END)
            return (body[:keep], None) if inside or self.opens_inside else (None, body)
        if inside or self.opens_inside:
            return (body, None) if self.opens_inside else (None, text)
        return None, text


class Qwen3Parser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    opens_inside = True


PARSERS = {p.name: p for p in (Qwen3Parser, DeepSeekR1Parser)}


def reasoning_parser(name: str) -> ReasoningParser:
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {sorted(PARSERS)}, got {name!r}.")
    return PARSERS[name]()
