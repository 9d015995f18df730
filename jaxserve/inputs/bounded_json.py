"""JSON parsed with a bound on its nesting, for every JSON text a request carries.

Python's json module and pydantic both recurse, so a text nested deep enough exhausts the
stack (RecursionError, or worse in native code that walks the result). Request bodies, JSON
schemas sent as strings, tool-call arguments and model output all go through here: nesting
is counted on the raw text first (linear, numpy; brackets inside strings do not count), and
anything over the limit is refused before it is parsed.
"""

from __future__ import annotations

import json
import re

import numpy as np

DEFAULT_MAX_DEPTH = 128  # nested arrays/objects; JSON schemas of tools fit well inside
# A JSON string literal; an unterminated one runs to the end of the text, so that every
# character is scanned once (a pattern that must find the closing quote rescans the rest of
# the text from each quote of a text that has none: quadratic).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.S)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


def depth(raw: bytes | str) -> int:
    """How deep a JSON text nests arrays and objects (brackets inside strings do not count;
    a malformed text counts as deep as a parser could go)."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if raw.count(b"[") + raw.count(b"{") == 0:
        return 0
    codes = np.frombuffer(_STRING.sub(b"", raw), np.uint8)
    steps = np.isin(codes, _OPEN).astype(np.int32) - np.isin(codes, _CLOSE).astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


def too_deep(raw: bytes | str, limit: int = DEFAULT_MAX_DEPTH) -> bool:
    """Whether a JSON text nests arrays and objects deeper than limit."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    return depth(raw) > limit


def reject_constant(name: str):
    """json.loads' parse_constant: NaN and Infinity are not JSON numbers."""
    raise ValueError(f"{name} is not a JSON number")


def loads(text: str | bytes, field: str, limit: int = DEFAULT_MAX_DEPTH):
    """The value of a JSON text a request gave in `field`; ValueError naming the field for
    text that is not JSON, nests deeper than limit, or holds NaN / Infinity."""
    if too_deep(text, limit):
        raise ValueError(f"{field}: the JSON nests arrays/objects deeper than {limit} levels.")
    try:
        return json.loads(text, parse_constant=reject_constant)
    except (ValueError, RecursionError, UnicodeError) as err:
        detail = str(err)[:120] if isinstance(err, ValueError) else type(err).__name__
        raise ValueError(f"{field}: not valid JSON ({detail}).") from None


def check_depth(value, field: str, limit: int = DEFAULT_MAX_DEPTH) -> None:
    """ValueError naming the field when a parsed value (dicts and lists) nests deeper than
    limit; iterative, so any depth is measured without recursing."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if level > limit:
            raise ValueError(f"{field}: nests arrays/objects deeper than {limit} levels.")
        stack.extend((child, level + 1) for child in children)
