"""N-gram speculative decoding, host side: vLLM's `speculative_config` and the prompt-lookup
proposer (numpy only).

A sequence's own tokens (prompt and output so far) propose its next ones: find an earlier
place where the last n tokens occurred, and propose the k tokens that followed it there.
The longest n in [prompt_lookup_min, prompt_lookup_max] that matches wins; among matches of
that length the most recent one that k tokens follow (the nearest context predicts best),
else the earliest (the most tokens follow it). The engine then verifies the proposal in one
forward pass and keeps the accepted prefix plus one token.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

METHODS = ("ngram",)
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min / _max when neither is given


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config for the n-gram method (`--speculative-config` JSON or
    `LLM(speculative_config={...})`)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    # No proposals in a step while more sequences than this are running (None: always).
    # Where a step is bound by arithmetic (many sequences), verifying costs what decoding
    # does, and speculation only adds the rejected tokens.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)} "
                             f"(prompt lookup), got {self.method!r}; draft models and EAGLE "
                             "are not supported.")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an integer >= 1, got "
                                 f"{value!r}.")
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool)
                                 or size < 1):
            raise ValueError("speculative_config.disable_by_batch_size must be an integer >= 1 "
                             f"(or null), got {size!r}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) "
                             f"must not exceed prompt_lookup_max ({self.prompt_lookup_max}).")

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        """From vLLM's forms: None, a dict, its JSON text, or a SpeculativeConfig. A missing
        lookup bound takes the other's value, both missing are 5 (vLLM's defaults)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config is not valid JSON: {err}.") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object such as "
                             '{"method": "ngram", "num_speculative_tokens": 4}.')
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise TypeError(f"speculative_config got unexpected keys {unknown}; the n-gram "
                            f"method takes {sorted(known)}.")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs num_speculative_tokens (the tokens "
                             "proposed per step).")
        fields = dict(value)
        low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
        fields["prompt_lookup_min"] = low if low is not None else (high or DEFAULT_LOOKUP)
        fields["prompt_lookup_max"] = high if high is not None else (low or DEFAULT_LOOKUP)
        if fields.get("method") is None:
            fields["method"] = "ngram"
        return cls(**fields)


@dataclasses.dataclass
class SpecDecodeStats:
    """Running totals of verified proposals (vLLM's vllm:spec_decode_* series)."""

    num_drafts: int  # rows that verified at least one proposal
    num_draft_tokens: int  # proposals verified
    num_accepted_tokens: int  # of those, kept
    accepted_per_pos: list[int]  # kept proposals by their position 0..K-1
    # drafts that verified position j with 0..j-1 all kept (spec_policy's rates)
    reached_per_pos: list[int]

    @classmethod
    def empty(cls, k: int) -> SpecDecodeStats:
        return cls(0, 0, 0, [0] * k, [0] * k)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_pos[position] += 1
        for position in range(min(proposed, accepted + 1)):
            self.reached_per_pos[position] += 1


def propose_ngram(tokens, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to k tokens that followed an earlier occurrence of the longest suffix of `tokens`
    (an n-gram, min_n <= n <= max_n) that occurs earlier: the most recent occurrence that k
    tokens follow, else the earliest. Empty when no suffix occurs earlier; shorter than k
    when every occurrence is that close to the end."""
    tokens = np.asarray(tokens)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Windows starting at 0 .. length - n - 1: every earlier place the n-gram may sit.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            full = hits[hits + n + k <= length]  # followed by k tokens
            start = int(full[-1] if len(full) else hits[0]) + n
            return tokens[start:start + k].copy()
    return tokens[:0].copy()
