"""Verification of certain (n-gram) proposals: drawing each position as plain sampling does and
keeping proposals while they match the draw gives the speculative-sampling law (each proposal
kept with probability p(d), the token after a rejection drawn from p without d), and greedy
rows keep exactly the argmax path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.backends.jax.rejection_sampler import accept_drafts

V, K = 6, 3
SAMPLES = 40_000
# With 40,000 draws a frequency's standard error is at most 0.0025: 0.015 is 6 of them.
TOLERANCE = 0.015



@jax.jit
def run(sampled, draft, num_draft):
    """accept_drafts on rows of K+1 draws (sampled [S, K+1]) and K proposals (draft [S, K],
    num_draft [S] of them used), laid out in the step's slots: row after row, a slot per
    proposal and one for the last token."""
    rows = sampled.shape[0]
    counts = num_draft + 1
    starts = jnp.cumsum(counts) - counts
    j = jnp.arange(K + 1)[None, :]
    slot = jnp.where(j < counts[:, None], starts[:, None] + j, -1)  # [S, K+1]; -1: none
    slots = rows * (K + 1)
    target = jnp.where(slot >= 0, slot, slots)  # out of range: dropped
    flat = lambda x, fill: jnp.full((slots,), fill, x.dtype).at[target.ravel()].set(
        x.ravel(), mode="drop")
    padded = jnp.concatenate([draft, jnp.zeros((rows, 1), draft.dtype)], axis=1)
    has = j < num_draft[:, None]
    row = flat(jnp.broadcast_to(jnp.arange(rows)[:, None], slot.shape), rows - 1)
    return accept_drafts(flat(sampled, 0), flat(padded, 0), flat(has, False), row, starts)


def distributions(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(V, 0.7), size=K + 1)
    p[1, 4] = 0.0  # a token ruled out (top-k, min-p): never drawn
    return p / p.sum(axis=1, keepdims=True)


def inverse_cdf(p: np.ndarray, u: np.ndarray) -> np.ndarray:
    """[SAMPLES, K+1] draws from p (K+1 rows) by inverse CDF, as the sampler draws."""
    cdf = np.cumsum(p, axis=-1)
    return np.minimum((cdf[None, :, :] < u[..., None] * cdf[None, :, -1:]).sum(-1), V - 1)


@pytest.mark.parametrize("seed", [0, 1])
def test_speculative_law(seed):
    """Rejection-sampling law for q = one-hot(d): P(keep d_i | prefix kept) = p_i(d_i); the
    token emitted at the first rejection follows p_i without d_i (renormalised); the bonus
    token after all are kept follows p_K; a proposal with p = 0 is never kept."""
    p = distributions(seed)
    draft = np.array([int(np.argsort(p[0])[-2]), 4, int(np.argmax(p[2]))], np.int32)
    rng = np.random.default_rng(100 + seed)
    sampled = inverse_cdf(p, 1.0 - rng.random((SAMPLES, K + 1))).astype(np.int32)
    emitted = np.asarray(run(jnp.asarray(sampled), jnp.broadcast_to(jnp.asarray(draft),
                                                                       (SAMPLES, K)),
                             jnp.full((SAMPLES,), K, jnp.int32)))
    alive = np.ones(SAMPLES, bool)  # rows whose proposals 0..i-1 were all kept
    for i in range(K + 1):
        n = alive.sum()
        if n < 2000:
            break
        tol = TOLERANCE if n > 20_000 else 6 * np.sqrt(0.25 / n)
        if i == K:  # the bonus token
            assert (emitted[alive] == K + 1).all()
            freq = np.bincount(sampled[alive, K], minlength=V) / n
            np.testing.assert_allclose(freq, p[K], atol=tol)
            break
        kept = emitted[alive] > i + 1
        assert abs(kept.mean() - p[i, draft[i]]) < tol, f"acceptance at {i}"
        rejected = alive.copy()
        rejected[alive] = ~kept
        if rejected.sum() > 2000:
            freq = np.bincount(sampled[rejected, i], minlength=V) / rejected.sum()
            residual = p[i].copy()
            residual[draft[i]] = 0
            np.testing.assert_allclose(freq, residual / residual.sum(),
                                       atol=6 * np.sqrt(0.25 / rejected.sum()))
        alive[alive] = kept
    assert alive.sum() == 0 or p[1, 4] > 0, "a proposal with p = 0 was kept"


def test_greedy_keeps_the_argmax_path():
    p = distributions(3)
    best = np.argmax(p, axis=1).astype(np.int32)
    other = (best + 1) % V
    cases = {"all kept": (best[:K], K + 1),
             "second wrong": (np.array([best[0], other[1], best[2]]), 2),
             "first wrong": (other[:K], 1)}
    for name, (draft, count) in cases.items():
        emitted = run(jnp.asarray(best)[None], jnp.asarray(draft, jnp.int32)[None],
                      jnp.array([K], jnp.int32))
        assert int(emitted[0]) == count, name


def test_rows_with_fewer_proposals_ignore_the_rest():
    best = np.arange(K + 1, dtype=np.int32)
    sampled = jnp.asarray(np.stack([best] * 3))
    draft = jnp.asarray(np.stack([best[:K]] * 3))
    emitted = run(sampled, draft, jnp.array([0, 1, K], jnp.int32))
    assert np.asarray(emitted).tolist() == [1, 2, K + 1]
