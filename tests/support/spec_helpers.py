"""Proposers for testing speculative decoding: they stand in for the n-gram lookup
(jaxserve.core.scheduler.propose_ngram, monkeypatched) so that tests control how many proposals
are kept. A tiny random-weight model rarely repeats itself, so real n-gram proposals are
mostly rejected; these propose a known continuation, partly corrupted, so that verification
keeps some proposals and rejects others."""

from __future__ import annotations

import random

import numpy as np


class KnownContinuations:
    """Proposes the continuation of a known sequence that the tokens so far begin, each
    proposal replaced by a wrong token with probability `corrupt`; nothing when no known
    sequence matches. sequences: full token lists (prompt + output)."""

    def __init__(self, sequences, corrupt: float = 0.3, seed: int = 0, vocab: int = 1024):
        self.sequences = [np.asarray(s, np.int32) for s in sequences]
        self.corrupt = corrupt
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.calls = 0

    def __call__(self, tokens, min_n, max_n, k) -> np.ndarray:
        self.calls += 1
        tokens = np.asarray(tokens)
        for seq in self.sequences:
            if len(seq) > len(tokens) and np.array_equal(seq[: len(tokens)], tokens):
                out = seq[len(tokens): len(tokens) + k].copy()
                for i in range(len(out)):
                    if self.rng.random() < self.corrupt:
                        out[i] = (out[i] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                return out
        return np.zeros(0, np.int32)
