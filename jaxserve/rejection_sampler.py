"""Rejection sampling for speculative decoding with proposals that are certain (n-gram
lookups): which proposed tokens a step keeps, and the one token it adds after them.

Shape letters: S sequences, K proposed tokens at most, V vocabulary.

For proposal d_i at position i, with the target distribution p_i (after every sampling
stage: bias, penalties, temperature, top-k/top-p, min-p, grammar), a deterministic proposer
has q_i = one-hot(d_i), so the speculative-sampling rule (Leviathan et al. 2023; Chen et al.
2023) becomes: keep d_i with probability p_i(d_i); at the first rejection draw from p_i with
d_i removed (max(p_i - q_i, 0), renormalised); when every proposal is kept, draw the bonus
token from p_K. Each emitted token then has exactly the distribution plain sampling gives it.
Greedy rows keep d_i while it is p_i's argmax and emit the argmax at the first mismatch, so
greedy output equals non-speculative greedy output token for token.

The caller supplies the uniforms (one per proposal for acceptance, one per position for the
draw), drawn from each request's seed and position, so a seeded request is reproducible in
any batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rejection_sample(probs: jax.Array, draft: jax.Array, num_draft: jax.Array,
                     accept_u: jax.Array, draw_u: jax.Array, greedy: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """probs [S, K+1, V] float32 (target distributions after the proposals' prefixes),
    draft [S, K] int32, num_draft [S] int32 (0..K; entries past it are ignored),
    accept_u [S, K] and draw_u [S, K+1] uniforms in [0, 1), greedy [S] bool.
    Returns (tokens [S, K+1] int32: the kept proposals, then the drawn token, then -1;
    num_emitted [S] int32: kept proposals + 1)."""
    S, K1, V = probs.shape
    K = K1 - 1
    rows = jnp.arange(S)
    argmax = jnp.argmax(probs, axis=-1).astype(jnp.int32)  # [S, K+1]
    if K:
        p_draft = jnp.take_along_axis(probs[:, :K], draft[..., None], axis=-1)[..., 0]
        kept = jnp.where(greedy[:, None], argmax[:, :K] == draft, accept_u < p_draft)
        kept &= jnp.arange(K)[None, :] < num_draft[:, None]
        num_kept = jnp.sum(jnp.cumprod(kept.astype(jnp.int32), axis=1), axis=1)  # [S]
        rejected = num_kept < num_draft
        refused = draft[rows, jnp.minimum(num_kept, K - 1)]  # the rejected proposal
    else:
        num_kept = jnp.zeros((S,), jnp.int32)
        rejected = jnp.zeros((S,), bool)
        refused = jnp.zeros((S,), jnp.int32)
    at = probs[rows, num_kept]  # [S, V]: where the drawn token goes
    removed = rejected[:, None] & (jnp.arange(V)[None, :] == refused[:, None])
    residual = jnp.where(removed, 0.0, at)
    cdf = jnp.cumsum(residual, axis=-1)
    total = cdf[:, -1]
    target = draw_u[rows, num_kept] * total
    drawn = jnp.minimum(jnp.sum(cdf <= target[:, None], axis=-1), V - 1).astype(jnp.int32)
    # No mass left besides the refused token (rounding): its most likely alternative.
    fallback = jnp.argmax(jnp.where(removed, -1.0, at), axis=-1).astype(jnp.int32)
    drawn = jnp.where(total > 0, drawn, fallback)
    last = jnp.where(greedy, argmax[rows, num_kept], drawn)
    positions = jnp.arange(K1)[None, :]
    padded_draft = jnp.concatenate([draft, jnp.zeros((S, 1), draft.dtype)], axis=1)
    tokens = jnp.where(positions < num_kept[:, None], padded_draft,
                       jnp.where(positions == num_kept[:, None], last[:, None], -1))
    return tokens.astype(jnp.int32), (num_kept + 1).astype(jnp.int32)
