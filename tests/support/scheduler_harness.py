"""The scheduler test harness: the scheduler and KV-block accounting driven without a model.

A fake runner stands in for the device step. It builds each step's inputs with the real
input builder, writes the scheduled tokens into a simulated paged KV cache through
`slot_mapping`, reads each finished row's context back through its block table, and samples
`next_token(context)`: a hash of the whole context, so every expected output can be computed
by hand (`expected_outputs`). Every step the harness checks the invariants a user would
notice (core/test_scheduler.py; core/test_prefix_caching.py and core/test_spec_policy.py
drive it too). `oracle` is a proposer that knows the fake model, for speculative decoding.
"""

from __future__ import annotations

import random
import types
import zlib

import numpy as np
import pytest

from jaxserve.config.engine_config import SchedulerConfig
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.core.input_builder import StepInputBuilder, build_step_inputs
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import SchedulerOutput

VOCAB = 50_000
PAD = -2  # what padding tokens write (into the null block)


def held_blocks(request) -> list:
    """A request's blocks (its one KV group's list; [] while it holds none)."""
    return request.block_ids[0] if request.block_ids else []


def next_token(context) -> int:
    """The fake model: the next token is a hash of the whole context."""
    return zlib.crc32(np.asarray(context, np.int32).tobytes()) % VOCAB


