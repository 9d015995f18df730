"""A request's fixed token rules, worked out on the host: logit_bias, allowed_token_ids and
bad_words (vLLM's semantics).

The rules that never change during a request (a bias per token, the allowed set, one-token
bad words) become one bias row of V floats, sent to the device once when the request gets
its sampler row and added to its logits at every step. A bad word of several tokens bans its
last token only while the output ends with the others, so it is checked each step on the
host and travels with the step's banned ids.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.core.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class TokenConstraints:
    bias: dict[int, float]  # token id -> added to its logit (-inf: never sampled)
    allowed: tuple[int, ...] | None  # only these may be sampled (None: any)
    bad_sequences: tuple[tuple[int, ...], ...]  # bad words of two or more tokens

    @classmethod
    def from_params(cls, params: SamplingParams, tokenizer) -> TokenConstraints | None:
        """None when the request sets none of the three fields."""
        if not params.has_logit_bias:
            return None
        bias = {int(t): float(b) for t, b in (params.logit_bias or {}).items()}
        sequences = []
        for ids in bad_word_token_ids(tokenizer, params.bad_words or []):
            if len(ids) == 1:
                bias[ids[0]] = -np.inf
            else:
                sequences.append(tuple(ids))
        allowed = None if params.allowed_token_ids is None else tuple(params.allowed_token_ids)
        return cls(bias, allowed, tuple(dict.fromkeys(sequences)))

    def token_ids(self) -> list[int]:
        """Every token id the rules name (the engine checks them against the vocabulary)."""
        ids = list(self.bias) + list(self.allowed or ())
        return ids + [t for seq in self.bad_sequences for t in seq]

    @property
    def has_row(self) -> bool:
        return bool(self.bias) or self.allowed is not None

    def row(self, vocab: int) -> np.ndarray:
        """f32[V]: what the device adds to this request's logits."""
        row = np.zeros(vocab, np.float32)
        if self.allowed is not None:
            row[:] = -np.inf
            row[list(self.allowed)] = 0.0
        if self.bias:
            ids = np.fromiter(self.bias, np.int64, len(self.bias))
            row[ids] += np.fromiter(self.bias.values(), np.float32, len(self.bias))
        return row

    def banned_next(self, output_ids: np.ndarray) -> list[int]:
        """The last tokens of the multi-token bad words whose other tokens end the output."""
        banned = []
        for seq in self.bad_sequences:
            head = len(seq) - 1
            if len(output_ids) >= head and tuple(output_ids[len(output_ids) - head:].tolist()) \
                    == seq[:-1]:
                banned.append(seq[-1])
        return banned


def bad_word_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids as it would appear first in a text and after a space (two
    spellings for most tokenizers), as vLLM tokenizes them; each distinct spelling once, in
    linear time (the admission path caps how many words there are)."""
    seen: dict[tuple[int, ...], None] = {}
    for word in dict.fromkeys(words):
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                seen.setdefault(ids)
    return [list(ids) for ids in seen]
