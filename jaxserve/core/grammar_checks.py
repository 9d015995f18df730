"""Structural caps on a structured-output constraint, checked before anything compiles it.

The grammar compiler (llguidance, native code) recurses through JSON-schema references and
grammar rules, and expands counted repetitions: a 100-byte regex such as (a{1000}){1000} or a
3,000-long $ref chain crashes or stalls it. These checks walk the constraint iteratively
(never recursing, whatever its depth) and refuse, naming the field and the limit
(request_limits.py), what is over:
- JSON schemas: nesting with $refs followed (cycles, i.e. recursive schemas, are fine),
  $ref count, node count, anyOf/oneOf/allOf nesting, and each `pattern` as a regex;
- Lark / GBNF / EBNF grammars: rule count, the longest chain of rules referring to one
  another, their /regex/ literals, and %json schemas inside them;
- choices: entry count and bytes;
- regexes: the product of nested counted repetitions ({m}, {m,n}, {m,}), where a lone
  repetition of one character or class counts as 1 ([a-z]{5000} is cheap, (a{100}){100}
  is not).
What passes still compiles in a sandbox process with a time limit (grammar_sandbox.py).
"""

from __future__ import annotations

import json
import re
from urllib.parse import unquote

from jaxserve.config.request_limits import RequestLimits, limit_error
from jaxserve.inputs import bounded_json

_COMBINATORS = ("anyOf", "oneOf", "allOf")
_RULE = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z0-9_\-.]*?)(?:\.-?\d+)?[ \t]*(::=|:)(?!:)",
                   re.M)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_QUOTED = re.compile(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'')
_REGEX_LITERAL = re.compile(r"/((?:[^/\\\n]|\\.)+)/[imslux]*")
_COMMENT = re.compile(r"(?://|#)[^\n]*")


def check_constraint(structured, limits: RequestLimits, field: str):
    """Check a StructuredOutputsParams against the limits; returns it with a JSON schema
    given as text parsed (bounded) into a dict. ValueError naming `field` otherwise."""
    import dataclasses

    kind = structured.kind
    if kind == "json":
        schema = structured.json
        if isinstance(schema, str):
            schema = bounded_json.loads(schema, field)
        if not isinstance(schema, dict):
            raise _error(field, "a JSON schema must be a JSON object.")
        check_schema(schema, limits, field)
        if schema is not structured.json:
            structured = dataclasses.replace(structured, json=schema)
    elif kind == "regex":
        check_regex(structured.regex, limits, field)
    elif kind == "choice":
        check_choices(structured.choice, limits, field)
    elif kind == "grammar":
        check_grammar(structured.grammar, limits, field)
    if structured.whitespace_pattern is not None:
        check_regex(structured.whitespace_pattern, limits, field)
    return structured


def _error(field: str, message: str) -> ValueError:
    err = ValueError(f"{field}: {message}")
    err.param = field
    return err


# ---- JSON schemas --------------------------------------------------------------------------
def check_schema(schema: dict, limits: RequestLimits, field: str) -> None:
    """Depth (with $refs followed), $ref count, node count, combinator nesting, patterns."""
    pointers: dict[str, object] = {}
    memo: dict[int, tuple[int, int]] = {}  # id(node) -> (depth, combinator depth) below it
    on_path: set[int] = set()
    edges: dict[int, list[tuple[object, int]]] = {}
    stack: list[tuple[object, bool]] = [(schema, False)]
    nodes = refs = 0
    while stack:
        node, leaving = stack.pop()
        key = id(node)
        if leaving:
            on_path.discard(key)
            depth = comb = 0
            for child, weight in edges.pop(key):
                below = memo.get(id(child))
                if below is not None:  # None: a reference back up the path (recursion)
                    depth, comb = max(depth, below[0]), max(comb, below[1] + weight)
            memo[key] = (depth + 1, comb)
            continue
        if key in memo or key in on_path:
            continue
        nodes += 1
        if nodes > limits.max_schema_nodes:
            raise limit_error(field, "the JSON schema's objects and arrays",
                              "max_schema_nodes", limits.max_schema_nodes)
        children = _schema_children(node, schema, pointers, limits, field)
        refs += isinstance(node, dict) and isinstance(node.get("$ref"), str)
        if refs > limits.max_schema_refs:
            raise limit_error(field, "the JSON schema's $ref count", "max_schema_refs",
                              limits.max_schema_refs)
        on_path.add(key)
        edges[key] = children
        stack.append((node, True))
        stack.extend((child, False) for child, _ in children
                     if id(child) not in memo and id(child) not in on_path)
    depth, comb = memo[id(schema)]
    if depth > limits.max_schema_depth:
        raise limit_error(field, "the JSON schema's nesting, with its $refs followed",
                          "max_schema_depth", limits.max_schema_depth, depth)
    if comb > limits.max_schema_combinator_depth:
        raise limit_error(field, "anyOf / oneOf / allOf nesting in the JSON schema",
                          "max_schema_combinator_depth", limits.max_schema_combinator_depth,
                          comb)


