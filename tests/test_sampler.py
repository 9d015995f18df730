"""The on-device sampler on hand-made logits: masks, penalties and seeded draws."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.batch import SamplingInputs
from jaxserve.sampler import (
    PenaltyState,
    apply_penalties,
    sample,
    set_bias_row,
    set_grammar_rows,
)

V = 8


def inputs(rows=1, **overrides) -> SamplingInputs:
    values = dict(temperature=np.ones(rows, np.float32), top_k=np.zeros(rows, np.int32),
                  top_p=np.ones(rows, np.float32), min_p=np.zeros(rows, np.float32),
                  presence_penalty=np.zeros(rows, np.float32),
                  frequency_penalty=np.zeros(rows, np.float32),
                  repetition_penalty=np.ones(rows, np.float32),
                  seeds=np.arange(rows, dtype=np.uint32),
                  sample_positions=np.zeros(rows, np.int32),
                  state_slots=np.arange(1, rows + 1, dtype=np.int32),
                  reset_state=np.zeros(rows, bool), prompt_lens=np.zeros(rows, np.int32),
                  wants_logprobs=np.ones(rows, bool),
                  banned_ids=np.full((rows, 16), -1, np.int32),
                  has_bias=np.zeros(rows, bool), has_grammar=np.zeros(rows, bool))
    for key, value in overrides.items():
        values[key] = np.broadcast_to(np.asarray(value, values[key].dtype), values[key].shape)
    return SamplingInputs(**{k: jnp.asarray(v) for k, v in values.items()})


LOGITS = np.log(np.array([[0.4, 0.3, 0.15, 0.1, 0.03, 0.01, 0.005, 0.005]], np.float32))


def draws(count=400, **settings) -> set[int]:
    """Tokens drawn for one row of LOGITS over `count` seeds, in one jitted call."""
    logits = jnp.asarray(np.repeat(LOGITS, count, axis=0))
    state = PenaltyState.zeros(count + 1, V)
    s = inputs(count, seeds=np.arange(count), sample_positions=np.arange(count) % 7, **settings)
    return set(np.asarray(jax.jit(sample)(logits, state, s).token_ids).tolist())


def test_greedy_and_support_of_truncations():
    state = PenaltyState.zeros(2, V)
    assert int(sample(jnp.asarray(LOGITS), state, inputs(temperature=0.0)).token_ids[0]) == 0
    assert draws(top_k=2) == {0, 1}
    assert draws(top_p=0.8) == {0, 1, 2}  # 0.4 + 0.3 < 0.8 <= 0.85
    assert draws(min_p=0.3) == {0, 1, 2}  # keep p >= 0.3 * 0.4
    assert len(draws()) >= 6  # untruncated: the tail shows up too


def test_same_seed_and_position_same_token_any_row():
    logits = jnp.asarray(np.repeat(LOGITS, 4, axis=0))
    state = PenaltyState.zeros(5, V)
    out = sample(logits, state, inputs(4, seeds=[9, 9, 3, 9], sample_positions=[5, 5, 5, 6]))
    tokens = out.token_ids.tolist()
    assert tokens[0] == tokens[1]
    single = sample(jnp.asarray(LOGITS), PenaltyState.zeros(2, V),
                    inputs(seeds=9, sample_positions=5)).token_ids[0]
    assert int(single) == tokens[0]


def test_penalties_follow_vllm_semantics():
    logits = jnp.asarray([[2.0, -2.0, 1.0, 0.5, 0, 0, 0, 0]], jnp.float32)
    counts = np.zeros((2, V), np.int32)
    counts[1, 2] = 3  # token 2 generated three times
    mask = np.zeros((2, V), bool)
    mask[1, [0, 1]] = True  # tokens 0 and 1 in the prompt
    state = PenaltyState(jnp.asarray(counts), jnp.asarray(mask), jnp.zeros((2, V)),
                         jnp.full((2, 1), -1, jnp.int32))
    out = apply_penalties(logits, state, inputs(repetition_penalty=2.0, presence_penalty=0.5,
                                                frequency_penalty=0.25))
    expected = [2.0 / 2, -2.0 * 2, 1.0 / 2 - 0.25 * 3 - 0.5, 0.5, 0, 0, 0, 0]
    np.testing.assert_allclose(np.asarray(out)[0], expected, rtol=1e-6)


def test_banned_ids_are_never_sampled():
    banned = np.full((1, 16), -1, np.int32)
    banned[0, :2] = [0, 1]
    state = PenaltyState.zeros(2, V)
    out = sample(jnp.asarray(LOGITS), state, inputs(temperature=0.0, banned_ids=banned))
    assert int(out.token_ids[0]) == 2
    assert out.ranks[0] == 3  # ranks come from the raw distribution


@pytest.mark.parametrize("k", [1, 3])
def test_logprobs_are_raw_log_softmax(k):
    state = PenaltyState.zeros(2, V)
    out = sample(jnp.asarray(LOGITS), state, inputs(temperature=0.0, top_k=k))
    np.testing.assert_allclose(np.asarray(out.top_logprobs[0]), np.sort(LOGITS[0])[::-1],
                               rtol=1e-5)
    assert float(out.logprobs[0]) == pytest.approx(float(LOGITS[0, 0]), rel=1e-5)


def test_the_bias_row_applies_only_to_rows_that_ask_and_bans_with_minus_inf():
    state = PenaltyState.zeros(3, V)
    bias = np.zeros(V, np.float32)
    bias[5] = 100.0  # logit_bias pushes an unlikely token to the top
    bias[0] = -np.inf  # a banned token
    state = set_bias_row(state, 1, jnp.asarray(bias))
    logits = jnp.asarray(np.repeat(LOGITS, 2, axis=0))
    out = sample(logits, state, inputs(2, temperature=0.0, has_bias=[True, False]))
    assert out.token_ids.tolist() == [5, 0]
    # logprobs stay those of the model's distribution (vLLM's raw logprobs)
    np.testing.assert_allclose(out.logprobs[0], np.log(0.01), rtol=1e-4)
    # random draws land only on the allowed tokens (allowed_token_ids: -inf elsewhere)
    count = 200
    allowed = np.full(V, -np.inf, np.float32)
    allowed[[3, 6]] = 0.0
    state = set_bias_row(PenaltyState.zeros(2, V), 1, jnp.asarray(allowed))
    drawn = sample(jnp.asarray(np.repeat(LOGITS, count, axis=0)), state,
                   inputs(count, seeds=np.arange(count), state_slots=1, has_bias=True))
    assert set(np.asarray(drawn.token_ids).tolist()) == {3, 6}


def test_a_grammar_mask_limits_its_row_to_the_allowed_tokens():
    state = PenaltyState.zeros(3, V)
    allowed = np.zeros((2, 1), np.int32)
    allowed[0, 0] = (1 << 4) | (1 << 6)  # tokens 4 and 6
    state = set_grammar_rows(state, jnp.asarray([1, 0]), jnp.asarray(allowed))
    logits = jnp.asarray(np.repeat(LOGITS, 2, axis=0))
    out = sample(logits, state, inputs(2, temperature=0.0, has_grammar=[True, False]))
    assert out.token_ids.tolist() == [4, 0]  # the likeliest allowed token; row 2 unmasked
    count = 200
    drawn = sample(jnp.asarray(np.repeat(LOGITS, count, axis=0)), state,
                   inputs(count, seeds=np.arange(count), state_slots=1, has_grammar=True))
    assert set(np.asarray(drawn.token_ids).tolist()) == {4, 6}
