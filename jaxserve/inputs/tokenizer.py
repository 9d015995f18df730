"""Tokenizer and chat template, loaded from the model folder through transformers; prompts and
rendered chats encoded without switching the tokenizer that every worker thread shares."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Any

from jaxserve.inputs.chat_template import (
    check_messages,
    check_template_kwargs,
    escaped_inputs,
    special_texts,
)

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

    Only the template's own markup becomes special tokens: a special-token text in any string
    the caller supplies (messages, tools, documents, other template variables) is tokenized as
    plain text (`chat_template.py`). Roles outside chat_template.KNOWN_ROLES and keywords
    that would replace the tokenizer's special-token variables (bos_token, ...) are refused.
    A conversation whose strings hold no special-token text is rendered and encoded in one
    piece, exactly as `tokenizer.apply_chat_template(..., tokenize=True)` does.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("This model's tokenizer has no chat template; pass chat_template= or "
                         "use generate() with a plain prompt.")
    check_messages(messages)
    check_template_kwargs(tokenizer, kwargs)
    messages, kwargs, escaper = escaped_inputs(tokenizer, messages, kwargs)
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    except TemplateError as err:  # the template refused the conversation (raise_exception)
        raise ValueError(f"messages: the chat template refused this conversation: "
                         f"{str(err)[:200]}") from None
    except (TypeError, ValueError) as err:  # a value transformers or the template cannot use
        raise ValueError(f"chat_template_kwargs: the chat template could not use the values "
                         f"given ({type(err).__name__}: {str(err)[:200]}).") from None
    if escaper is None:
        return _encode_many(tokenizer, [text], parse_special=True)[0]
    return tokenize_rendered(tokenizer, text, escaper.restore)


def tokenize_rendered(tokenizer, text: str, restore=None) -> list[int]:
    """Tokenize a rendered chat: the special-token texts in it become their tokens, and the
    text between them, after restore(piece) (the escaped request strings put back), is encoded
    with special-token parsing off. An added token's lstrip / rstrip (it swallows the
    whitespace beside it) is kept, as a one-piece encode would."""
    specials = special_texts(tokenizer)
    pieces: list[str] = []
    tokens: list[int] = []
    cursor, strip_next = 0, False
    for match in specials.pattern.finditer(text):
        piece = text[cursor:match.start()]
        if strip_next:
            piece = piece.lstrip()
        if match.group() in specials.lstrip:
            piece = piece.rstrip()
        pieces.append(piece)
        tokens.append(specials.ids[match.group()])
        cursor, strip_next = match.end(), match.group() in specials.rstrip
    last = text[cursor:]
    pieces.append(last.lstrip() if strip_next else last)
    if restore is not None:
        pieces = [restore(p) for p in pieces]
    encoded = _encode_many(tokenizer, pieces, parse_special=False)
    forged = set(specials.ids.values()).intersection(i for ids in encoded for i in ids)
    if forged:  # a special text the tokenizer matches even with parsing off: fail closed
        raise ValueError("messages: this tokenizer cannot encode the special-token text in the "
                         "request as plain text.")
    ids = list(encoded[0])
    for token, piece_ids in zip(tokens, encoded[1:]):
        ids.append(token)
        ids += piece_ids
    return ids


def encode_prompt(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """tokenizer.encode(text, add_special_tokens=...) for a completion prompt (special-token
    texts parsed, unless the tokenizer is configured with split_special_tokens), with the GIL
    released while the Rust tokenizer runs: a long prompt encoded in a worker thread does
    not stall the event loop."""
    encoders = _rust_encoders(tokenizer) if _plain_fast_class(tokenizer) else None
    if encoders is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    encoder = encoders.plain if getattr(tokenizer, "split_special_tokens", False) \
        else encoders.parse
    return _rust_encode(encoder, [text], add_special_tokens)[0]


def _encode_many(tokenizer, texts: list[str], parse_special: bool) -> list[list[int]]:
    """Each text's ids, without the tokenizer's added BOS/EOS. parse_special: special-token
    texts become their tokens (False: they are plain text, what Hugging Face calls
    split_special_tokens=True). Fast tokenizers encode on private copies of the Rust
    tokenizer, so nothing shared is switched (see _RustEncoders)."""
    encoders = _rust_encoders(tokenizer)
    if encoders is not None:
        encoder = encoders.parse if parse_special else encoders.plain
        nonempty = [t for t in texts if t]
        found = iter(_rust_encode(encoder, nonempty, False) if nonempty else [])
        return [next(found) if t else [] for t in texts]
    return [tokenizer.encode(t, add_special_tokens=False, split_special_tokens=not parse_special)
            if t else [] for t in texts]


@dataclasses.dataclass(frozen=True)
class _RustEncoders:
    """Two private copies of a fast tokenizer's Rust tokenizer, one per special-token mode.
    transformers switches split_special_tokens by setting encode_special_tokens on the one
    Rust tokenizer every thread shares, so a plain-text encode in one thread could flip a
    template encode in another (or fail it: the Rust object is borrowed while it encodes)."""

    parse: Any  # tokenizers.Tokenizer, encode_special_tokens=False
    plain: Any  # encode_special_tokens=True
    size: int   # vocabulary with added tokens when copied: a grown one is copied again


_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENCODERS_LOCK = threading.Lock()


def _rust_encoders(tokenizer) -> _RustEncoders | None:
    """The tokenizer's private Rust copies; None for a slow (Python) tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None) \
        if getattr(tokenizer, "is_fast", False) else None
    if backend is None:
        return None
    size = backend.get_vocab_size(with_added_tokens=True)
    with _ENCODERS_LOCK:
        found = _ENCODERS.get(tokenizer)
        if found is None or found.size != size:
            state = backend.to_str()
            found = _RustEncoders(_rust_copy(state, False), _rust_copy(state, True), size)
            _ENCODERS[tokenizer] = found
    return found