def _schema_children(node, root: dict, pointers: dict, limits: RequestLimits,
                     field: str) -> list[tuple[object, int]]:
    """(child container, 1 if the edge enters an anyOf/oneOf/allOf else 0) of one node;
    a local $ref is an edge to its target. Checks `pattern` regexes on the way."""
    if isinstance(node, list):
        return [(v, 0) for v in node if isinstance(v, (dict, list))]
    if not isinstance(node, dict):
        return []
    out = [(v, int(k in _COMBINATORS)) for k, v in node.items() if isinstance(v, (dict, list))]
    pattern, named = node.get("pattern"), node.get("patternProperties")
    if isinstance(pattern, str):
        check_regex(pattern, limits, field)
    for name in named if isinstance(named, dict) else ():
        check_regex(name, limits, field)
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = _resolve(ref, root, pointers)
        if isinstance(target, (dict, list)):
            out.append((target, 0))
    return out


def _resolve(ref: str, root: dict, pointers: dict):
    """The object a local JSON pointer ("#/$defs/a") names, or None."""
    if ref in pointers:
        return pointers[ref]
    if ref != "#" and not ref.startswith("#/"):
        pointers[ref] = None  # an anchor ("#name"): not followed
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            node = None
            break
    pointers[ref] = node
    return node


# ---- regexes -------------------------------------------------------------------------------
def check_regex(pattern: str, limits: RequestLimits, field: str) -> None:
    """The product of nested counted repetitions, e.g. (a{10}){20} = 200; a lone repetition
    of one character or class counts as 1 (it stays cheap however long)."""
    worst = _repetition_product(pattern)
    if worst > limits.max_regex_repetition:
        raise limit_error(field, "the product of nested counted repetitions in a regex",
                          "max_regex_repetition", limits.max_regex_repetition, worst)


_COUNT = re.compile(r"\{(\d{1,9})(?:,(\d{0,9}))?\}")


def _repetition_product(pattern: str) -> int:
    """The largest product of counted repetitions along one nesting chain of the pattern."""
    # Per open group: [largest product inside it so far]; the top-level "group" is frames[0].
    frames = [0]
    last: tuple[str, int] | None = None  # the atom a quantifier would apply to: (kind, inner)
    worst, i, n = 0, 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            last, i = ("single", 0), i + 2
            continue
        if c == "[":
            i = _class_end(pattern, i)
            last = ("single", 0)
            continue
        if c == "(":
            frames.append(0)
            last, i = None, i + 1
            continue
        if c == ")" and len(frames) > 1:
            inner = frames.pop()
            frames[-1] = max(frames[-1], inner)
            last, i = ("group", inner), i + 1
            continue
        match = _COUNT.match(pattern, i) if c == "{" else None
        if match and last is not None:
            low, high = match.group(1), match.group(2)
            count = int(high) if high else int(low)
            kind, inner = last
            if kind == "group":
                product = count * max(inner, 1)
                worst = max(worst, product)
            else:
                product = count  # charged only if a counted group encloses it
            frames[-1] = max(frames[-1], product)
            last, i = None, match.end()
            continue
        last, i = ("single", 0), i + 1
    return worst


