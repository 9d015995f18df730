"""What a caller may hand a chat template, and how its strings are kept from becoming special
tokens.

Only the template's own markup may become special tokens. Before rendering, every string a caller
supplies (anywhere in the messages, keys included, and in the template variables: tools,
documents, chat_template_kwargs) is escaped: each special-token text in it, and a tail that could
begin one (which what the template writes next might complete), is replaced by a marker, a
per-call nonce and an index between two rare brackets. The rendered text is then split at the
special-token texts left (the template's) and the text between them is encoded with special-token
parsing off once the markers are put back (`tokenizer.apply_chat_template`). A call whose
strings hold none of this renders the inputs as they are.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import threading
import weakref

KNOWN_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")

# The tokenizer's special tokens are template variables (transformers passes
# tokenizer.special_tokens_map, and a keyword of the same name overrides it); a caller setting
# one would write its own text where the template writes, say, the BOS token.
# transformers' apply_chat_template arguments that the render call sets itself (or that are
# not template variables): a request may not pass them as template variables.
RENDER_ARGUMENTS = ("conversation", "messages", "chat_template", "tokenize",
                    "add_generation_prompt", "return_dict", "return_tensors", "padding",
                    "truncation", "max_length", "tokenizer_kwargs",
                    "return_assistant_tokens_mask")
SPECIAL_TOKEN_VARIABLES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                           "cls_token", "mask_token", "additional_special_tokens",
                           "extra_special_tokens")

# Printable (Python's repr and tojson keep them, where they escape private-use characters)
# and caseless; the nonce is digits for the same reason.
_MARK_OPEN, _MARK_CLOSE = "\u2e28", "\u2e29"  # ⸨ ⸩


def check_messages(messages) -> None:
    """A list of {'role', 'content'} dicts whose roles are known strings: a role is written into
    the template's markup as it is, so another role could close the turn and open a new one."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts.")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts.")
        role = message["role"]
        if not isinstance(role, str):
            raise ValueError(f"messages: a message's role must be a string, not "
                             f"{type(role).__name__}.")
        if role not in KNOWN_ROLES:
            shown = repr(role) if len(role) <= 64 else repr(role[:64]) + "..."
            raise ValueError(f"messages: role {shown} is not one of {', '.join(KNOWN_ROLES)}.")


def check_template_kwargs(tokenizer, kwargs: dict) -> None:
    """Refuse template variables that would replace the tokenizer's special tokens or
    transformers' own arguments, and `tools` / `documents` that are not lists of objects
    (transformers iterates them before the template runs)."""
    reserved = set(SPECIAL_TOKEN_VARIABLES) | set(getattr(tokenizer, "special_tokens_map", None)
                                                  or ())
    for name in kwargs:
        if name in reserved:
            raise ValueError(f"chat_template_kwargs: {name!r} is one of the tokenizer's "
                             "special-token variables and cannot be set.")
        if name in RENDER_ARGUMENTS:
            raise ValueError(f"chat_template_kwargs: {name!r} is set by the server (an "
                             "argument of the template call, not a template variable).")
    for name in ("tools", "documents"):
        value = kwargs.get(name)
        if value is not None and not (isinstance(value, list)
                                      and all(isinstance(v, dict) for v in value)):
            raise ValueError(f"chat_template_kwargs: {name!r} must be a list of objects, got "
                             f"{type(value).__name__}.")


