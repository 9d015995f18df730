"""Scheduler and KV-block accounting, tested without a model.

A fake runner stands in for the device step. It builds each step's inputs with the real
input builder, writes the scheduled tokens into a simulated paged KV cache through
`slot_mapping`, reads each finished row's context back through its block table, and samples
`next_token(context)`: a hash of the whole context, so every expected output can be computed
by hand (`expected_outputs`). A block handed to two requests, a stale block table or a
recompute that skipped the outputs after preemption would change the tokens.

Every step the harness checks the invariants a user would notice: the token budget and the
sequence cap, running-before-waiting and FCFS order, exact block counts, no shared or null
blocks, penalty-state slots, and what preemption does to the preempted request.
"""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
from support.scheduler_harness import (
    Harness,
    build_inputs,
    cdiv,
    check_named,
    expected_outputs,
    held_blocks,
    make_request,
    next_token,
    oracle,
    prompt_ids,
)

from jaxserve.config.engine_config import SchedulerConfig
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.core.input_builder import StepInputBuilder, build_step_inputs
from jaxserve.core.kv_cache_manager import BlockPool, KVCacheManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import SchedulerOutput


# ---- budget, caps and order -----------------------------------------------------------------
def test_budget_and_sequence_cap_hold_under_load():
    h = Harness(num_blocks=200, block_size=4, max_num_seqs=3, max_num_batched_tokens=20)
    for i in range(10):
        h.new(f"r{i}", prompt_len=5 + 3 * i, max_tokens=4 + i % 3)
    h.run()
    h.check_outputs()
    totals = [o.total_num_scheduled_tokens for o in h.outputs]
    assert max(totals) == 20, "the budget is used in full while there is prefill work"
    assert max(len(o.requests) for o in h.outputs) == 3
    assert all(len(o.requests) <= 3 and o.total_num_scheduled_tokens <= 20 for o in h.outputs)


