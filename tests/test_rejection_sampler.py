"""Rejection sampling of certain (n-gram) proposals: kept tokens and the drawn one have
exactly the distribution plain sampling gives; greedy keeps exactly the argmax path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.rejection_sampler import rejection_sample

V, K = 6, 3
SAMPLES = 40_000
# With 40,000 draws a frequency's standard error is at most 0.0025: 0.015 is 6 of them.
TOLERANCE = 0.015

run = jax.jit(rejection_sample)


def distributions(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(V, 0.7), size=K + 1).astype(np.float32)
    p[1, 4] = 0.0  # a token ruled out (top-k, grammar): never drawn
    return p / p.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("seed", [0, 1])
def test_emitted_tokens_follow_the_target_distributions(seed):
    p = distributions(seed)
    draft = np.array([int(np.argsort(p[0])[-2]), 4, int(np.argmax(p[2]))], np.int32)
    rng = np.random.default_rng(100 + seed)
    probs = jnp.broadcast_to(jnp.asarray(p), (SAMPLES, K + 1, V))
    tokens, emitted = run(probs, jnp.broadcast_to(jnp.asarray(draft), (SAMPLES, K)),
                          jnp.full((SAMPLES,), K, jnp.int32),
                          jnp.asarray(rng.random((SAMPLES, K)), jnp.float32),
                          jnp.asarray(rng.random((SAMPLES, K + 1)), jnp.float32),
                          jnp.zeros((SAMPLES,), bool))
    tokens, emitted = np.asarray(tokens), np.asarray(emitted)
    assert ((tokens >= 0).sum(axis=1) == emitted).all()
    # Token i, given that tokens 0..i-1 were the kept proposals, follows p_i.
    prefix = np.ones(SAMPLES, bool)
    for i in range(K + 1):
        chosen = tokens[prefix, i]
        assert (chosen >= 0).all()
        freq = np.bincount(chosen, minlength=V) / len(chosen)
        np.testing.assert_allclose(freq, p[i], atol=TOLERANCE if len(chosen) > 5000 else 0.05)
        assert freq[p[i] == 0].sum() == 0
        if i < K:
            prefix &= tokens[:, i] == draft[i]
            if prefix.sum() < 500:
                break


def test_greedy_keeps_the_argmax_path():
    p = distributions(3)
    best = np.argmax(p, axis=1).astype(np.int32)
    other = (best + 1) % V
    cases = {  # proposals -> (tokens, emitted)
        "all kept": (best[:K], list(best), K + 1),
        "second wrong": (np.array([best[0], other[1], best[2]]), [best[0], best[1], -1, -1], 2),
        "first wrong": (other[:K], [best[0], -1, -1, -1], 1),
    }
    for name, (draft, want, count) in cases.items():
        tokens, emitted = run(jnp.asarray(p)[None], jnp.asarray(draft, jnp.int32)[None],
                              jnp.array([K], jnp.int32), jnp.zeros((1, K)),
                              jnp.zeros((1, K + 1)), jnp.ones((1,), bool))
        assert np.asarray(tokens)[0].tolist() == [int(t) for t in want], name
        assert int(emitted[0]) == count, name


def test_rows_with_fewer_proposals_ignore_the_rest():
    p = distributions(4)
    best = np.argmax(p, axis=1).astype(np.int32)
    draft = jnp.asarray(np.stack([best[:K], best[:K]]), jnp.int32)
    tokens, emitted = run(jnp.broadcast_to(jnp.asarray(p), (2, K + 1, V)), draft,
                          jnp.array([0, 1], jnp.int32), jnp.zeros((2, K)),
                          jnp.zeros((2, K + 1)), jnp.ones((2,), bool))
    assert np.asarray(tokens).tolist() == [[int(best[0]), -1, -1, -1],
                                          [int(best[0]), int(best[1]), -1, -1]]
    assert np.asarray(emitted).tolist() == [1, 2]
