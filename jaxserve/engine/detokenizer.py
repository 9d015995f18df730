"""Incremental detokenization of one request's output tokens, with stop strings.

Each step the engine hands over the newly sampled token ids; this module turns
them into text at a cost that does not grow with the output length, never
emits a broken UTF-8 character, finds stop strings (also ones spanning
several tokens), truncates the text at the first one and, for streaming, holds
back the tail that could still turn into a stop string.

Technique (vLLM's prefix_offset/read_offset): keep a short window of ids whose
start is a point where the text was complete. `window[:read]` was already
emitted (or is left context taken from the end of the prompt, so tokenizers
whose decoding depends on left context, e.g. sentencepiece's leading space,
come out right); decode `window` and `window[:read]`, and the difference is the
new text, of which the part not emitted yet is returned. The window is advanced
(its end becoming the next `window[:read]`) every few tokens, so most tokens
cost one decode. While the window's text ends in U+FFFD (an incomplete multi-byte
sequence) the window is not advanced: the complete characters before it are
emitted and the rest waits for later tokens. A character has at most 4 bytes,
so once more than a few tokens wait the window is advanced anyway, past all
but the last few tokens (their text is final: only the last U+FFFD of a decode
can still become a character), or, failing that, as if complete; otherwise
tokens that never complete a character would make every step decode a growing
window. It uses only `tokenizer.decode`, so any transformers tokenizer (fast or
slow) works.

Host side: plain Python, no jax, no numpy.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

_REPLACEMENT_CHAR = "\ufffd"
# Tokens kept as left context: from the prompt for the first output tokens, and at most
# this many of the emitted ones after advancing (a long run read at once stays out).
_CONTEXT_TOKENS = 5
# Tokens past window[:read] that may wait for an incomplete character before the window
# is advanced anyway; and how many trailing tokens are tried to hold its bytes (a UTF-8
# character has at most 4 bytes, so an incomplete one at most 3, in at most 3 tokens).
_MAX_PENDING_TOKENS = 8
_MAX_INCOMPLETE_TOKENS = 4
# Complete tokens past window[:read] before the window is advanced: until then each new token
# costs one decode (of the window), not two (the window and its new prefix).
_ADVANCE_AFTER_TOKENS = 4


def _validate_stop(stop: Sequence[str]) -> tuple[str, ...]:
    if isinstance(stop, str):
        raise ValueError(f"stop must be a list of strings, not the string {stop!r}; "
                         f"pass [{stop!r}]")
    try:
        stop = tuple(stop)
    except TypeError:
        raise ValueError(f"stop must be a list of strings, got {type(stop).__name__}") from None
    for s in stop:
        if not isinstance(s, str):
            raise ValueError(f"stop strings must be str, got {type(s).__name__}: {s!r}")
        if not s:
            raise ValueError("stop strings must be non-empty; remove the empty string from stop")
        if _REPLACEMENT_CHAR in s:
            # U+FFFD stands for bytes still being completed; a stop on it could never be
            # matched consistently.
            raise ValueError(f"stop string {s!r} contains U+FFFD, which cannot be matched")
    return stop


def _as_token_ids(token_ids: Sequence[int], what: str) -> list[int]:
    try:
        ids = [operator.index(t) for t in token_ids]
    except TypeError:
        raise ValueError(f"{what} must be a sequence of ints, got {token_ids!r}") from None
    if any(t < 0 for t in ids):
        raise ValueError(f"{what} must be non-negative token ids, got {ids!r}")
    return ids


def _fast_decoder(tokenizer, kwargs: dict):
    """The Rust `tokenizers` decode of a fast tokenizer, called directly: it is what
    tokenizer.decode does when no clean-up of spaces is configured, at a quarter of the cost
    of the Python wrapper (this runs twice per generated token). None when not equivalent."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True)
            or set(kwargs) != {"skip_special_tokens"}):
        return None
    skip = kwargs["skip_special_tokens"]
    return functools.partial(backend.decode, skip_special_tokens=skip)  # no Python frame


