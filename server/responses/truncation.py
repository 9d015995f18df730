"""truncation "auto" of /v1/responses, as OpenAI's: a conversation that does not fit the
context loses whole items from its beginning, never its instructions.

fit keeps the newest messages whose tokens fit a budget and drops the older ones, whole;
only when the newest message does not fit by itself is its text cut from its start (what
the model would have lost to a token-level truncation, minus the instructions). Each
message is tokenized once, on its own, newest first, and none older than the first that
does not fit is tokenized at all: a long stored conversation costs what its kept part
costs. A text longer than the budget could hold (MessageCounter.bound: budget x the
vocabulary's longest entry, twice over) is never tokenized whole: only its last `bound`
characters, which is all that could be kept. The caller renders what fit keeps through the
chat template and, when the template's own tokens make it too long, calls fit again with a
smaller budget (server/responses/serving.py).
"""

from __future__ import annotations

import dataclasses

from jaxserve.inputs.tokenizer import encode_prompt

_FIELDS = ("content", "reasoning")  # a message's texts beside its tool calls


@dataclasses.dataclass(frozen=True)
class Fitted:
    messages: list[dict]  # the conversation kept, oldest first
    dropped: int  # whole messages dropped from the beginning
    cut: bool  # whether the oldest kept message lost the start of its content


def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token can stand for: the length of the vocabulary's
    longest entry (byte-level BPE spells a byte as one character; SentencePiece a character
    as one)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


class MessageCounter:
    """Token counts of chat messages' texts (memoized by message position)."""

    def __init__(self, tokenizer, token_chars: int) -> None:
        self.tokenizer, self.token_chars = tokenizer, max(1, token_chars)
        self._counts: dict[tuple[int, str], int] = {}

    def bound(self, tokens: int) -> int:
        """Characters beyond which a text certainly holds more than `tokens` tokens (twice
        the strict bound: normalizers may merge characters)."""
        return 2 * max(tokens, 1) * self.token_chars

    def encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text, add_special_tokens=False)

    def count(self, index: int, message: dict, budget: int, part: str = "whole"
              ) -> int | None:
        """The tokens of message's texts, or None when they are certainly over `budget`
        (then not tokenized). index and part name what is counted, for the memo."""
        key = (index, part)
        if key in self._counts:
            return self._counts[key]
        texts = message_texts(message)
        if sum(map(len, texts)) > self.bound(budget):
            return None
        count = sum(len(self.encode(text)) for text in texts)
        self._counts[key] = count
        return count

    def tail(self, text: str, tokens: int) -> str:
        """About the last `tokens` tokens of text, as text (at most that many)."""
        if tokens <= 0:
            return ""
        ids = self.encode(text[-self.bound(tokens):])[-tokens:]
        return self.tokenizer.decode(ids).lstrip("\ufffd")  # (a character cut in two)


def fit(messages: list[dict], budget: int, counter: MessageCounter) -> Fitted:
    """The newest messages whose tokens (counter's, without the template's) fit `budget`,
    oldest first; the newest alone cut to fit when it does not. The kept part starts at a
    user message when it holds one (a tool output or an assistant turn whose question was
    dropped does not open it)."""
    kept: list[dict] = []
    room, cut = budget, False
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        count = counter.count(index, message, room)
        if count is not None and count <= room:
            kept.append(message)
            room -= count
            continue
        if not kept:
            shortened = _cut(index, message, room, counter)
            if shortened is not None:
                kept.append(shortened)
                cut = True
        break
    kept.reverse()
    first_user = next((i for i, m in enumerate(kept) if m.get("role") == "user"), 0)
    kept = kept[first_user:]
    return Fitted(kept, len(messages) - len(kept), cut)


def message_texts(message: dict) -> list[str]:
    """A chat message's texts: its content, reasoning and tool calls' names and arguments."""
    texts = [message[f] for f in _FIELDS if isinstance(message.get(f), str)]
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        texts += [function.get("name") or "", function.get("arguments") or ""]
    return texts


def _cut(index: int, message: dict, room: int, counter: MessageCounter) -> dict | None:
    """The message with its content's start dropped so that its texts fit `room` tokens;
    None when nothing of it fits (its other texts alone are too long, or it has no
    content to cut)."""
    content = message.get("content")
    if not isinstance(content, str) or not content:
        return None
    rest = {k: v for k, v in message.items() if k != "content"}
    other = counter.count(index, {**rest, "content": ""}, room, "without content")
    if other is None or other >= room:
        return None
    text = counter.tail(content, room - other)
    return {**message, "content": text} if text else None

