"""N-gram speculative decoding, host side: vLLM's speculative_config and the prompt-lookup
proposer."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.core.spec_decode import propose_ngram


def brute_force(tokens, min_n, max_n, k):
    """The proposer's rule, spelled out with lists."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        hits = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
        if hits:
            full = [i for i in hits if i + n + k <= len(tokens)]
            start = (full[-1] if full else hits[0]) + n
            return tokens[start:start + k]
    return []


def test_the_longest_suffix_match_proposes_what_followed_it():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 3, 9, 9, 4, 2, 3, 8, 1, 2, 3]
    # "1 2 3" (n=3) occurred at 1: 9 9 4 follow; the shorter "2 3" (also at 7) loses
    assert propose_ngram(tokens, 1, 3, 3).tolist() == [9, 9, 4]
    assert propose_ngram(tokens, 1, 2, 3).tolist() == [8, 1, 2]  # "2 3": most recent, at 7
    assert propose_ngram(tokens, 4, 5, 3).tolist() == []  # no 4-gram repeats
    assert propose_ngram([5], 1, 3, 4).tolist() == []
    assert propose_ngram([5, 5], 1, 3, 4).tolist() == [5]  # only one token follows
    assert propose_ngram([5, 5, 5, 5, 5], 1, 1, 3).tolist() == [5, 5, 5]  # the earliest
    assert propose_ngram(np.array([3, 4, 3], np.int32), 1, 2, 8).dtype == np.int32


def test_matches_the_rule_on_random_sequences():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, rng.integers(1, 40)).tolist()
        low = int(rng.integers(1, 4))
        high = low + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        assert propose_ngram(tokens, low, high, k).tolist() == \
            brute_force(tokens, low, high, k), (tokens, low, high, k)


def test_vllms_config_forms_and_defaults():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, '
                                     '"prompt_lookup_max": 3}')
    assert config == SpeculativeConfig(4, "ngram", 3, 3)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}) == \
        SpeculativeConfig(2, "ngram", 5, 5)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "prompt_lookup_min": 2,
                                    "prompt_lookup_max": 4}).prompt_lookup_max == 4
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse(config) is config
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2, "disable_by_batch_size": 16}
                                   ).disable_by_batch_size == 16


@pytest.mark.parametrize("value,error,match", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', ValueError, "method"),
    ('{"method": "ngram"}', ValueError, "num_speculative_tokens"),
    ('{"num_speculative_tokens": 0}', ValueError, "num_speculative_tokens"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     ValueError, "prompt_lookup_min"),
    ('{"num_speculative_tokens": 2, "model": "draft"}', TypeError, "model"),
    ("{not json", ValueError, "JSON"),
    ("[1]", ValueError, "JSON object"),
    ('{"num_speculative_tokens": 2, "disable_by_batch_size": 0}', ValueError,
     "disable_by_batch_size"),
])
def test_bad_configs_say_what_is_wrong(value, error, match):
    with pytest.raises(error, match=match):
        SpeculativeConfig.parse(value)
