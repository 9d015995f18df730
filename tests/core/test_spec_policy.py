"""Which proposals a step verifies: the bucket that maximizes expected tokens per second of
measured step time (spec_policy.py), and the scheduler around it."""

from __future__ import annotations

import pytest
from support.scheduler_harness import Harness, oracle

from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.core.spec_decode import SpecDecodeStats
from jaxserve.core.spec_policy import StepTimes, expected_gains, keep_rate, proposals_to_keep

BUCKETS = (16, 32, 64, 128, 256, 512)


def measured(seconds_of) -> StepTimes:
    times = StepTimes(BUCKETS)
    for bucket in BUCKETS:
        for _ in range(2):  # the first run of a bucket is not counted
            times.observe(bucket, seconds_of(bucket))
    return times


def test_step_times_skip_a_buckets_first_run_and_guess_the_cheapest_for_the_rest():
    times = StepTimes(BUCKETS)
    times.observe(128, 50.0)  # may have compiled it: not counted
    assert not times.measured
    times.observe(128, 1.0)
    times.observe(128, 2.0)
    assert times.estimate(128) == pytest.approx(1.3)  # moving average
    assert times.estimate(512) == pytest.approx(1.3)  # bigger: at least a smaller one's
    assert times.estimate(32) == pytest.approx(1.3 / 4)  # smaller: at most in proportion
    assert times.bucket(129) == 256 and times.bucket(16) == 16 and times.bucket(9999) == 512


def test_weight_bound_steps_verify_every_proposal():
    """Step time flat in tokens (an accelerator decoding a few sequences): 8 sequences with
    4 proposals each go into the 64 bucket, even at a low acceptance rate."""
    gains = [[0.3, 0.1, 0.05, 0.02]] * 8
    assert proposals_to_keep(8, 16, gains, measured(lambda b: 1.0)) == [4] * 8


def test_arithmetic_bound_steps_verify_only_what_fills_the_plain_bucket():
    """Step time in proportion to tokens (a CPU at 128 sequences): a proposal must be worth
    a decoded token to pay for its slot; none is, so only the padding of the plain step's
    bucket is used: 100 decoding sequences keep 28 proposals, the likeliest."""
    times = measured(lambda b: 0.01 * b)
    likely, unlikely = [0.9, 0.8, 0.7, 0.6], [0.2, 0.1, 0.05, 0.01]
    gains = [likely] * 5 + [unlikely] * 95
    keep = proposals_to_keep(100, 128, gains, times)
    assert sum(keep) == 28
    assert keep[:5] == [4] * 5 and sum(keep[5:]) == 8 and max(keep[5:]) == 1
    # At 128 sequences the plain step fills its bucket: no proposal at all.
    assert proposals_to_keep(128, 128, [likely] * 128, times) == [0] * 128


def test_a_bigger_bucket_is_taken_when_the_expected_gain_pays_for_its_time():
    """32 -> 64 costs 1.5x: 16 sequences whose proposals are each kept at 0.9 pay for it
    (16 + 39 expected tokens in 64 slots, against 16 + 14.4 in 32); at 0.2 they do not
    (16 + 3.2 in 32 slots, against 16 + 4 in 64)."""
    times = measured(lambda b: {16: 1.0, 32: 1.0, 64: 1.5}.get(b, b / 32))
    high = proposals_to_keep(16, 16, [[0.9 ** j for j in range(1, 5)]] * 16, times)
    assert sum(high) == 48  # the 64 bucket, filled: 16 + 48
    low = proposals_to_keep(16, 16, [[0.2 ** j for j in range(1, 5)]] * 16, times)
    assert sum(low) == 16  # the 32 bucket, filled


def test_before_any_measurement_proposals_end_at_a_bucket_boundary():
    times = StepTimes(BUCKETS)
    gains = [[0.5, 0.25, 0.125, 0.06]] * 10
    keep = proposals_to_keep(10, 16, gains, times)  # 50 tokens would pad to 64: cut to 32
    assert sum(keep) == 22 and set(keep) == {2, 3}
    assert sum(proposals_to_keep(3, 16, [[0.5, 0.25, 0.1, 0.05]] * 3, times)) == 12


def test_rows_that_need_a_bigger_bucket_than_their_tokens_count_from_there():
    """20 sequences need the 32 bucket (the 16 one has 16 rows): 12 proposals ride free."""
    times = measured(lambda b: 0.01 * b)
    keep = proposals_to_keep(20, 32, [[0.1, 0.01, 0.001, 0.0001]] * 20, times)
    assert sum(keep) == 12