@dataclasses.dataclass(frozen=True)
class SpecialTexts:
    """A tokenizer's special-token texts and what escaping and splitting at them needs."""

    ids: dict[str, int]            # text -> its token id
    pattern: re.Pattern            # any of the texts, longest first
    prefixes: frozenset[str]       # their proper prefixes: a tail that could begin one
    longest: int                   # characters in the longest text
    lstrip: frozenset[str]         # texts whose token swallows the whitespace before it
    rstrip: frozenset[str]         # ... after it
    size: int                      # len(tokenizer) when these were read

    def open_tail(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of a special text."""
        for k in range(min(len(text), self.longest - 1), 0, -1):
            if text[-k:] in self.prefixes:
                return k
        return 0

    def touches(self, text: str) -> bool:
        """Whether text holds a special text or ends in a beginning of one."""
        return self.pattern.search(text) is not None or self.open_tail(text) > 0


_SPECIALS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SPECIALS_LOCK = threading.Lock()


def special_texts(tokenizer) -> SpecialTexts:
    """The special-token texts (tokenizer.all_special_tokens and the added tokens marked
    special), read once per tokenizer and again when its vocabulary grows."""
    size = len(tokenizer)
    with _SPECIALS_LOCK:
        found = _SPECIALS.get(tokenizer)
    if found is not None and found.size == size:
        return found
    found = _read_special_texts(tokenizer, size)
    with _SPECIALS_LOCK:
        _SPECIALS[tokenizer] = found
    return found


def _read_special_texts(tokenizer, size: int) -> SpecialTexts:
    ids: dict[str, int] = {}
    lstrip, rstrip = set(), set()
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False) and token.content:
            ids[token.content] = token_id
            if getattr(token, "lstrip", False):
                lstrip.add(token.content)
            if getattr(token, "rstrip", False):
                rstrip.add(token.content)
    unk = getattr(tokenizer, "unk_token", None)
    for text in getattr(tokenizer, "all_special_tokens", ()):
        if text and text not in ids:
            token_id = tokenizer.convert_tokens_to_ids(text)
            if isinstance(token_id, int) and (token_id != tokenizer.unk_token_id or text == unk):
                ids[text] = token_id
    texts = sorted(ids, key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, texts)) if texts else "(?!)")
    prefixes = frozenset(t[:k] for t in texts for k in range(1, len(t)))
    return SpecialTexts(ids, pattern, prefixes, max(map(len, texts), default=0),
                        frozenset(lstrip), frozenset(rstrip), size)


class Escaper:
    """One call's markers: escape() replaces special texts in supplied strings by markers,
    restore() puts the original texts back into a piece of the rendered chat."""

    def __init__(self, specials: SpecialTexts):
        self.specials = specials
        self.originals: list[str] = []
        self._nonce = f"{secrets.randbelow(10 ** 12):012d}"
        self._marker = re.compile(re.escape(_MARK_OPEN + self._nonce) + r"(\d+)" + _MARK_CLOSE)

    def needed(self, obj) -> bool:
        return any(self.specials.touches(s) for s in _strings(obj))

    def escape(self, obj):
        """A copy of obj (dicts, lists, tuples: keys and values) with its strings escaped."""
        if isinstance(obj, str):
            return self._escape_string(obj)
        if isinstance(obj, dict):
            return {self.escape(k): self.escape(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.escape(v) for v in obj)
        return obj

    def restore(self, text: str) -> str:
        return self._marker.sub(self._original, text)

    def _escape_string(self, text: str) -> str:
        text = self.specials.pattern.sub(lambda m: self._mark(m.group()), text)
        tail = self.specials.open_tail(text)
        return text[:len(text) - tail] + self._mark(text[len(text) - tail:]) if tail else text

    def _mark(self, original: str) -> str:
        self.originals.append(original)
        return f"{_MARK_OPEN}{self._nonce}{len(self.originals) - 1}{_MARK_CLOSE}"

    def _original(self, match: re.Match) -> str:
        index = int(match.group(1))
        return self.originals[index] if index < len(self.originals) else match.group()


def _strings(obj):
    """Every string in obj, dict keys included, through dicts, lists and tuples."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _strings(value)


def escaped_inputs(tokenizer, messages: list[dict], kwargs: dict
                   ) -> tuple[list[dict], dict, Escaper | None]:
    """messages and kwargs (their values; the names are template variables) with their strings
    escaped, and the escaper to restore the rendered pieces with; (messages, kwargs, None), as
    they came, when no string needs it."""
    kwargs = _tools_as_schemas(kwargs)
    escaper = Escaper(special_texts(tokenizer))
    if not escaper.needed(messages) and not escaper.needed(list(kwargs.values())):
        return messages, kwargs, None
    return (escaper.escape(list(messages)), {k: escaper.escape(v) for k, v in kwargs.items()},
            escaper)


def _tools_as_schemas(kwargs: dict) -> dict:
    """Tools given as Python functions become the JSON schemas transformers would render, so
    their docstrings are escaped like any other string."""
    tools = kwargs.get("tools")
    if not isinstance(tools, (list, tuple)) or all(isinstance(t, dict) for t in tools):
        return kwargs
    from transformers.utils import get_json_schema

    return {**kwargs, "tools": [get_json_schema(t) if callable(t) else t for t in tools]}
