"""The sampler on hand-made logits, on both backends: masks, penalties, seeded draws and
their distribution.

Every test runs against the JAX sampler (sampler.py) and the torch backend's
(backends/torch/sampler.py) through one small adapter each, so the two keep the same semantics:
same greedy tokens, same supports under top-k / top-p / min-p, same penalty arithmetic,
same logprobs, and draws whose frequencies match the exact distribution within tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.core.step_fields import SAMPLING_FIELDS

V = 8


def inputs(rows=1, **overrides) -> dict[str, np.ndarray]:
    """A step's sampling arrays (the sampling fields of core/step_fields.py) for `rows` rows:
    each field's padding value, except each row's own seed and state slot, logprobs asked
    for, and 16 banned-id entries per row."""
    values = {f.name: np.full(rows, f.pad, f.dtype) for f in SAMPLING_FIELDS}
    values.update(seeds=np.arange(rows, dtype=np.uint32),
                  state_slots=np.arange(1, rows + 1, dtype=np.int32),
                  wants_logprobs=np.ones(rows, bool),
                  banned_ids=np.full((rows, 16), -1, np.int32))
    for key, value in overrides.items():
        values[key] = np.array(
            np.broadcast_to(np.asarray(value, values[key].dtype), values[key].shape))
    return values


class JaxSampler:
    def __init__(self) -> None:
        import jax
        import jax.numpy as jnp

        from jaxserve.backends.jax import sampler
        from jaxserve.backends.jax.batch import SamplingInputs

        self.jnp, self.sampler, self.SamplingInputs = jnp, sampler, SamplingInputs
        self.jitted = jax.jit(sampler.sample)

    def state(self, rows, counts=None, mask=None):
        state = self.sampler.PenaltyState.zeros(rows, V)
        if counts is not None:
            state = self.sampler.PenaltyState(self.jnp.asarray(counts), self.jnp.asarray(mask),
                                              state.logit_bias, state.grammar_mask)
        return state

    def set_bias(self, state, row, values):
        return self.sampler.set_bias_row(state, row, self.jnp.asarray(values))

    def set_grammar(self, state, rows, masks):
        return self.sampler.set_grammar_rows(state, self.jnp.asarray(rows),
                                             self.jnp.asarray(masks))

    def _s(self, s):
        return self.SamplingInputs(**{k: self.jnp.asarray(v) for k, v in s.items()})

    def sample(self, logits, state, s):
        out = self.jitted(self.jnp.asarray(logits), state, self._s(s))
        return {k: np.asarray(getattr(out, k)) for k in ("token_ids", "logprobs", "ranks",
                                                          "top_ids", "top_logprobs")}

    def penalties(self, logits, state, s):
        return np.asarray(self.sampler.apply_penalties(self.jnp.asarray(logits), state,
                                                       self._s(s)))


class TorchSampler:
    def __init__(self) -> None:
        import torch

        from jaxserve.backends.torch import batch as torch_batch
        from jaxserve.backends.torch import sampler as torch_sampler

        self.torch, self.sampler, self.batch = torch, torch_sampler, torch_batch

    def state(self, rows, counts=None, mask=None):
        state = self.sampler.PenaltyState.zeros(rows, V, "cpu")
        if counts is not None:
            state.output_counts[:] = self.torch.from_numpy(counts)
            state.prompt_mask[:] = self.torch.from_numpy(mask)
        return state

    def set_bias(self, state, row, values):
        state.logit_bias[row] = self.torch.from_numpy(np.asarray(values, np.float32))
        return state

    def set_grammar(self, state, rows, masks):
        state.grammar_mask[self.torch.as_tensor(rows).long()] = self.torch.from_numpy(masks)
        return state

    def _s(self, s):
        return self.batch.sampling_on(s, self.torch.device("cpu"))

    def sample(self, logits, state, s):
        flags = self.sampler.StepFlags.of(s, len(s["temperature"]), V)
        out = self.sampler.sample(self.torch.from_numpy(np.asarray(logits, np.float32)),
                                  state, self._s(s), flags).to_host()
        return {k: getattr(out, k) for k in ("token_ids", "logprobs", "ranks", "top_ids",
                                             "top_logprobs")}

    def penalties(self, logits, state, s):
        return self.sampler._apply_penalties(self.torch.from_numpy(logits), state,
                                             self._s(s)).numpy()


@pytest.fixture(scope="module", params=["jax", "torch"])
def sampler(request):
    return JaxSampler() if request.param == "jax" else TorchSampler()


LOGITS = np.log(np.array([[0.4, 0.3, 0.15, 0.1, 0.03, 0.01, 0.005, 0.005]], np.float32))


def draws(sampler, count=400, **settings) -> np.ndarray:
    """Tokens drawn for one row of LOGITS over `count` seeds, in one call."""
    logits = np.repeat(LOGITS, count, axis=0)
    state = sampler.state(count + 1)
    s = inputs(count, seeds=np.arange(count), sample_positions=np.arange(count) % 7, **settings)
    return sampler.sample(logits, state, s)["token_ids"]


def test_greedy_and_support_of_truncations(sampler):
    state = sampler.state(2)
    assert sampler.sample(LOGITS, state, inputs(temperature=0.0))["token_ids"][0] == 0
    assert set(draws(sampler, top_k=2).tolist()) == {0, 1}
    assert set(draws(sampler, top_p=0.8).tolist()) == {0, 1, 2}  # 0.4 + 0.3 < 0.8 <= 0.85
    assert set(draws(sampler, min_p=0.3).tolist()) == {0, 1, 2}  # keep p >= 0.3 * 0.4
    assert len(set(draws(sampler).tolist())) >= 6  # untruncated: the tail shows up too


def _renormalised(probs, keep):
    p = np.where(keep, probs, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("settings,expected", [
    ({}, np.exp(LOGITS[0])),
    ({"temperature": 2.0}, _renormalised(np.exp(LOGITS[0] / 2), np.ones(V, bool))),
    ({"top_k": 3}, _renormalised(np.exp(LOGITS[0]), np.arange(V) < 3)),
    ({"top_p": 0.8}, _renormalised(np.exp(LOGITS[0]), np.arange(V) < 3)),
], ids=["plain", "temperature", "top_k", "top_p"])
def test_draws_follow_the_distribution(sampler, settings, expected):
    """Frequencies over 4000 seeds match the exact (truncated, tempered) distribution:
    every token within 4.5 standard deviations of its expected count."""
    count = 4000
    tokens = draws(sampler, count, **settings)
    seen = np.bincount(tokens, minlength=V)
    expected = np.asarray(expected, np.float64) / np.sum(expected)
    sd = np.sqrt(count * expected * (1 - expected))
    assert np.all(np.abs(seen - count * expected) <= 4.5 * sd + 1), (seen, count * expected)


def test_same_seed_and_position_same_token_any_row(sampler):
    logits = np.repeat(LOGITS, 4, axis=0)
    out = sampler.sample(logits, sampler.state(5),
                         inputs(4, seeds=[9, 9, 3, 9], sample_positions=[5, 5, 5, 6]))
    tokens = out["token_ids"].tolist()
    assert tokens[0] == tokens[1]
    single = sampler.sample(LOGITS, sampler.state(2), inputs(seeds=9, sample_positions=5))
    assert single["token_ids"][0] == tokens[0]


def test_penalties_follow_vllm_semantics(sampler):
    logits = np.asarray([[2.0, -2.0, 1.0, 0.5, 0, 0, 0, 0]], np.float32)
    counts = np.zeros((2, V), np.int32)
    counts[1, 2] = 3  # token 2 generated three times
    mask = np.zeros((2, V), bool)
    mask[1, [0, 1]] = True  # tokens 0 and 1 in the prompt
    state = sampler.state(2, counts, mask)
    out = sampler.penalties(logits, state, inputs(repetition_penalty=2.0, presence_penalty=0.5,
                                                  frequency_penalty=0.25))
    expected = [2.0 / 2, -2.0 * 2, 1.0 / 2 - 0.25 * 3 - 0.5, 0.5, 0, 0, 0, 0]
    np.testing.assert_allclose(out[0], expected, rtol=1e-6)


def test_banned_ids_are_never_sampled(sampler):
    banned = np.full((1, 16), -1, np.int32)
    banned[0, :2] = [0, 1]
    out = sampler.sample(LOGITS, sampler.state(2), inputs(temperature=0.0, banned_ids=banned))
    assert out["token_ids"][0] == 2
    assert out["ranks"][0] == 3  # ranks come from the raw distribution


@pytest.mark.parametrize("k", [1, 3])
def test_logprobs_are_raw_log_softmax(sampler, k):
    out = sampler.sample(LOGITS, sampler.state(2), inputs(temperature=0.0, top_k=k))
    np.testing.assert_allclose(out["top_logprobs"][0], np.sort(LOGITS[0])[::-1], rtol=1e-5)
    assert float(out["logprobs"][0]) == pytest.approx(float(LOGITS[0, 0]), rel=1e-5)


def test_the_bias_row_applies_only_to_rows_that_ask_and_bans_with_minus_inf(sampler):
    bias = np.zeros(V, np.float32)
    bias[5] = 100.0  # logit_bias pushes an unlikely token to the top
    bias[0] = -np.inf  # a banned token
    state = sampler.set_bias(sampler.state(3), 1, bias)
    logits = np.repeat(LOGITS, 2, axis=0)
    out = sampler.sample(logits, state, inputs(2, temperature=0.0, has_bias=[True, False]))
    assert out["token_ids"].tolist() == [5, 0]
    # logprobs stay those of the model's distribution (vLLM's raw logprobs)
    np.testing.assert_allclose(out["logprobs"][0], np.log(0.01), rtol=1e-4)
    # random draws land only on the allowed tokens (allowed_token_ids: -inf elsewhere)
    count = 200
    allowed = np.full(V, -np.inf, np.float32)
    allowed[[3, 6]] = 0.0
    state = sampler.set_bias(sampler.state(2), 1, allowed)
    drawn = sampler.sample(np.repeat(LOGITS, count, axis=0), state,
                           inputs(count, seeds=np.arange(count), state_slots=1, has_bias=True))
    assert set(drawn["token_ids"].tolist()) == {3, 6}


def test_a_grammar_mask_limits_its_row_to_the_allowed_tokens(sampler):
    allowed = np.zeros((2, 1), np.int32)
    allowed[0, 0] = (1 << 4) | (1 << 6)  # tokens 4 and 6
    state = sampler.set_grammar(sampler.state(3), np.asarray([1, 0], np.int32), allowed)
    logits = np.repeat(LOGITS, 2, axis=0)
    out = sampler.sample(logits, state, inputs(2, temperature=0.0, has_grammar=[True, False]))
    assert out["token_ids"].tolist() == [4, 0]  # the likeliest allowed token; row 2 unmasked
    count = 200
    drawn = sampler.sample(np.repeat(LOGITS, count, axis=0), state,
                           inputs(count, seeds=np.arange(count), state_slots=1,
                                  has_grammar=True))
    assert set(drawn["token_ids"].tolist()) == {4, 6}
