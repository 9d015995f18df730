"""Tokenizer and chat template, loaded from the model folder through transformers."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


# Tokenizer classes that are the generic tokenizer.json tokenizer itself: AutoTokenizer would
# resolve them to PreTrainedTokenizerFast, whose import does not pull in torch (transformers'
# auto classes import the modeling stack, seconds of start-up when torch is installed).
_GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(path: str):
    """A local tokenizer; never downloads and never runs code from the folder."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if _tokenizer_class(path) in _GENERIC_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, trust_remote_code=False,
                                             local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"Could not load a tokenizer from {path}: {err}") from None


def _tokenizer_class(path: str) -> str | None:
    """tokenizer_config.json's tokenizer_class, when the folder has both it and the
    tokenizer.json that the generic class reads."""
    folder = Path(path)
    try:
        if not (folder / "tokenizer.json").is_file():
            return None
        return json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def apply_chat_template(tokenizer, messages: list[dict], *, add_generation_prompt: bool = True,
                        chat_template: str | None = None, **kwargs) -> list[int]:
    """Render a conversation with the tokenizer's template and tokenize it.

    Special-token strings inside message contents are tokenized as plain text, so a user
    cannot forge a turn boundary: only the template's own markup becomes special tokens.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("This model's tokenizer has no chat template; pass chat_template= or "
                         "use generate() with a plain prompt.")
    for message in messages:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts.")
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    except TemplateError as err:  # the template refused the conversation (raise_exception)
        raise ValueError(f"messages: the chat template refused this conversation: "
                         f"{str(err)[:200]}") from None
    return tokenize_rendered_chat(tokenizer, text, messages)


def tokenize_rendered_chat(tokenizer, text: str, messages: list[dict]) -> list[int]:
    """Tokenize a rendered chat, treating special-token text that came from message contents
    as plain text: the template's markup is split out, and contents are encoded without
    special-token parsing."""
    contents = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    specials = [t for t in tokenizer.all_special_tokens if t]
    specials += [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                 if getattr(t, "special", False)]
    if not any(s in c for c in contents for s in specials):
        return _encode(tokenizer, text, parse_special=True)
    ids: list[int] = []
    cursor = 0
    for content in contents:
        at = text.find(content, cursor) if content else -1
        if at < 0:
            continue
        ids += _encode(tokenizer, text[cursor:at], parse_special=True)
        ids += _encode(tokenizer, content, parse_special=False)
        cursor = at + len(content)
    ids += _encode(tokenizer, text[cursor:], parse_special=True)
    return ids


def _encode(tokenizer, text: str, parse_special: bool) -> list[int]:
    """parse_special: special-token strings in text become their tokens (False: they are
    encoded as plain text, what Hugging Face calls split_special_tokens=True)."""
    if not text:
        return []
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=not parse_special)


def with_special_tokens(tokenizer, ids: list[int]) -> list[int]:
    """ids wrapped in the special tokens the tokenizer adds to an encoded text (a BOS for
    Llama-style tokenizers; nothing for many others), as add_special_tokens=True would."""
    probe = "a"
    plain = tokenizer.encode(probe, add_special_tokens=False)
    wrapped = tokenizer.encode(probe, add_special_tokens=True)
    for start in range(len(wrapped) - len(plain) + 1):
        if wrapped[start: start + len(plain)] == plain:
            return wrapped[:start] + list(ids) + wrapped[start + len(plain):]
    return list(ids)
