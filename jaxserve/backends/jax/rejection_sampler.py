"""Verification of speculative proposals that are certain (n-gram lookups): how many of the
proposed tokens a step keeps.

Shape letters: R rows (sequences), L sampling slots of a step (runner.py's layout).

For proposal d_i at position i, with the target distribution p_i (after every sampling
stage: bias, temperature, top-k/top-p, min-p), a deterministic proposer has q_i = one-hot(d_i).
The speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023) then keeps d_i with
probability p_i(d_i) and, at the first rejection, draws from p_i with d_i removed. This module
uses the coupling of that rule with plain sampling: the step draws x_i from p_i exactly as
plain sampling would at that position (same uniform, from the request's seed and the
position), keeps d_i while x_i == d_i, and emits x_0 .. x_j where j is the first mismatch (or
x_K, the bonus token, when every proposal is kept). d_i is kept with probability p_i(d_i),
and on a mismatch x_i is distributed as p_i conditioned on x_i != d_i: the same law as the
rule above. Moreover every emitted token is the very token plain sampling draws there, so a
request's output (greedy, or sampled with a seed) is token-identical with and without
speculation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accept_drafts(sampled: jax.Array, follows: jax.Array, has_proposal: jax.Array,
                  row: jax.Array, starts: jax.Array) -> jax.Array:
    """A step's sampled tokens in slots, row after row: row r's slots start at starts[r]
    (i32[R]), one per proposal and one for its last token, in order. Per slot (i32/bool[L]):
    sampled, the token drawn there; follows, the proposal fed after the slot's token;
    has_proposal, whether one was (false for a row's last slot and unused slots); row, the
    slot's row. Returns num_emitted i32[R]: each row's kept proposals + 1 (its emitted
    tokens are sampled[starts[r]: starts[r] + num_emitted[r]])."""
    slots = sampled.shape[0]
    slot = jnp.arange(slots)
    kept = has_proposal & (sampled == follows)
    first_miss = jax.ops.segment_min(jnp.where(kept, slots, slot), row,
                                     num_segments=starts.shape[0])
    # A row with slots always misses at its last one; a padding row (no slots) gets 1.
    return jnp.clip(first_miss - starts + 1, 1, slots).astype(jnp.int32)