def expected_outputs(prompt: list[int], num_outputs: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(num_outputs):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def prompt_ids(tag: int, length: int) -> list[int]:
    return [(tag * 7919 + k * 104_729) % VOCAB for k in range(length)]


def make_request(rid: str, prompt_len: int, max_tokens: int, *, max_model_len: int = 256,
                 priority: int = 0, tag: int | None = None) -> Request:
    tag = zlib.crc32(rid.encode()) if tag is None else tag
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt_ids(tag, prompt_len), params, seed=0,
                   max_model_len=max_model_len, eos_token_ids=frozenset(), priority=priority)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Harness:
    """Scheduler + KV manager + fake runner, checking every invariant at every step."""

    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int = 256,
                 enable_caching: bool = False, policy: str = "fcfs",
                 speculative: SpeculativeConfig | None = None) -> None:
        self.config = SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len, policy=policy)
        self.kv_manager = KVCacheManager(num_blocks, block_size, enable_caching=enable_caching)
        self.enable_caching = enable_caching
        self.hash_tokens: dict[bytes, list[int]] = {}  # every block hash seen -> its tokens
        self.scheduler = Scheduler(self.config, self.kv_manager, speculative)
        self.k = speculative.num_speculative_tokens if speculative else 0
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.blocks_per_seq = cdiv(max_model_len, block_size)
        self.inputs = StepInputBuilder(max_num_seqs, block_size, self.blocks_per_seq)
        self.kv = np.full(num_blocks * block_size, -1, np.int64)  # the simulated KV cache
        self.requests: list[Request] = []  # everything added, in order
        self.finished: list[Request] = []  # in finishing order
        self.admitted: list[Request] = []  # in order of (re)admission
        self.outputs: list[SchedulerOutput] = []
        self.produced: list[list[Request]] = []  # per step: the requests that got a token

    # ---- driving --------------------------------------------------------------------------
    def add(self, request: Request) -> Request:
        self.requests.append(request)
        self.scheduler.add(request)
        self.check_state()
        return request

    def new(self, rid: str, prompt_len: int, max_tokens: int, **kwargs) -> Request:
        return self.add(make_request(rid, prompt_len, max_tokens,
                                     max_model_len=self.max_model_len, **kwargs))

    def abort(self, request: Request) -> None:
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        assert held_blocks(request) == [] and request.state_slot == 0
        self.finished.append(request)
        self.check_state()

    def step(self) -> SchedulerOutput:
        out = self.schedule()
        self.execute(out)
        return out

    def run(self, max_steps: int = 100_000) -> int:
        steps = 0
        while self.scheduler.num_unfinished:
            assert steps < max_steps, "the scheduler stopped making progress"
            self.step()
            steps += 1
        self.check_all_free()
        return steps

    # ---- schedule + checks ---------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        s = self.scheduler
        prev_running, prev_waiting = list(s.running), list(s.waiting)
        prev_preemptions = s.num_preemptions
        prev_counts = {id(r): r.num_preemptions for r in prev_running}
        out = s.schedule()
        self.outputs.append(out)
        self.record_hashes(s.running)  # blocks are registered while scheduling
        self.check_schedule(out, prev_running, prev_waiting)

        m = len(out.preempted)
        assert s.num_preemptions == prev_preemptions + m
        if self.config.policy == "fcfs":
            assert list(s.waiting)[:m] == out.preempted[::-1], "preempted go to the front"
        for victim in out.preempted:
            assert victim.status is RequestStatus.PREEMPTED
            assert victim.num_computed_tokens == 0
            assert held_blocks(victim) == [] and victim.state_slot == 0
            assert victim.num_preemptions == prev_counts[id(victim)] + 1
        self.check_state(scheduled=out)
        return out

    def check_schedule(self, out: SchedulerOutput, prev_running: list[Request],
                       prev_waiting: list[Request]) -> None:
        s, cfg = self.scheduler, self.config
        reqs, counts = out.requests, out.num_scheduled_tokens
        assert len(reqs) == len(counts)
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(reqs) <= cfg.max_num_seqs
        assert len({id(r) for r in reqs}) == len(reqs), "a request scheduled twice in one step"
        for req, n, first in zip(reqs, counts, out.num_computed_tokens):
            assert 1 <= n <= req.num_tokens - first + req.num_proposed
            assert req.num_computed_tokens == first + n, "scheduling advances the request"
            assert req.num_proposed <= self.k
            if req.num_proposed:  # proposals only after the last token, all of them
                assert first == req.num_tokens - 1
                assert n == 1 + req.num_proposed
                assert req.num_tokens + req.num_proposed < req.num_prompt_tokens + \
                    req.max_output_tokens
            assert req.status is RequestStatus.RUNNING

        # Running requests first (oldest first, a prefix of the running list); the preempted
        # ones are the newest (a suffix, newest first); then waiting ones in queue order.
        k = sum(1 for r in reqs if any(r is p for p in prev_running))
        from_running, admitted = reqs[:k], reqs[k:]
        assert from_running == prev_running[:k], "running requests go first, oldest first"
        m = len(out.preempted)
        assert out.preempted == prev_running[::-1][:m], "the newest running request gives way"
        assert not any(any(p is r for r in reqs) for p in out.preempted)
        assert admitted == prev_waiting[:len(admitted)], "waiting requests admitted in order"
        assert not (admitted and out.preempted), "admitted while preempting"
        left_out = prev_running[k:len(prev_running) - m]
        assert not left_out or out.total_num_scheduled_tokens == cfg.max_num_batched_tokens, \
            "a running request was skipped although budget was left"
        if admitted:
            assert not left_out, "a waiting request went before a running one"
        for req in admitted:
            assert req.needs_state_reset, "a fresh penalty-state slot must be reset"
        assert s.running == [r for r in prev_running if not any(r is p for p in out.preempted)] \
            + admitted
        self.admitted.extend(admitted)

        # Work-conserving: the head of the queue waits only for a reason.
        budget_left = cfg.max_num_batched_tokens - out.total_num_scheduled_tokens
        if not out.preempted and s.waiting and budget_left and len(s.running) < cfg.max_num_seqs:
            head = s.waiting[0]
            hits = self.kv_manager.get_computed_blocks(head)
            num_hit = len(hits) * self.block_size
            n = min(head.num_tokens - num_hit, budget_left)
            missing = self.kv_manager.blocks_needed(num_hit + n) - len(hits)
            pool = self.kv_manager.pool
            available = pool.num_free - sum(1 for b in hits if pool.ref_counts[b] == 0)
            assert missing > available, "the head of the queue waited for nothing"

    def check_state(self, scheduled: SchedulerOutput | None = None) -> None:
        """Blocks, slots and statuses of every live request (after schedule, the tokens
        scheduled this step count as computed)."""
        s, bs = self.scheduler, self.block_size
        held: list[int] = []
        for req in s.running:
            assert req.status is RequestStatus.RUNNING
            computed = req.num_computed_tokens
            assert computed <= req.num_tokens + req.num_proposed
            if scheduled is None:
                assert computed < req.num_tokens, "a running request is owed no work"
            # Rejected proposals leave their blocks with the request (overwritten next).
            need, most = cdiv(computed, bs), cdiv(max(computed, req.num_tokens + self.k), bs)
            assert need <= len(held_blocks(req)) <= (most if self.k else need), (
                f"{req.request_id} holds {len(held_blocks(req))} blocks for {computed} tokens")
            if req.num_preemptions == 0 and computed < req.num_prompt_tokens:
                assert req.num_output_tokens == 0, "a token before the prompt was computed"
            held += held_blocks(req)
        if self.enable_caching and scheduled is not None:
            for req in scheduled.requests:
                check_named(req, bs)
        for req in s.waiting:
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert held_blocks(req) == [] and req.num_computed_tokens == 0
            assert req.state_slot == 0
        for req in self.finished:
            assert req.finished and held_blocks(req) == [] and req.state_slot == 0
            assert not any(req is r for r in s.running) and not any(req is r for r in s.waiting)

        pool = self.kv_manager.pool
        assert 0 not in held, "the null block was handed out"
        if self.enable_caching:
            self.check_sharing(s.running)
        else:
            assert len(set(held)) == len(held), "a block is held by two requests (or twice)"
        holders = np.bincount(np.asarray(held, np.int64), minlength=self.num_blocks)
        assert pool.num_free + np.count_nonzero(holders) == self.num_blocks - 1, "a block leaked"
        assert pool.ref_counts[0] == 1
        assert (pool.ref_counts[1:] == holders[1:]).all(), "ref counts != holders"
        assert all(pool.is_free(b) == (holders[b] == 0) for b in range(1, self.num_blocks))
        assert self.kv_manager.usage == pytest.approx(
            np.count_nonzero(holders) / (self.num_blocks - 1))

        slots = [r.state_slot for r in s.running]
        assert len(set(slots)) == len(slots), "two running requests share a penalty-state slot"
        assert all(1 <= slot <= self.config.max_num_seqs for slot in slots)
        assert len(s.running) <= self.config.max_num_seqs

    def check_sharing(self, running: list[Request]) -> None:
        """Prefix caching: a block may be held by several requests only if it is a cached
        full block whose hash is that of each holder's block at that position, and a
        request holds each block once. The hash map and its inverse agree."""
        pool = self.kv_manager.pool
        assert {b: h for h, b in pool.cached.items()} == pool.block_hash
        assert 0 not in pool.block_hash, "the null block was cached"
        holders: dict[int, int] = {}
        for req in running:
            assert len(set(held_blocks(req))) == len(held_blocks(req)), "a block held twice"
            for b in held_blocks(req):
                holders[b] = holders.get(b, 0) + 1
        for req in running:
            for i, b in enumerate(held_blocks(req)):
                digest = pool.block_hash.get(b)
                if holders[b] > 1:
                    assert digest is not None, f"block {b} shared but not cached"
                if digest is not None:
                    assert i < len(req.block_hashes) and req.block_hashes[i] == digest, \
                        f"{req.request_id} holds cached block {b} at the wrong position"

    def record_hashes(self, requests: list[Request]) -> None:
        bs = self.block_size
        for req in requests:
            for i, digest in enumerate(req.block_hashes):
                self.hash_tokens[digest] = req.token_ids[i * bs: (i + 1) * bs].tolist()

    def check_cached_kv(self) -> None:
        """After a step: every cached block holds exactly the tokens its hash names."""
        bs = self.block_size
        for digest, b in self.kv_manager.pool.cached.items():
            assert self.kv[b * bs: (b + 1) * bs].tolist() == self.hash_tokens[digest], \
                f"cached block {b} holds other tokens than its hash says"

    def check_all_free(self) -> None:
        assert self.scheduler.num_unfinished == 0
        assert self.kv_manager.pool.num_free == self.num_blocks - 1
        assert self.kv_manager.usage == 0
        assert sorted(self.scheduler._free_slots) == list(range(1, self.config.max_num_seqs + 1))
        for req in self.requests:
            assert req.finished and held_blocks(req) == [] and req.state_slot == 0
            if req.status is RequestStatus.FINISHED_LENGTH:
                assert req.num_output_tokens == req.max_output_tokens

    def soak(self, rng, num_requests: int, add, bursts, max_steps: int) -> None:
        """Random arrivals (add(i) adds request i; a burst size per step from `bursts`) and
        rare aborts, stepping until everything finished; then every end-state check."""
        added = steps = 0
        while added < num_requests or self.scheduler.num_unfinished:
            assert steps < max_steps, "no progress"
            for _ in range(rng.choice(bursts)):
                if added == num_requests:
                    break
                add(added)
                added += 1
            live = list(self.scheduler.running) + list(self.scheduler.waiting)
            if live and rng.random() < 0.015:
                self.abort(rng.choice(live))
            self.step()
            steps += 1
        self.check_all_free()
        self.check_outputs()

    # ---- the fake runner -----------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> None:
        """The step with the model replaced by next_token, folded in by the scheduler's own
        update_from_output (as the engine does)."""
        produced: list[Request] = []
        self.produced.append(produced)
        if out.empty:
            self.check_state()
            return
        bs, total, rows = self.block_size, out.total_num_scheduled_tokens, len(out.requests)
        num_tokens, num_rows = self.config.pick_bucket(total, rows)
        resets = [r.needs_state_reset for r in out.requests]
        batch, sampling = build_inputs(self.inputs, out, num_tokens, num_rows)
        assert sampling["reset_state"][:rows].tolist() == resets
        assert not sampling["reset_state"][rows:].any()
        assert sampling["state_slots"][:rows].tolist() == [r.state_slot for r in out.requests]

        slots = batch["slot_mapping"]
        assert (slots[total:] < bs).all(), "padding must write into the null block"
        self.kv[slots[total:]] = PAD
        self.kv[slots[:total]] = batch["token_ids"][:total]
        sampled = np.full(rows + sum(r.num_proposed for r in out.requests), -1, np.int64)
        emitted = np.ones(num_rows, np.int32)
        assert sampling["num_proposed"][:rows].tolist() == [r.num_proposed
                                                           for r in out.requests]
        completing, firsts, slot = [], {}, 0
        for row, (req, n) in enumerate(zip(out.requests, out.num_scheduled_tokens)):
            first, slot = slot, slot + req.num_proposed + 1  # the row's slots, row after row
            firsts[id(req)] = first
            computed = out.num_computed_tokens[row] + n
            assert batch["kv_lens"][row] == computed
            if computed < req.num_tokens:
                continue  # a prefill chunk: nothing sampled yet
            pos = np.arange(computed)
            context = self.kv[batch["block_tables"][row][pos // bs] * bs + pos % bs]
            np.testing.assert_array_equal(context, req.token_ids[: computed],
                                          err_msg=f"KV of {req.request_id} read back wrong")
            # The model verifies each proposal: keep them while they are its own tokens.
            proposed = req.num_proposed
            for j in range(proposed + 1):
                sampled[first + j] = next_token(context[: req.num_tokens + j])
                if j == proposed or sampled[first + j] != context[req.num_tokens + j]:
                    emitted[row] = j + 1
                    break
            completing.append(req)
        result = types.SimpleNamespace(token_ids=sampled, logprobs=np.zeros(len(sampled)))
        got = self.scheduler.update_from_output(out, result, emitted if self.k else None)
        assert [req for req, _, _ in got] == completing
        for req in out.requests:
            assert req.num_proposed == 0
        for req, first, count in got:
            row = out.requests.index(req)
            assert first == firsts[id(req)] and count <= emitted[row]
            assert count == emitted[row] or req.finished
            assert req.output_token_ids[-count:] == sampled[first: first + count].tolist()
            produced.append(req)
            if req.finished:
                assert req not in self.scheduler.running and held_blocks(req) == []
                self.finished.append(req)
        if self.enable_caching:
            self.check_cached_kv()
        self.check_state()

    def check_outputs(self) -> None:
        for req in self.requests:
            want = expected_outputs(req.prompt_token_ids, req.num_output_tokens)
            assert req.output_token_ids == want, f"{req.request_id}: wrong tokens"




def oracle(corrupt: float, seed: int, every: bool = False):
    """A proposer that knows the fake model: it proposes up to k (every: exactly k) of the
    model's own next tokens, each replaced by a wrong one with probability `corrupt` (so
    some are kept, some rejected)."""
    rng = random.Random(seed)

    def propose(tokens, min_n, max_n, k):
        tokens, out = list(tokens), []
        for _ in range(k if every else rng.randint(0, k)):
            token = next_token(tokens)
            if rng.random() < corrupt:
                token = (token + 1) % VOCAB
            out.append(token)
            tokens.append(token)
        return np.asarray(out, np.int32)
    return propose


def check_named(req: Request, block_size: int) -> None:
    """After a step that scheduled `req` (with prefix caching): each of its full blocks of
    known tokens is registered, as the step writes it (none skipped by the scheduler's
    check that its blocks already hold the step, Request.kv_room), and no other."""
    if req.running:
        full = min(req.num_computed_tokens, req.num_tokens) // block_size
        assert req.num_registered_blocks == full, (req.request_id, req.num_registered_blocks,
                                                   full)
        # What the scheduler's check trusts: room only in blocks it holds, up to the next
        # block to be named.
        assert req.kv_room <= len(held_blocks(req)) * block_size
        assert req.kv_room < (req.num_registered_blocks + 1) * block_size


def build_inputs(builder: StepInputBuilder, out: SchedulerOutput, num_tokens: int,
                  num_rows: int) -> tuple[dict, dict]:
    """A step's inputs from the runner's builder, which keeps its tables across steps (by
    state slot), checked against a fresh build: the same arrays, except that a block table
    row may hold more of the request's own blocks than the step reads."""
    batch, sampling = builder.build(out, num_tokens, num_rows)
    fresh_batch, fresh_sampling = build_step_inputs(out, num_tokens, num_rows,
                                                    builder.block_size, builder.blocks_per_seq)
    for name, fresh in {**fresh_batch, **fresh_sampling}.items():
        kept = batch[name] if name in batch else sampling[name]
        if name != "block_tables":
            assert np.array_equal(kept, fresh), name
            continue
        for row, kv_len in enumerate(batch["kv_lens"]):
            needed = cdiv(int(kv_len), builder.block_size)
            assert np.array_equal(kept[row, :needed], fresh[row, :needed]), row
            rest = kept[row, needed:]
            assert ((rest == 0) | (rest == fresh[row, needed:])).all(), row
    return batch, sampling