def _rust_copy(state: str, plain: bool):
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(state)
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = plain
    return copy


def _rust_encode(encoder, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """encode_batch releases the GIL while it runs (Tokenizer.encode holds it); the _fast
    variant skips character offsets, which are not needed."""
    batch = getattr(encoder, "encode_batch_fast", None) or encoder.encode_batch
    return [e.ids for e in batch(texts, add_special_tokens=add_special_tokens)]


def _plain_fast_class(tokenizer) -> bool:
    """Whether tokenizer.encode is the generic fast tokenizer's (some model classes add
    steps to it; encode_prompt then calls it)."""
    from transformers import PreTrainedTokenizerFast

    cls = type(tokenizer)
    return isinstance(tokenizer, PreTrainedTokenizerFast) and all(
        getattr(cls, name, None) is getattr(PreTrainedTokenizerFast, name, None)
        for name in ("encode", "encode_plus", "__call__", "_call_one", "_encode_plus",
                     "_batch_encode_plus", "tokenize"))


def with_special_tokens(tokenizer, ids: list[int]) -> list[int]:
    """ids wrapped in the special tokens the tokenizer adds to an encoded text (a BOS for
    Llama-style tokenizers; nothing for many others), as add_special_tokens=True would."""
    probe = "a"
    plain = encode_prompt(tokenizer, probe, add_special_tokens=False)
    wrapped = encode_prompt(tokenizer, probe, add_special_tokens=True)
    for start in range(len(wrapped) - len(plain) + 1):
        if wrapped[start: start + len(plain)] == plain:
            return wrapped[:start] + list(ids) + wrapped[start + len(plain):]
    return list(ids)


def encode_pair(tokenizer, text: str, text_pair: str) -> list[int]:
    """tokenizer(text, text_pair)'s input ids: the pair encoding with the tokenizer's own
    special tokens between and around (a cross-encoder's input), the GIL released while the
    Rust tokenizer runs."""
    encoders = _rust_encoders(tokenizer) if _plain_fast_class(tokenizer) else None
    if encoders is None:
        return list(tokenizer(text, text_pair)["input_ids"])
    encoder = encoders.plain if getattr(tokenizer, "split_special_tokens", False) \
        else encoders.parse
    batch = getattr(encoder, "encode_batch_fast", None) or encoder.encode_batch
    return batch([(text, text_pair)], add_special_tokens=True)[0].ids
