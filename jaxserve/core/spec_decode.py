"""N-gram speculative decoding, host side: the prompt-lookup proposer and its counters (numpy
only); the settings are config/speculative.py.

A sequence's own tokens (prompt and output so far) propose its next ones: find an earlier
place where the last n tokens occurred, and propose the k tokens that followed it there.
The longest n in [prompt_lookup_min, prompt_lookup_max] that matches wins; among matches of
that length the most recent one that k tokens follow (the nearest context predicts best),
else the earliest (the most tokens follow it). The engine then verifies the proposal in one
forward pass and keeps the accepted prefix plus one token.
"""

from __future__ import annotations

import dataclasses

import numpy as np


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
