"""On-device sampling: penalties, temperature, top-k, top-p, min-p, seeded draws, logprobs.

Everything is per-sequence arrays (SamplingInputs), so any mix of settings runs in the same
compiled step. Randomness is fold_in(key(seed), position): a seeded request draws the same
tokens whatever else shares its batch.

Penalties need each sequence's prompt-token set and output-token counts. They live on the
device as a PenaltyState with one row per running request (rows are handed out by the
scheduler, row 0 is scratch for padding) and are updated from the tokens each step feeds the
model, so nothing of size V crosses from the host per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.backends.jax.batch import Batch, SamplingInputs
from jaxserve.core.sampling_params import MAX_LOGPROBS

_GREEDY_EPS = 1e-5  # as vLLM: temperatures below this are greedy


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PenaltyState:
    """Per-request rows on the device: penalty counts, and each request's fixed logit bias
    (logit_bias, allowed_token_ids, one-token bad words; set by set_bias_row when the request
    gets its row, read only where SamplingInputs.has_bias)."""

    output_counts: jax.Array  # i32[Q, V]   Q = max_num_seqs + 1 rows
    prompt_mask: jax.Array  # bool[Q, V]
    logit_bias: jax.Array  # f32[Q, V]
    grammar_mask: jax.Array  # i32[Q, W]  W = ceil(V / 32): bit t % 32 of word t // 32
    # i32[Q]: each row's last sampled token, which a step scheduled before that token reached
    # the host (asynchronous scheduling) feeds where its input is a placeholder.
    last_tokens: jax.Array | None = None

    @classmethod
    def zeros(cls, rows: int, vocab: int, sharding=None) -> PenaltyState:
        counts = jnp.zeros((rows, vocab), jnp.int32, device=sharding)
        mask = jnp.zeros((rows, vocab), jnp.bool_, device=sharding)
        bias = jnp.zeros((rows, vocab), jnp.float32, device=sharding)
        grammar = jnp.full((rows, (vocab + 31) // 32), -1, jnp.int32, device=sharding)
        last = jnp.zeros((rows,), jnp.int32, device=sharding)
        return cls(counts, mask, bias, grammar, last)


MASK_ROWS_PER_CALL = 8  # grammar masks written per set_grammar_rows call (K)


def set_bias_row(state: PenaltyState, row, values) -> PenaltyState:
    """row: i32[]; values: f32[V]. Jitted with the state donated: one row written."""
    return dataclasses.replace(state, logit_bias=state.logit_bias.at[row].set(values))


def set_grammar_rows(state: PenaltyState, rows, masks) -> PenaltyState:
    """rows: i32[K] (0, the scratch row, for padding); masks: i32[K, W]. Jitted with the
    state donated: the next-token bitmasks of the constrained rows of a step."""
    return dataclasses.replace(state, grammar_mask=state.grammar_mask.at[rows].set(masks))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleResult:
    token_ids: jax.Array  # i32[R]
    logprobs: jax.Array  # f32[R]  of the sampled token, from the raw model distribution
    ranks: jax.Array  # i32[R]     1 = most likely
    top_ids: jax.Array  # i32[R, 20]
    top_logprobs: jax.Array  # f32[R, 20]


def update_penalty_state(state: PenaltyState, batch: Batch, s: SamplingInputs, seq, valid):
    """Fold this step's input tokens into the rows of their sequences.

    seq: i32[T] row of each token; valid: bool[T]. Prompt tokens set prompt_mask; output
    tokens (fed back after being sampled, or recomputed after preemption) add to the counts.
    """
    reset_rows = jnp.where(s.reset_state, s.state_slots, 0)
    counts = state.output_counts.at[reset_rows].set(0)
    mask = state.prompt_mask.at[reset_rows].set(False)
    rows = jnp.where(valid, s.state_slots[seq], 0)
    is_prompt = batch.positions < s.prompt_lens[seq]
    mask = mask.at[jnp.where(is_prompt, rows, 0), batch.token_ids].set(True)
    counts = counts.at[jnp.where(is_prompt, 0, rows), batch.token_ids].add(1)
    return dataclasses.replace(state, output_counts=counts, prompt_mask=mask)


def apply_penalties(logits, state: PenaltyState, s: SamplingInputs):
    """logits: f32[R, V]. vLLM semantics: repetition over prompt and output tokens,
    presence/frequency over output tokens only."""
    counts = state.output_counts[s.state_slots]  # i32[R, V]
    seen = state.prompt_mask[s.state_slots] | (counts > 0)
    rep = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - s.frequency_penalty[:, None] * counts
    return logits - s.presence_penalty[:, None] * (counts > 0)


def _truncate(logits, s: SamplingInputs):
    """Mask tokens outside top-k, then outside the top-p nucleus (on temperature-scaled
    logits), as vLLM does."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    ranks = jnp.arange(vocab)[None, :]
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    sorted_desc = jnp.where(ranks < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = jnp.sum(before < s.top_p[:, None], axis=-1)  # >= 1: the first is always kept
    cutoff = jnp.take_along_axis(sorted_desc, (keep - 1)[:, None], axis=-1)
    return jnp.where(logits < jnp.maximum(kth, cutoff), -jnp.inf, logits)


def _draw(logits, s: SamplingInputs):
    """Temperature, top-k/top-p, min-p, then one draw per row by inverse CDF from one
    uniform u = uniform(fold_in(key(seed), position)): the draw depends only on the request."""
    vocab = logits.shape[-1]
    greedy = s.temperature < _GREEDY_EPS
    scaled = logits / jnp.where(greedy, 1.0, s.temperature)[:, None]
    needs_truncation = jnp.any(((s.top_k > 0) & (s.top_k < vocab)) | (s.top_p < 1.0))
    scaled = jax.lax.cond(needs_truncation, _truncate, lambda x, _: x, scaled, s)
    probs = jax.nn.softmax(scaled, axis=-1)
    probs = jnp.where(probs < s.min_p[:, None] * probs.max(-1, keepdims=True), 0.0, probs)

    def uniform(seed, position):
        key = jax.random.fold_in(jax.random.key(seed), position)
        return 1.0 - jax.random.uniform(key, (), jnp.float32)  # in (0, 1]: never picks p = 0

    u = jax.vmap(uniform)(s.seeds, s.sample_positions)
    cdf = jnp.cumsum(probs, axis=-1)
    below = cdf < (u * cdf[:, -1])[:, None]
    return jnp.minimum(jnp.sum(below, axis=-1), vocab - 1)


def uses_penalties(s: SamplingInputs):
    """bool[]: some row of the step has a presence, frequency or repetition penalty."""
    return jnp.any((s.presence_penalty != 0) | (s.frequency_penalty != 0)
                   | (s.repetition_penalty != 1))


def _logprobs(raw_logits, token_ids):
    """Logprob and rank of each chosen token, and the top MAX_LOGPROBS, from raw logits."""
    raw = jax.nn.log_softmax(raw_logits, axis=-1)
    chosen = jnp.take_along_axis(raw, token_ids[:, None], axis=-1)[:, 0]
    ranks = jnp.sum(raw > chosen[:, None], axis=-1).astype(jnp.int32) + 1
    top_logprobs, top_ids = jax.lax.top_k(raw, min(MAX_LOGPROBS, raw.shape[-1]))
    return chosen, ranks, top_ids.astype(jnp.int32), top_logprobs


def _no_logprobs(raw_logits, token_ids):
    rows, k = raw_logits.shape[0], min(MAX_LOGPROBS, raw_logits.shape[-1])
    return (jnp.zeros(rows, jnp.float32), jnp.ones(rows, jnp.int32),
            jnp.zeros((rows, k), jnp.int32), jnp.zeros((rows, k), jnp.float32))


def _ban(logits, banned_ids):
    # .max, not .set: padding entries (-1) alias token 0 and must not undo a real ban of it.
    banned = jnp.zeros_like(logits, jnp.bool_).at[
        jnp.arange(logits.shape[0])[:, None], jnp.maximum(banned_ids, 0)].max(banned_ids >= 0)
    return jnp.where(banned, -jnp.inf, logits)


def _add_bias(logits, state: PenaltyState, s: SamplingInputs):
    bias = state.logit_bias[s.state_slots]  # f32[R, V]
    return jnp.where(s.has_bias[:, None], logits + bias, logits)


def _apply_grammar(logits, state: PenaltyState, s: SamplingInputs):
    """Tokens the row's grammar does not allow next get -inf (structured outputs)."""
    words = state.grammar_mask[s.state_slots]  # i32[R, W]
    ids = jnp.arange(logits.shape[-1])
    allowed = ((words[:, ids // 32] >> (ids % 32)) & 1) != 0  # bool[R, V]
    return jnp.where(s.has_grammar[:, None] & ~allowed, -jnp.inf, logits)


def sample(logits, state: PenaltyState, s: SamplingInputs) -> SampleResult:
    """logits: f32[R, V] raw model logits for each sequence's last token.

    Every stage that costs passes over [R, V] runs under lax.cond only when some row of the
    step needs it (logit bias, grammar masks, penalties, bans, random draws, logprobs): a
    plain greedy
    batch pays for one argmax. As in vLLM, the bias and bans come before the penalties, and
    logprobs are those of the raw logits."""
    raw_logits = logits
    logits = jax.lax.cond(jnp.any(s.has_bias), _add_bias, lambda x, *_: x, logits, state, s)
    logits = jax.lax.cond(jnp.any(s.has_grammar), _apply_grammar, lambda x, *_: x, logits,
                          state, s)
    logits = jax.lax.cond(uses_penalties(s), apply_penalties, lambda x, *_: x, logits, state, s)
    logits = jax.lax.cond(jnp.any(s.banned_ids >= 0), _ban, lambda x, _: x, logits,
                          s.banned_ids)

    greedy = s.temperature < _GREEDY_EPS
    greedy_ids = jnp.argmax(logits, axis=-1)
    # An all-greedy batch skips the random path entirely.
    drawn = jax.lax.cond(jnp.all(greedy), lambda *_: greedy_ids, _draw, logits, s)
    token_ids = jnp.where(greedy, greedy_ids, drawn).astype(jnp.int32)
    chosen, ranks, top_ids, top_logprobs = jax.lax.cond(
        jnp.any(s.wants_logprobs), _logprobs, _no_logprobs, raw_logits, token_ids)
    return SampleResult(token_ids, chosen, ranks, top_ids, top_logprobs)


def score_tokens(logits, targets) -> SampleResult:
    """Logprobs of given next tokens (prompt_logprobs): logits f32[X, V], targets i32[X]."""
    return SampleResult(targets, *_logprobs(logits, targets))