class IncrementalDetokenizer:
    """Detokenizes one request's output as it grows and checks its stop strings.

    Only `tokenizer.decode(ids, skip_special_tokens=...)` is used (or, for a fast
    tokenizer without space clean-up, the same call on its Rust backend).
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], *,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._stop = _validate_stop(stop)
        self._include_stop = bool(include_stop_str_in_output)
        self._decode_kwargs: dict = {"skip_special_tokens": bool(skip_special_tokens)}
        if not spaces_between_special_tokens:
            # Passed only when not the default: fast tokenizers ignore it, and custom
            # tokenizers' decode may not accept it.
            self._decode_kwargs["spaces_between_special_tokens"] = False
        self._decode_ids = _fast_decoder(tokenizer, self._decode_kwargs) or (
            lambda ids: tokenizer.decode(ids, **self._decode_kwargs))
        # Characters to hold back while streaming. When the stop string is included in
        # the output nothing needs hiding: a match never truncates text already shown.
        self._stop_buffer_length = (
            max(len(s) for s in self._stop) - 1 if self._stop and not self._include_stop else 0)

        self._token_ids: list[int] = []
        self._text = ""
        self._finished = False
        self._streamed = 0  # chars of _text returned by delta get_next_output_text calls

        prompt = _as_token_ids(prompt_token_ids, "prompt_token_ids")
        self._window = prompt[-_CONTEXT_TOKENS:]
        self._read = len(self._window)  # window[:read] is emitted text or context
        self._prefix_text: str | None = None  # decode(window[:read]), computed lazily
        self._pending_chars = 0  # chars of the text past window[:read] already in _text
        # Without stop strings nothing has to be looked at per token: new ids wait here
        # until the text is read, and are then detokenized in one call (the text does not
        # depend on how tokens are grouped). Offline generation reads it once, at the end.
        self._deferred: list[int] = []
        self._deferred_flush = False

    @property
    def output_text(self) -> str:
        """All complete text so far, truncated at a matched stop string.

        Bytes of a character still being completed are not included until later tokens
        complete it or the request finishes (see `get_next_output_text`)."""
        self._materialize()
        return self._text

    @property
    def checks_stop_strings(self) -> bool:
        """Whether it has stop strings: only then must it see each token as it comes (the
        engine feeds the others their tokens when their text is read, in one update)."""
        return bool(self._stop)

    @property
    def num_tokens(self) -> int:
        """Output token ids given so far."""
        return len(self._token_ids)

    @property
    def token_ids(self) -> list[int]:
        """All output token ids given so far (also those past a stop string or a
        stop token). The list is the detokenizer's own: do not mutate it."""
        return self._token_ids

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool,
               check_stop: bool = True) -> str | None:
        """Add newly sampled token ids.

        stop_terminated=True means the last of them is an EOS / stop token id that ends
        the request: unless include_stop_str_in_output, that token is not detokenized.
        check_stop=False detokenizes without looking for stop strings (while the request is
        still below min_tokens, as in vLLM).
        Returns the stop string matched, if any (the request must then finish with
        finish_reason 'stop'), else None. After a match, output_text ends right before
        the stop string (right after it when include_stop_str_in_output).
        """
        return self.extend(_as_token_ids(new_token_ids, "new_token_ids"), stop_terminated,
                           check_stop)

    def extend(self, new: list[int], stop_terminated: bool,
               check_stop: bool = True) -> str | None:
        """update() for a list of ints known to be token ids (the engine's own samples):
        not checked again. The list becomes the detokenizer's."""
        if self._finished:
            raise RuntimeError("update() called on a finished request")
        if stop_terminated and not new:
            raise ValueError("stop_terminated=True needs the stop token as the last new token id")
        self._token_ids.extend(new)
        if stop_terminated:
            self._finished = True
            if not self._include_stop:
                new.pop()
        if not self._stop:
            self._deferred.extend(new)
            self._deferred_flush = stop_terminated
            return None
        offset = len(self._text)
        if new:
            self._text += self._detokenize(new, flush=False)
        if stop_terminated:
            # No later token can complete pending bytes: emit them as the decoder does.
            self._text += self._detokenize([], flush=True)
        return self._check_stop(offset) if check_stop else None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """For streaming: the text that is safe to show.

        Unless finished, the last (longest stop string length - 1) characters are held
        back, since they could still become a stop string. delta=True returns only the
        text not returned by a previous delta=True call; delta=False the full safe text.
        finished=True declares that no more tokens come: bytes of an incomplete character
        are then emitted as U+FFFD, as `tokenizer.decode` would.
        """
        self._materialize()
        if finished and not self._finished:
            self._finished = True
            self._text += self._detokenize([], flush=True)
        safe = len(self._text) if finished else max(len(self._text) - self._stop_buffer_length, 0)
        if not delta:
            return self._text[:safe]
        if safe <= self._streamed:
            return ""
        out = self._text[self._streamed:safe]
        self._streamed = safe
        return out

    def _materialize(self) -> None:
        """Detokenize the deferred ids (see __init__)."""
        if self._deferred:
            ids, self._deferred = self._deferred, []
            self._text += self._detokenize(ids, flush=False)
        if self._deferred_flush:
            self._deferred_flush = False
            self._text += self._detokenize([], flush=True)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids) if ids else ""

    def _detokenize(self, new: list[int], flush: bool) -> str:
        """Appends `new` to the window; returns the text that became complete.

        flush=True also returns the text of incomplete trailing bytes (as U+FFFD)."""
        window = self._window
        window.extend(new)
        if len(window) == self._read:
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(window[:self._read])
        full = self._decode_ids(window)  # not empty: it holds more than window[:read]
        tail = full[len(self._prefix_text):]
        if not tail:
            # These tokens add no text (e.g. skipped special tokens): drop them so the
            # window stays short; the context before them is kept.
            del window[self._read:]
            return ""
        end = advance = len(tail)  # chars of tail that are final / that advancing emits
        split: int | None = len(window)  # advance the window to window[:split]
        if not flush and not tail.endswith(_REPLACEMENT_CHAR) and \
                len(window) - self._read < _ADVANCE_AFTER_TOKENS:
            split = None  # keep window[:read]: its text is reused, one decode per token
        elif not flush and tail.endswith(_REPLACEMENT_CHAR):
            end, split = len(tail.rstrip(_REPLACEMENT_CHAR)), None
            if len(window) - self._read > _MAX_PENDING_TOKENS:
                # Too long to be one character still being completed: keep only the
                # last few tokens waiting (or none), so each step stays short.
                split, advance = self._final_split(full) or (len(window), len(tail))
                end = max(end, advance)
        out = tail[self._pending_chars:end]
        self._pending_chars = max(self._pending_chars, end)
        if split is not None:
            # Advance: what was emitted becomes the left context of the next step; chars
            # of the tokens left waiting that were already emitted stay counted.
            pending = self._pending_chars - advance if split < len(window) else 0
            start = max(self._read, split - _CONTEXT_TOKENS)
            del window[:start]
            self._read = split - start
            self._prefix_text = None
            self._pending_chars = pending
        return out

    def _final_split(self, full: str) -> tuple[int, int] | None:
        """(split, n): window[:split] decodes to a prefix of `full` that later tokens
        cannot change (only a decode's last U+FFFD may become part of a character), and
        n chars of it are past window[:read]. None if no split near the end is one."""
        window, prefix = self._window, len(self._prefix_text)
        for split in range(len(window) - 1,
                           max(self._read, len(window) - _MAX_INCOMPLETE_TOKENS - 1), -1):
            text = self._decode(window[:split])
            if prefix <= len(text) < len(full) and full.startswith(text):
                return split, len(text) - prefix
        return None

    def _check_stop(self, offset: int) -> str | None:
        """Looks for stop strings in the text added after `offset`, plus the overlap a
        stop string straddling `offset` needs. The match that completes first in the
        text wins (ties: the one starting first), so the result does not depend on how
        tokens were grouped into updates."""
        text = self._text
        if not self._stop or len(text) == offset:
            return None
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            start = text.find(s, max(offset - len(s) + 1, 0))
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is None:
            return None
        end, start, s = best
        self._text = text[:end if self._include_stop else start]
        self._finished = True
        return s