def test_acceptance_rates_by_position_and_a_requests_own_history():
    rates = SpecDecodeStats.empty(4)
    assert expected_gains(rates, 0, 0, 2) == pytest.approx([0.5, 0.25])  # nothing seen: even odds
    for _ in range(98):
        rates.record(4, 4)  # all kept
    for _ in range(98):
        rates.record(4, 0)  # the first rejected: positions 1..3 not reached
    assert keep_rate(rates, 0) == pytest.approx(0.5)
    assert keep_rate(rates, 1) == pytest.approx(99 / 100)
    # A request that kept its first proposal in 10 of 10 drafts, and one that never did.
    good, bad = expected_gains(rates, 10, 10, 4), expected_gains(rates, 10, 0, 4)
    assert good[0] == pytest.approx(12 / 14) and bad[0] == pytest.approx(2 / 14)
    assert good == sorted(good, reverse=True) and good[3] == pytest.approx(
        good[0] * (99 / 100) ** 3)


def drive(h: Harness, steps: int, seconds_of) -> list[tuple[int, int]]:
    """Run `steps` steps, each reported to have taken seconds_of(its token bucket); the
    (sequences, proposals) of each."""
    seen = []
    for _ in range(steps):
        out = h.schedule()
        seen.append((len(out.requests), sum(r.num_proposed for r in out.requests)))
        bucket = h.config.pick_bucket(out.total_num_scheduled_tokens, len(out.requests))[0]
        h.scheduler.observe_step(out, seconds_of(bucket))
        h.execute(out)
    return seen


@pytest.mark.parametrize("bound", ["weights", "arithmetic"])
def test_the_scheduler_follows_the_step_times_it_is_told(bound, monkeypatch):
    """14 decoding sequences, 4 proposals each, each proposal right with probability 0.7:
    told that steps cost the same in every bucket, it verifies all of them (56 + 14 tokens,
    the 128 bucket); told they cost in proportion to tokens, it keeps only the two that fill
    the 16 bucket (and tries the bigger buckets once or twice on the way, as they are not
    measured)."""
    monkeypatch.setattr("jaxserve.core.scheduler.propose_ngram", oracle(0.3, 0, every=True))
    h = Harness(num_blocks=800, block_size=4, max_num_seqs=16, max_num_batched_tokens=128,
                speculative=SpeculativeConfig(num_speculative_tokens=4))
    for i in range(14):
        h.new(f"r{i}", prompt_len=3, max_tokens=400)
    drive(h, 2, lambda b: 1.0)  # the prompts
    if bound == "weights":
        seen = drive(h, 20, lambda b: 1.0)
        assert all(proposed == 56 for _, proposed in seen[-10:])
    else:
        seen = drive(h, 20, lambda b: b / 16)
        assert all(proposed == 2 for _, proposed in seen[-10:])
    assert all(count == 14 for count, _ in seen)
    h.run()
    h.check_outputs()


def test_proposals_never_crowd_out_a_running_requests_own_token(monkeypatch):
    """A budget of 24 tokens and 20 decoding sequences: every one of them decodes in every
    step; proposals get only the 4 tokens left."""
    monkeypatch.setattr("jaxserve.core.scheduler.propose_ngram", oracle(0.0, 0, every=True))
    h = Harness(num_blocks=800, block_size=4, max_num_seqs=20, max_num_batched_tokens=24,
                speculative=SpeculativeConfig(num_speculative_tokens=4))
    for i in range(20):
        h.new(f"r{i}", prompt_len=1, max_tokens=60)
    some = False
    while h.scheduler.num_unfinished:
        running = h.scheduler.num_unfinished
        ((count, proposed),) = drive(h, 1, lambda b: 1.0)
        assert count == running and count + proposed <= 24
        some = some or proposed > 0
    assert some
    h.check_outputs()


def test_waiting_prompts_come_before_proposals(monkeypatch):
    """While a long prompt waits to be prefilled, the decoding sequences' proposals take
    only the budget its chunks leave: the prompt is done in as many steps as without
    speculation."""
    monkeypatch.setattr("jaxserve.core.scheduler.propose_ngram", oracle(0.0, 0, every=True))
    steps_to_prefill = {}
    for k in (None, 4):
        spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
        h = Harness(num_blocks=800, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                    speculative=spec)
        for i in range(4):
            h.new(f"r{i}", prompt_len=3, max_tokens=200)
        drive(h, 3, lambda b: 1.0)
        long = h.new("long", prompt_len=200, max_tokens=4)
        steps = 0
        while long.num_computed_tokens < long.num_prompt_tokens:
            chunk = min(60, long.num_prompt_tokens - long.num_computed_tokens)
            ((_, proposed),) = drive(h, 1, lambda b: 1.0)
            assert proposed <= 64 - 4 - chunk
            steps += 1
        steps_to_prefill[k] = steps
        h.run()
        h.check_outputs()
    assert steps_to_prefill[4] == steps_to_prefill[None] == 4  # 60 + 60 + 60 + 20