def _class_end(pattern: str, start: int) -> int:
    """The index just past the character class that opens at pattern[start] ("[")."""
    i = start + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":
        i += 1
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


# ---- choices and grammars --------------------------------------------------------------------
def check_choices(choices, limits: RequestLimits, field: str) -> None:
    if len(choices) > limits.max_choices:
        raise limit_error(field, "the number of choices", "max_choices", limits.max_choices,
                          len(choices))
    size = sum(len(c.encode("utf-8", "surrogatepass")) for c in choices)
    if size > limits.max_choice_bytes:
        raise limit_error(field, "the bytes of all choices", "max_choice_bytes",
                          limits.max_choice_bytes, size)


def check_grammar(text: str, limits: RequestLimits, field: str) -> None:
    """Rule count and rule-reference depth of a Lark / GBNF / EBNF grammar, its /regex/
    literals and its %json schemas."""
    for schema in _embedded_schemas(text, field):
        check_schema(schema, limits, field)
    for literal in _REGEX_LITERAL.finditer(_QUOTED.sub('""', text)):
        check_regex(literal.group(1), limits, field)
    bodies = _rules(text)
    if len(bodies) > limits.max_grammar_rules:
        raise limit_error(field, "the grammar's rule count", "max_grammar_rules",
                          limits.max_grammar_rules, len(bodies))
    depth = _longest_chain({name: {ref for ref in _IDENT.findall(body) if ref in bodies
                                   and ref != name}
                            for name, body in bodies.items()})
    if depth > limits.max_grammar_depth:
        raise limit_error(field, "the chain of grammar rules referring to one another",
                          "max_grammar_depth", limits.max_grammar_depth, depth)


def _embedded_schemas(text: str, field: str) -> list[dict]:
    """The JSON schemas of %json directives in a Lark grammar."""
    out = []
    decoder = json.JSONDecoder()
    for match in re.finditer(r"%json\s*(?=\{)", text):
        start = match.end()
        end = _balanced_end(text, start)
        snippet = text[start:end]
        if bounded_json.too_deep(snippet):
            raise _error(field, f"a %json schema nests deeper than "
                         f"{bounded_json.DEFAULT_MAX_DEPTH} levels.")
        try:
            schema, _ = decoder.raw_decode(snippet)
        except (ValueError, RecursionError):
            continue  # not JSON: the compiler reports it
        if isinstance(schema, dict):
            out.append(schema)
    return out


def _balanced_end(text: str, start: int) -> int:
    """Index just past the JSON object starting at text[start] ("{"), strings skipped."""
    level, i, n = 0, start, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in "{[":
            level += 1
        elif c in "}]":
            level -= 1
            if level == 0:
                return i + 1
        i += 1
    return n


def _rules(text: str) -> dict[str, str]:
    """Rule (and terminal) name -> its body, from the definitions' positions."""
    clean = _COMMENT.sub("", _QUOTED.sub('""', text))
    clean = _REGEX_LITERAL.sub("//", clean)
    matches = list(_RULE.finditer(clean))
    bodies: dict[str, str] = {}
    for here, after in zip(matches, matches[1:] + [None]):
        body = clean[here.end(): after.start() if after else len(clean)]
        bodies[here.group(1)] = bodies.get(here.group(1), "") + " " + body
    return bodies


def _longest_chain(graph: dict[str, set[str]]) -> int:
    """The most rules on one path of references (cycles, i.e. recursion, are cut)."""
    memo: dict[str, int] = {}
    on_path: set[str] = set()
    for root in graph:
        stack = [(root, False)]
        while stack:
            name, leaving = stack.pop()
            if leaving:
                on_path.discard(name)
                memo[name] = 1 + max((memo[r] for r in graph[name] if r in memo), default=0)
                continue
            if name in memo or name in on_path:
                continue
            on_path.add(name)
            stack.append((name, True))
            stack.extend((r, False) for r in graph[name] if r not in memo and r not in on_path)
    return max(memo.values(), default=0)