def test_running_requests_are_scheduled_before_waiting_ones():
    h = Harness(num_blocks=100, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    a = h.new("a", prompt_len=10, max_tokens=5)
    out = h.step()
    assert out.requests == [a] and out.num_scheduled_tokens == [10]
    b = h.new("b", prompt_len=30, max_tokens=2)
    out = h.step()
    assert out.requests == [a, b] and out.num_scheduled_tokens == [1, 15]
    out = h.step()
    assert out.requests == [a, b] and out.num_scheduled_tokens == [1, 15]
    h.run()
    h.check_outputs()


def test_budget_exhausted_by_running_requests_admits_nobody():
    h = Harness(num_blocks=100, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    a = h.new("a", prompt_len=20, max_tokens=2)
    b = h.new("b", prompt_len=3, max_tokens=2)
    out = h.step()
    assert out.requests == [a] and out.num_scheduled_tokens == [8]
    assert list(h.scheduler.waiting) == [b] and b.state_slot == 0
    h.run()
    h.check_outputs()


def test_waiting_requests_are_admitted_fcfs():
    h = Harness(num_blocks=100, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    reqs = [h.new(f"r{i}", prompt_len=4 + (7 * i) % 5, max_tokens=1 + (3 * i) % 4)
            for i in range(8)]
    h.run()
    h.check_outputs()
    assert h.admitted == reqs
    finish_order = [h.finished.index(r) for r in reqs]
    assert finish_order != sorted(finish_order), "the workload should reorder finishing"


def test_priority_lower_value_first_fcfs_among_equals():
    h = Harness(num_blocks=100, block_size=4, max_num_seqs=1, max_num_batched_tokens=64,
                policy="priority")
    prios = [3, 1, 2, 1, 0, 3, 0, 2]
    reqs = [h.new(f"r{i}", prompt_len=5, max_tokens=2, priority=p) for i, p in enumerate(prios)]
    want = sorted(reqs, key=lambda r: (r.priority, reqs.index(r)))
    assert list(h.scheduler.waiting) == want
    h.run()
    assert h.admitted == want
    h.check_outputs()


def test_default_priority_is_plain_fcfs():
    h = Harness(num_blocks=100, block_size=4, max_num_seqs=1, max_num_batched_tokens=64)
    reqs = [h.new(f"r{i}", prompt_len=3, max_tokens=1) for i in range(5)]
    assert list(h.scheduler.waiting) == reqs
    h.run()
    assert h.admitted == reqs


def test_priority_policy_preempts_the_lowest_priority_and_keeps_the_queue_in_order():
    h = Harness(num_blocks=5, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                policy="priority")
    low = h.new("low", prompt_len=4, max_tokens=12, priority=5)
    h.new("old", prompt_len=4, max_tokens=12, priority=0)  # newer, but more important
    h.step()
    a0 = h.new("a0", prompt_len=4, max_tokens=2, priority=0)  # waits: max_num_seqs is full
    while not h.scheduler.num_preemptions:
        h.step()
    assert low.num_preemptions == 1  # not the newest: the least important
    assert list(h.scheduler.waiting) == [a0, low]  # each by its priority
    h.new("c3", prompt_len=4, max_tokens=2, priority=3)
    b1 = h.new("b1", prompt_len=4, max_tokens=2, priority=1)
    waiting = list(h.scheduler.waiting)
    assert waiting.index(a0) < waiting.index(b1), [r.request_id for r in waiting]
    h.run()
    assert h.admitted.index(a0) < h.admitted.index(b1)


# ---- chunked prefill --------------------------------------------------------------------------
def test_long_prompt_is_prefilled_in_chunks_that_use_the_budget():
    h = Harness(num_blocks=100, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    a = h.new("a", prompt_len=50, max_tokens=3)
    counts = []
    while not a.finished:
        out = h.step()
        counts.append(out.num_scheduled_tokens[0])
        if a.num_computed_tokens < a.num_prompt_tokens:
            assert a.num_output_tokens == 0, "a token came out of a partial prompt"
            assert h.produced[-1] == []
    assert counts == [16, 16, 16, 2, 1, 1]
    assert [len(p) for p in h.produced] == [0, 0, 0, 1, 1, 1]
    h.check_all_free()
    h.check_outputs()


def test_prefill_chunk_shares_the_budget_with_decodes():
    h = Harness(num_blocks=100, block_size=8, max_num_seqs=4, max_num_batched_tokens=16)
    a = h.new("a", prompt_len=5, max_tokens=10)
    b = h.new("b", prompt_len=6, max_tokens=10)
    h.step()  # both prompts in one step
    c = h.new("c", prompt_len=40, max_tokens=2)
    seen = []
    while c.num_output_tokens == 0:
        out = h.step()
        assert out.requests[:2] == [a, b] and out.num_scheduled_tokens[:2] == [1, 1]
        seen.append(out.num_scheduled_tokens[2])
    assert seen == [14, 14, 12]
    h.run()
    h.check_outputs()


def test_prompt_exactly_the_budget_and_one_token_prompts():
    h = Harness(num_blocks=50, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    a = h.new("a", prompt_len=8, max_tokens=2)
    out = h.step()
    assert out.num_scheduled_tokens == [8] and a.num_output_tokens == 1
    ones = [h.new(f"one{i}", prompt_len=1, max_tokens=1) for i in range(3)]
    out = h.step()
    assert out.requests == [a, *ones] and out.num_scheduled_tokens == [1, 1, 1, 1]
    h.run()
    h.check_outputs()


# ---- block accounting -----------------------------------------------------------------------
def test_block_pool_reserves_the_null_block():
    pool = BlockPool(5)
    assert pool.num_free == 4
    assert pool.allocate(5) is None and pool.num_free == 4, "all or nothing"
    got = pool.allocate(4)
    assert sorted(got) == [1, 2, 3, 4]
    assert pool.allocate(1) is None
    pool.release(got)
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.release([got[0]])
    with pytest.raises(RuntimeError):
        pool.release([0])
    with pytest.raises(ValueError):
        BlockPool(1)


def test_a_request_holds_exactly_the_blocks_its_computed_tokens_need():
    h = Harness(num_blocks=50, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    a = h.new("a", prompt_len=10, max_tokens=8)
    history = []
    while not a.finished:
        h.step()
        history.append((a.num_computed_tokens, len(held_blocks(a))))
    # 10 -> 3 blocks, then one token per step: 11, 12 -> 3; 13..16 -> 4; at 17 the eighth
    # output finishes it and its blocks go back.
    assert history == [(10, 3), (11, 3), (12, 3), (13, 4), (14, 4), (15, 4), (16, 4), (17, 0)]
    assert a.num_output_tokens == 8
    h.check_all_free()
    h.check_outputs()


def test_every_block_is_free_after_all_requests_finish():
    h = Harness(num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=32)
    for i in range(12):
        h.new(f"r{i}", prompt_len=3 + 2 * i, max_tokens=1 + i)
    h.step()
    assert h.kv_manager.usage > 0
    h.run()
    assert h.kv_manager.pool.num_free == 39 and h.kv_manager.usage == 0
    h.check_outputs()


def test_abort_frees_running_and_waiting_requests():
    h = Harness(num_blocks=30, block_size=4, max_num_seqs=3, max_num_batched_tokens=16)
    decoding = h.new("decoding", prompt_len=6, max_tokens=20)
    h.step()
    prefilling = h.new("prefilling", prompt_len=40, max_tokens=3)
    keep = h.new("keep", prompt_len=5, max_tokens=6)
    waiting = h.new("waiting", prompt_len=5, max_tokens=3)
    h.step()  # decoding 1 + prefilling 15: the budget is spent, nobody else is admitted
    assert decoding.num_output_tokens == 2 and held_blocks(decoding)
    assert 0 < prefilling.num_computed_tokens < prefilling.num_prompt_tokens
    assert list(h.scheduler.waiting) == [keep, waiting]
    free_before = h.kv_manager.pool.num_free
    held = len(held_blocks(decoding)) + len(held_blocks(prefilling))

    h.abort(decoding)
    h.abort(prefilling)
    h.abort(waiting)
    for req in (decoding, prefilling, waiting):
        assert req.status is RequestStatus.FINISHED_ABORTED
    assert h.kv_manager.pool.num_free == free_before + held
    assert not any(r is waiting for r in h.scheduler.waiting)
    h.run()
    assert keep.status is RequestStatus.FINISHED_LENGTH and keep.num_output_tokens == 6
    h.check_outputs()


def test_abort_everything_midway_leaves_an_empty_pool():
    h = Harness(num_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=32)
    reqs = [h.new(f"r{i}", prompt_len=6, max_tokens=20) for i in range(6)]
    for _ in range(10):
        h.step()
    assert any(r.status is RequestStatus.PREEMPTED for r in h.scheduler.waiting)
    assert h.scheduler.running
    for req in reqs:
        if not req.finished:
            h.abort(req)
    h.check_all_free()
    h.check_outputs()


# ---- preemption -----------------------------------------------------------------------------
def test_the_newest_running_request_is_preempted_when_blocks_run_out():
    # 6 usable blocks of 4 tokens; three 7-token prompts take 2 blocks each.
    h = Harness(num_blocks=7, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    a, b, c = (h.new(n, prompt_len=7, max_tokens=8) for n in "abc")
    d = h.new("d", prompt_len=4, max_tokens=3)
    out = h.step()
    assert out.requests == [a, b, c] and h.kv_manager.pool.num_free == 0
    out = h.step()  # 8 computed tokens still fit in 2 blocks
    assert out.requests == [a, b, c] and not out.preempted
    outputs_before = c.output_token_ids
    out = h.step()  # a needs a third block: c, the newest, gives way
    assert out.preempted == [c] and out.requests == [a, b]
    assert c.status is RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert held_blocks(c) == [] and c.state_slot == 0 and c.num_preemptions == 1
    assert list(h.scheduler.waiting) == [c, d], "the preempted request waits in front"
    assert h.scheduler.num_preemptions == 1
    assert c.output_token_ids == outputs_before and len(outputs_before) == 2, "outputs kept"
    h.run()
    assert c.num_preemptions >= 1
    h.check_outputs()


def test_preemption_does_not_change_any_token():
    def workload(num_blocks):
        h = Harness(num_blocks=num_blocks, block_size=4, max_num_seqs=4,
                    max_num_batched_tokens=24)
        for i in range(10):
            h.new(f"r{i}", prompt_len=3 + (5 * i) % 11, max_tokens=6 + (7 * i) % 13)
        h.run()
        h.check_outputs()
        return h, {r.request_id: r.output_token_ids for r in h.requests}

    roomy, want = workload(200)
    tight, got = workload(8)
    assert roomy.scheduler.num_preemptions == 0
    assert tight.scheduler.num_preemptions >= 3
    assert sum(r.num_preemptions for r in tight.requests) == tight.scheduler.num_preemptions
    assert got == want
    for r in tight.requests:
        assert r.num_output_tokens == r.max_output_tokens


def test_preempted_request_recomputes_prompt_and_outputs_in_chunks():
    h = Harness(num_blocks=9, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    a = h.new("a", prompt_len=8, max_tokens=20)
    b = h.new("b", prompt_len=8, max_tokens=12)
    while not h.scheduler.num_preemptions:
        h.step()
    assert a.status is RequestStatus.RUNNING, "the older request keeps running"
    assert b.status is RequestStatus.PREEMPTED and b.num_output_tokens > 0
    length = b.num_tokens
    assert length > 8, "recomputing prompt + outputs takes more than one budget"
    chunks = []
    while b.num_tokens == length:
        out = h.step()
        if any(r is b for r in out.preempted):
            chunks = []  # preempted again mid-recompute: it starts over
        chunks += [n for r, n in zip(out.requests, out.num_scheduled_tokens) if r is b]
        if b.num_tokens == length:
            assert b.num_computed_tokens < length
    assert b.num_computed_tokens == length
    assert sum(chunks) == length and len(chunks) >= 2, chunks
    h.run()
    h.check_outputs()


# ---- penalty-state slots --------------------------------------------------------------------
def test_state_slots_are_unique_released_and_reset_when_handed_out():
    h = Harness(num_blocks=100, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    short = h.new("short", prompt_len=4, max_tokens=1)
    mid = h.new("mid", prompt_len=4, max_tokens=5)
    long = h.new("long", prompt_len=4, max_tokens=9)
    late = h.new("late", prompt_len=4, max_tokens=2)
    out = h.schedule()
    assert {r.state_slot for r in (short, mid, long)} == {1, 2, 3}
    assert all(r.needs_state_reset for r in out.requests)
    assert late.state_slot == 0
    short_slot = short.state_slot
    h.execute(out)  # the inputs carried the reset; short finished and gave its slot back
    assert short.finished and short.state_slot == 0
    out = h.schedule()  # the step that reset their rows has run: the next one keeps them
    assert out.requests == [mid, long, late]
    assert late.state_slot == short_slot and late.needs_state_reset
    assert not mid.needs_state_reset and not long.needs_state_reset
    h.execute(out)
    h.run()


def test_state_slot_is_released_on_preemption_and_reset_on_readmission():
    h = Harness(num_blocks=7, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    a, b, c = (h.new(n, prompt_len=7, max_tokens=8) for n in "abc")
    for _ in range(3):
        h.step()
    assert c.status is RequestStatus.PREEMPTED and c.state_slot == 0
    while c.status is not RequestStatus.RUNNING:
        out = h.schedule()
        if any(r is c for r in out.requests):
            assert c.needs_state_reset and c.state_slot != 0
        h.execute(out)
    h.run()
    h.check_outputs()


# ---- randomized soak ------------------------------------------------------------------------
def soak(seed: int, num_requests: int) -> Harness:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8, 16])
    max_model_len = rng.choice([16, 32, 48, 64, 100])
    max_num_seqs = rng.randint(1, 8)
    budget = rng.randint(max_num_seqs, 64)
    # The runner guarantees one max_model_len sequence fits; beyond that, random tightness.
    min_blocks = cdiv(max_model_len, block_size) + 1
    num_blocks = rng.randint(min_blocks, 3 * min_blocks)
    use_priority = rng.random() < 0.5
    h = Harness(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=budget, max_model_len=max_model_len)

    def add(i: int) -> None:
        prompt_len = rng.randint(1, max_model_len - 1)
        max_tokens = rng.randint(1, max_model_len - prompt_len)
        h.new(f"s{seed}-{i}", prompt_len, max_tokens,
              priority=rng.randint(0, 3) if use_priority else 0)

    h.soak(rng, num_requests, add, bursts=(0, 0, 1, 1, 2, 4), max_steps=50_000)
    for req in h.requests:
        assert req.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
    return h


def test_randomized_soak_keeps_every_invariant():
    preemptions = 0
    for seed in range(12):
        preemptions += soak(seed, num_requests=30).scheduler.num_preemptions
    assert preemptions > 0, "the soak should exercise preemption"


def test_step_limits_cap_a_step_below_the_configured_budget():
    """While a background warm-up runs, steps must fit the compiled buckets: the limits cut
    the token budget (chunking prompts) and the sequences per step; lifting them gives the
    configured budget back, and every request still completes exactly."""
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(6):
        h.new(f"r{i}", prompt_len=10 + i, max_tokens=5)
    for _ in range(6):
        out = h.scheduler.schedule(limits=(16, 2))
        assert out.total_num_scheduled_tokens <= 16 and len(out.requests) <= 2
        assert len(h.scheduler.running) <= 2
        h.execute(out)
    out = h.scheduler.schedule()
    assert len(out.requests) > 2 and out.total_num_scheduled_tokens > 16
    h.execute(out)
    h.run()
    assert sorted(r.request_id for r in h.finished) == [f"r{i}" for i in range(6)]


# ---- speculative decoding -------------------------------------------------------------------
@pytest.mark.parametrize("corrupt", [0.0, 0.3])
def test_speculative_soak_keeps_every_invariant_and_every_token(corrupt, monkeypatch):
    """Proposals are verified by the fake model; kept ones extend the output by several
    tokens a step, rejected ones are recomputed: every output equals plain decoding's, under
    preemption, chunked prefill, prefix caching, aborts and tight budgets."""
    accepted = rejected = preemptions = 0
    for seed in range(10):
        monkeypatch.setattr("jaxserve.core.scheduler.propose_ngram", oracle(corrupt, seed))
        rng = random.Random(100 + seed)
        block_size, max_model_len = rng.choice([1, 2, 4, 8]), rng.choice([32, 48, 64])
        max_num_seqs = rng.randint(1, 6)
        min_blocks = cdiv(max_model_len, block_size) + 1
        h = Harness(num_blocks=rng.randint(min_blocks, 3 * min_blocks), block_size=block_size,
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=rng.randint(max_num_seqs, 40),
                    max_model_len=max_model_len, enable_caching=rng.random() < 0.5,
                    speculative=SpeculativeConfig(num_speculative_tokens=rng.randint(1, 5)))

        def add(i: int, h=h, rng=rng, seed=seed, max_model_len=max_model_len) -> None:
            prompt_len = rng.randint(1, max_model_len - 1)
            tag = rng.randint(0, 3)  # shared prompts: prefix-cache hits
            h.new(f"s{seed}-{i}", prompt_len, rng.randint(1, max_model_len - prompt_len),
                  tag=tag)

        h.soak(rng, 25, add, bursts=(0, 1, 1, 2, 4), max_steps=20_000)
        stats = h.scheduler.spec_stats
        accepted += stats.num_accepted_tokens
        rejected += stats.num_draft_tokens - stats.num_accepted_tokens
        preemptions += h.scheduler.num_preemptions
        assert stats.num_accepted_tokens == sum(stats.accepted_per_pos)
    assert accepted > 100 and preemptions > 0
    assert (rejected > 50) if corrupt else rejected == 0


def test_no_proposals_where_a_sampling_stage_depends_on_earlier_tokens(monkeypatch):
    """Penalties (counts), min_tokens (stop tokens masked until then) and the end of
    max_tokens rule proposals out; the rest get them."""
    monkeypatch.setattr("jaxserve.core.scheduler.propose_ngram", oracle(0.0, 0))
    h = Harness(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                speculative=SpeculativeConfig(num_speculative_tokens=4))
    kinds = {"plain": {}, "penalty": dict(repetition_penalty=1.2),
             "presence": dict(presence_penalty=0.5), "min_tokens": dict(min_tokens=6)}
    reqs = {}
    for name, extra in kinds.items():
        params = SamplingParams(max_tokens=12, ignore_eos=True, **extra)
        reqs[name] = h.add(Request(name, prompt_ids(len(reqs), 5), params, seed=0,
                                   max_model_len=256, eos_token_ids=frozenset({7})))
    proposed = {name: [] for name in kinds}
    while h.scheduler.num_unfinished:
        out = h.schedule()
        for req in out.requests:
            if req.num_tokens > req.num_prompt_tokens:
                proposed[req.request_id].append((req.num_output_tokens, req.num_proposed))
        h.execute(out)
    assert all(n == 0 for _, n in proposed["penalty"] + proposed["presence"])
    # The oracle proposes 0..k tokens; never more than max_tokens leaves room for.
    assert any(n > 0 for _, n in proposed["plain"])
    assert all(done + n < 12 for done, n in proposed["plain"])
    # min_tokens: none while below it, then some.
    assert all(n == 0 for done, n in proposed["min_tokens"] if done < 6)
    assert any(n > 0 for done, n in proposed["min_tokens"])
    h.check_outputs()
    for req in reqs.values():
        assert req.num_output_tokens == 12


def test_proposals_never_push_a_step_into_a_bigger_bucket_they_do_not_fill(monkeypatch):
    """Token buckets 16, 32, 64: ten decoding requests with 4 proposals each would need 50
    tokens (padded to 64); the deepest proposals are dropped down to 32, evenly. With 3
    requests (3 tokens, padded to 16 anyway) all 12 proposals fit in the 16."""
    monkeypatch.setattr("jaxserve.core.scheduler.propose_ngram", oracle(0.0, 0, every=True))
    for count, total, per_row in ((10, 32, {2, 3}), (3, 15, {4})):
        h = Harness(num_blocks=200, block_size=4, max_num_seqs=16, max_num_batched_tokens=64,
                    speculative=SpeculativeConfig(num_speculative_tokens=4))
        for i in range(count):
            h.new(f"r{i}", prompt_len=3, max_tokens=40)
        while True:
            out = h.schedule()
            if all(r.num_output_tokens for r in out.requests) and len(out.requests) == count:
                break
            h.execute(out)
        proposals = [r.num_proposed for r in out.requests]
        assert out.total_num_scheduled_tokens == total
        assert set(proposals) == per_row
        h.execute(out)
        h.run()
        h.check_outputs()


def test_disable_by_batch_size_stops_proposals_while_many_run(monkeypatch):
    monkeypatch.setattr("jaxserve.core.scheduler.propose_ngram", oracle(0.0, 0, every=True))
    h = Harness(num_blocks=200, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                speculative=SpeculativeConfig(num_speculative_tokens=2,
                                              disable_by_batch_size=2))
    for i in range(4):
        h.new(f"r{i}", prompt_len=3, max_tokens=8 + 6 * i)
    seen = []
    while h.scheduler.num_unfinished:
        running = len(h.scheduler.running)
        out = h.schedule()
        seen.append((running, sum(r.num_proposed for r in out.requests)))
        h.execute(out)
    assert all(proposed == 0 for running, proposed in seen if running > 2)
    assert any(proposed > 0 for running, proposed in seen if running <= 2)
    h.check_outputs()


# ---- asynchronous scheduling ----------------------------------------------------------------
def _device_step(out: SchedulerOutput, kv: np.ndarray, last_tokens: dict,
                 builder: StepInputBuilder, config: SchedulerConfig):
    """The fake device: feeds placeholders from the last token sampled for each state slot,
    writes the step's tokens into the simulated KV cache and samples next_token(context)
    for each row that samples, reading the context back through its block table."""
    total, rows = out.total_num_scheduled_tokens, len(out.requests)
    num_tokens, num_rows = config.pick_bucket(total, rows)
    batch, sampling = build_inputs(builder, out, num_tokens, num_rows)
    block_size = builder.block_size
    feed = batch["feed_slots"][:total]
    tokens = batch["token_ids"][:total].astype(np.int64)
    for i in np.flatnonzero(feed):
        tokens[i] = last_tokens[int(feed[i])]
    last_tokens["fed"] = last_tokens.get("fed", 0) + int(np.count_nonzero(feed))
    kv[batch["slot_mapping"][:total]] = tokens
    sampled = np.full(rows, -1, np.int64)
    for row, req in enumerate(out.requests):
        if not out.samples[row]:
            continue
        pos = np.arange(batch["kv_lens"][row])
        context = kv[batch["block_tables"][row][pos // block_size] * block_size +
                     pos % block_size]
        sampled[row] = next_token(context)
        last_tokens[req.state_slot] = int(sampled[row])
    return types.SimpleNamespace(token_ids=sampled, logprobs=np.zeros(rows))


@pytest.mark.parametrize("enable_caching", [False, True])
def test_asynchronous_steps_give_every_request_its_exact_tokens(enable_caching):
    """Step N+1 is scheduled before step N is folded in, its decode inputs placeholders the
    device fills from N's samples. Under preemption (a small pool), prefix caching, aborts
    and length limits, every request gets exactly the tokens of the fake model, never one
    past its limit, and everything is freed at the end."""
    block_size, num_blocks = 4, 28
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=96)
    kv_manager = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching)
    scheduler = Scheduler(config, kv_manager)
    kv = np.full(num_blocks * block_size, -1, np.int64)
    last_tokens: dict[int, int] = {}
    builder = StepInputBuilder(config.max_num_seqs, block_size,
                               cdiv(config.max_model_len, block_size))
    rng = random.Random(7)
    requests, aborted = [], []
    pending = None  # the step on the fake device, not folded in yet
    steps = 0
    while len(requests) < 40 or scheduler.num_unfinished or pending is not None:
        steps += 1
        assert steps < 5000, "no progress"
        if len(requests) < 40 and rng.random() < 0.5:
            shared = 8 if enable_caching and rng.random() < 0.5 else 0
            req = make_request(f"r{len(requests)}", shared + rng.randint(3, 20),
                               rng.randint(1, 30), max_model_len=config.max_model_len,
                               tag=0 if shared else None)
            requests.append(req)
            scheduler.add(req)
        live = list(scheduler.running) + list(scheduler.waiting)
        if live and rng.random() < 0.02:
            victim = rng.choice(live)
            scheduler.finish(victim, RequestStatus.FINISHED_ABORTED)
            aborted.append(victim)
        out = scheduler.schedule()
        for req in out.requests:
            assert req.num_placeholders <= 2
            assert req.num_computed_tokens <= req.num_prompt_tokens + req.max_output_tokens
            if enable_caching:
                check_named(req, block_size)
        step = (out, _device_step(out, kv, last_tokens, builder, config)) \
            if not out.empty else None
        if pending is not None:
            scheduler.update_from_output(*pending)
        pending = step
    assert scheduler.num_preemptions > 0, "the pool was meant to be too small"
    assert last_tokens["fed"] > 100, "decode inputs were meant to be placeholders"
    for req in requests:
        assert req.finished and held_blocks(req) == [] and req.state_slot == 0
        assert req.num_output_tokens <= req.max_output_tokens
        if req.status is RequestStatus.FINISHED_LENGTH:
            assert req.num_output_tokens == req.max_output_tokens
        assert req.output_token_ids == expected_outputs(req.prompt_token_ids,
                                                        req.num_output_tokens), req.request_id
    assert any(r not in aborted for r in requests)
    assert kv_manager.pool.num_free == num_blocks - 1
    assert sorted(scheduler._free_slots) == list(range(1, config.max_num_seqs + 1))


class _CountedBlocks(list):
    """A request's block ids, counting the ids read (by index, slice or iteration)."""

    read = 0

    def __getitem__(self, index):
        items = super().__getitem__(index)
        _CountedBlocks.read += len(items) if isinstance(index, slice) else 1
        return items

    def __iter__(self):
        _CountedBlocks.read += len(self)
        return super().__iter__()


def test_input_building_reads_only_the_blocks_each_step_adds():
    """Work per step follows the new tokens, not the sequences' lengths: the runner's input
    builder keeps each request's block table by state slot and reads only the block ids
    added since its previous step (here fewer than one decode step's worth of whole
    tables over the whole run)."""
    block_size, max_len = 4, 256
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=max_len)
    scheduler = Scheduler(config, KVCacheManager(300, block_size))
    builder = StepInputBuilder(4, block_size, cdiv(max_len, block_size))
    requests = [make_request(f"r{i}", 60 + 5 * i, 120) for i in range(4)]
    for req in requests:
        scheduler.add(req)
    built_read = 0  # block ids the builder read
    tables_read = 0  # what rebuilding every table at every step would read
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        for req in out.requests:
            if req.block_ids and not isinstance(req.block_ids[0], _CountedBlocks):
                req.block_ids[0] = _CountedBlocks(req.block_ids[0])
        tables_read += sum(len(held_blocks(req)) for req in out.requests)
        num_tokens, num_rows = config.pick_bucket(out.total_num_scheduled_tokens,
                                                  len(out.requests))
        _CountedBlocks.read = 0
        builder.build(out, num_tokens, num_rows)
        built_read += _CountedBlocks.read
        sampled = np.full(len(out.requests), 7, np.int64)
        scheduler.update_from_output(out, types.SimpleNamespace(
            token_ids=sampled, logprobs=np.zeros(len(sampled))))
    blocks = sum(cdiv(req.num_tokens, block_size) for req in requests)
    assert 0 < built_read <= blocks  # each block id read once
    assert tables_read > 30 * blocks


def test_the_packed_step_is_what_the_device_unpacks():
    """The runner sends build_packed's one buffer; the compiled step unpacks it by the
    layout of the bucket's arrays (packing.unpack). For a step of prefill chunks, decodes
    and newly admitted rows, every array the device gets equals the builder's."""
    import jax.numpy as jnp

    from jaxserve.backends.jax.packing import layout_of, unpack

    block_size, config = 4, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40,
                                            max_model_len=64)
    scheduler = Scheduler(config, KVCacheManager(200, block_size))
    builder = StepInputBuilder(8, block_size, cdiv(64, block_size))
    for i in range(6):
        scheduler.add(make_request(f"p{i}", 5 + 7 * i, 6, max_model_len=64))
    kinds = set()
    while scheduler.num_unfinished:
        out = scheduler.schedule()
        kinds.add("decode" if out.total_num_scheduled_tokens == len(out.requests) else "mixed")
        num_tokens, num_rows = config.pick_bucket(out.total_num_scheduled_tokens,
                                                  len(out.requests))
        packed, layout = builder.build_packed(out, num_tokens, num_rows)
        batch, sampling = build_step_inputs(out, num_tokens, num_rows, block_size,
                                            builder.blocks_per_seq)
        arrays = {**batch, **sampling}
        assert layout == layout_of(arrays)
        for name, value in unpack(jnp.asarray(packed), layout).items():
            assert value.dtype == arrays[name].dtype, name
            assert np.array_equal(np.asarray(value), arrays[name]), name
        scheduler.update_from_output(out, types.SimpleNamespace(
            token_ids=np.full(len(out.requests), 7, np.int64),
            logprobs=np.zeros(len(out.requests))))
    assert kinds == {"decode", "mixed"}
