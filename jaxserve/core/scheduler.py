"""Scheduler: owns request and block state; forms each step's ragged batch under a token
budget and folds each finished step back in (host side).

One invariant, as in vLLM v1: every scheduled request moves num_computed_tokens toward
num_tokens. Running requests go first (oldest first), then waiting ones in FCFS order (by
priority first, when given). Long prompts are cut into chunks that fit the budget. When the
KV pool runs dry, the newest running request is preempted: its blocks are freed and it is
recomputed later (from its cached prefix, when prefix caching still holds its blocks).

A waiting request is admitted with its cached prefix (KVCacheManager.get_computed_blocks):
it starts with those blocks and num_computed_tokens at their end, and only the rest is
scheduled and charged to the token budget.

Speculative decoding (n-gram, spec_decode.py): a decoding request that may speculate gets
up to K proposals from its own tokens, scheduled after its last token (they count against
the budget and get KV slots like any token, but only the budget left by the running
requests' own tokens and the prompts admitted). spec_policy.py then keeps those that pay for
the bucket they need, from the step times the engine measures (observe_step) and the
acceptance seen so far; the others are dropped before the step runs. The step emits the
accepted proposals plus one token; the computed count then drops back past the rejected
ones, whose KV slots the next step overwrites.

Every change to requests and blocks goes through here: schedule, then update_from_output
with the step's sampled tokens (computed tokens, appended tokens, stop tokens, EOS, length),
finish (stop strings, aborts, failures) and recompute (a step lost on the device).
"""

from __future__ import annotations

import time
from collections import deque

from jaxserve.config.engine_config import SchedulerConfig
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.lora_slots import LoraSlots
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.core.spec_decode import SpecDecodeStats, propose_ngram
from jaxserve.core.spec_policy import StepTimes, expected_gains, proposals_to_keep


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 speculative: SpeculativeConfig | None = None,
                 lora_slots: LoraSlots | None = None) -> None:
        """lora_slots: the device's LoRA slots (enable_lora), handed out at admission."""
        self.config = config
        self.lora_slots = lora_slots
        self.kv_manager = kv_manager
        self.speculative = speculative
        self.spec_stats = SpecDecodeStats.empty(
            speculative.num_speculative_tokens if speculative else 0)
        self._speculating = False  # this step makes proposals (see schedule)
        self._step_times = StepTimes(config.token_buckets)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._free_slots = list(range(config.max_num_seqs, 0, -1))  # penalty-state rows
        self._admitted: list[Request] = []  # admitted by the last schedule()

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        """Queue a request: last (fcfs), or after every waiting request of the same or a
        lower priority value (priority policy)."""
        index = len(self.waiting)
        if self.config.policy == "priority":
            while index and self.waiting[index - 1].priority > request.priority:
                index -= 1
        self.waiting.insert(index, request)

    def schedule(self, limits: tuple[int, int] | None = None) -> SchedulerOutput:
        """limits: (tokens, sequences) this step may hold at most, below the configured
        budget (the compiled buckets while a background warm-up runs); a running request
        over the sequence limit waits for a later step.

        A step may be scheduled while the previous one is still in flight (asynchronous
        scheduling): a request's tokens then include placeholders for what that step
        samples, and a decoding request's next input is its placeholder. A request whose
        inputs need its known tokens (a grammar, bad words) waits for them; one whose
        placeholders already reach its length limit is not scheduled again.

        Three stages fill the step: the running pass (_schedule_running), the waiting pass
        (_schedule_waiting), and the rows' records for what neither advanced
        (_advance_rest)."""
        budget = self.config.max_num_batched_tokens
        max_seqs = self.config.max_num_seqs
        if limits is not None:
            budget, max_seqs = min(budget, limits[0]), min(max_seqs, limits[1])
        self._start_step()
        # The step being formed: its rows are appended as the passes schedule them.
        step = SchedulerOutput([], [], [], [], [], [])
        budget = self._schedule_running(step, budget, max_seqs)
        self._schedule_waiting(step, budget, max_seqs)
        self._advance_rest(step)
        return step

    def _start_step(self) -> None:
        """What the last step's forming left: the requests it admitted have had their reset
        step dispatched. Decide whether this step makes proposals (speculative decoding, up
        to disable_by_batch_size running requests)."""
        for request in self._admitted:
            request.needs_state_reset = False
        self._admitted = []
        spec = self.speculative
        self._speculating = spec is not None and (spec.disable_by_batch_size is None or len(
            self.running) <= spec.disable_by_batch_size)

    def _schedule_running(self, step: SchedulerOutput, budget: int, max_seqs: int) -> int:
        """The running pass: each running request in order (oldest first) gets its next
        tokens (a decode token and, when speculating, its proposals; or its prompt's next
        chunk) while the budget and the sequence limit allow, preempting newer ones when the
        KV pool cannot hold them (_make_room). A request waiting for a step in flight is
        passed over. Without proposals each row advances past the step as it is scheduled;
        with them the counts are final only after the waiting pass. The budget left."""
        scheduled, counts = step.requests, step.num_scheduled_tokens
        # Each row's first position, and whether it samples (then the request has one more
        # placeholder until the step is folded in), as its request advances past the step.
        firsts, samples = step.num_computed_tokens, step.samples
        kv, running, speculating = self.kv_manager, self.running, self._speculating
        # The running requests' own tokens come before any proposal.
        reserved = 0
        if speculating:
            reserved = sum(r.num_tokens + r.num_placeholders - r.num_computed_tokens
                           for r in running[:max_seqs])
        index = 0
        while index < len(running) and budget > 0 and len(scheduled) < max_seqs:
            request = running[index]
            waiting_for = request.num_placeholders
            remaining = request.num_tokens + waiting_for - request.num_computed_tokens
            if waiting_for and (request.needs_known_tokens or remaining <= 0 or
                                request.num_tokens - request.num_prompt_tokens + waiting_for
                                >= request.max_output_tokens):
                index += 1  # its next input is not known yet, or it ends in flight
                reserved -= remaining
                continue
            if speculating:
                reserved -= remaining
                num_new = self._count_with_proposals(request, remaining, budget, reserved)
            else:
                num_new = remaining if remaining < budget else budget
            # (kv_room: whether its blocks already hold the step, without a call)
            if request.num_computed_tokens + num_new > request.kv_room and \
                    not kv.allocate_slots(request, num_new) and \
                    not self._make_room(request, num_new, index, step.preempted):
                break
            scheduled.append(request)
            counts.append(num_new)
            budget -= num_new
            index += 1
            if not speculating:  # its count is final: it advances past the step now
                # (_advance_rest's loop inlined: the one every decode row goes through)
                first = request.num_computed_tokens
                firsts.append(first)
                request.num_computed_tokens = first + num_new
                request.steps_in_flight += 1
                if num_new - request.num_proposed >= remaining:  # it samples
                    samples.append(True)
                    request.num_placeholders += 1
                else:
                    samples.append(False)
        return budget

    def _count_with_proposals(self, request: Request, remaining: int, budget: int,
                              reserved: int) -> int:
        """A speculating step's count for a running request: its `remaining` own tokens and
        the proposals that fit what the budget keeps after the other running requests' own
        tokens (`reserved`), when its blocks can hold them: proposals never preempt."""
        request.num_proposed = self._propose(request, budget - remaining - reserved)
        num_new = min(remaining + request.num_proposed, budget)
        if request.num_proposed and not self.kv_manager.allocate_slots(request, num_new):
            request.num_proposed = 0  # no room for proposals: never preempt for them
            num_new = min(remaining, budget)
        return num_new

    def _make_room(self, request: Request, num_new: int, index: int,
                   preempted: list[Request]) -> bool:
        """Preempt running requests (_victim) until `request`, running[index], gets blocks
        for num_new more tokens, or is itself the one preempted (then False). Each one
        preempted goes into `preempted`.

        Victims come from running past index: none of them has been scheduled in this pass.
        That matters for prefix caching: allocate_slots registers the blocks a scheduled
        request fills this step, and those must be written by this step; a scheduled request
        is never preempted before."""
        while True:
            victim = self._victim(index)
            self.running.remove(victim)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request or self.kv_manager.allocate_slots(request, num_new):
                break
        return request.status is RequestStatus.RUNNING

    def _schedule_waiting(self, step: SchedulerOutput, budget: int, max_seqs: int) -> None:
        """The waiting pass: admit waiting requests (_admit) with what the running pass left.
        Their prompt tokens come before proposals too: proposals keep only the budget
        admission leaves (a prompt token is always used, a proposal only if kept), chosen
        then (_choose_proposals); what they leave may admit more."""
        proposed = sum(r.num_proposed for r in step.requests) if self._speculating else 0
        budget = self._admit(step, budget + proposed, max_seqs)
        if proposed:
            budget -= self._choose_proposals(step.requests, step.num_scheduled_tokens,
                                             budget)
            # The head of the queue may have been refused blocks for a bigger chunk.
            self._admit(step, budget, max_seqs)

    def _advance_rest(self, step: SchedulerOutput) -> None:
        """Complete the step's row records: the rows not advanced yet (admitted ones; with
        proposals, all: their counts were chosen last) record their first position and
        whether they sample, and their requests advance past the step (a sampling row gives
        its request a placeholder)."""
        requests, counts = step.requests, step.num_scheduled_tokens
        firsts, samples = step.num_computed_tokens, step.samples
        done = len(firsts)
        for request, count in zip(requests[done:], counts[done:]):
            first = request.num_computed_tokens
            firsts.append(first)
            end = request.num_computed_tokens = first + count
            request.steps_in_flight += 1
            # Proposals are written after the known tokens (and count in `count`).
            sampling = end - request.num_proposed >= request.num_tokens + \
                request.num_placeholders
            samples.append(sampling)
            if sampling:
                request.num_placeholders += 1

    def _admit(self, step: SchedulerOutput, budget: int, max_seqs: int) -> int:
        """Admit waiting requests in order while the budget, the sequence limit and the KV
        pool allow, and only when nothing had to give way this step, each with its cached
        prefix (its rows into the step's new_rows); the budget left."""
        scheduled = step.requests
        while (not step.preempted and self.waiting and budget > 0
               and len(self.running) < max_seqs and len(scheduled) < max_seqs):
            request = self._next_to_admit()
            if request is None:
                break
            if request.steps_in_flight:
                break  # preempted while a step held it: it starts over once that is folded
            hits = self.kv_manager.get_computed_blocks(request)  # no reference taken yet
            num_hit = len(hits) * self.kv_manager.block_size
            num_new = min(request.num_tokens - num_hit, budget)
            if not self.kv_manager.allocate_slots(request, num_new, hits):
                break
            self._start_running(request, num_hit)
            step.new_rows.append(len(scheduled))
            scheduled.append(request)
            step.num_scheduled_tokens.append(num_new)
            budget -= num_new
        return budget

    def _next_to_admit(self) -> Request | None:
        """The waiting request to admit next: the head of the queue, or, when its LoRA
        adapter waits for a slot, the first one that can run (None: none can)."""
        request = self.waiting[0]
        if self.lora_slots is not None and not self.lora_slots.can_admit(request.lora):
            request = next((r for r in self.waiting
                            if self.lora_slots.can_admit(r.lora)), None)
        return request

    def _start_running(self, request: Request, num_hit: int) -> None:
        """Move an admitted request (its blocks allocated) from waiting to running: its LoRA
        and state slots, num_computed_tokens at the end of its num_hit cached tokens, the
        prefix-cache lookup recorded."""
        if request is self.waiting[0]:
            self.waiting.popleft()
        else:
            self.waiting.remove(request)
        if self.lora_slots is not None:
            request.lora_slot = self.lora_slots.acquire(request.lora)
        request.num_computed_tokens = num_hit
        self.kv_manager.record_lookup(request, num_hit)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit
        request.status = RequestStatus.RUNNING
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
        request.state_slot = self._free_slots.pop()
        request.num_proposed = 0
        request.needs_state_reset = True
        self._admitted.append(request)
        self.running.append(request)

    def lora_stats(self) -> dict:
        """EngineStats' LoRA fields (vllm:lora_requests_info): the names of the adapters of
        the running and of the waiting requests, and max_loras (0: LoRA off)."""
        if self.lora_slots is None:
            return {}
        waiting = sorted({r.lora.lora_name for r in self.waiting if r.lora is not None})
        return dict(lora_running=self.lora_slots.running_names(), lora_waiting=tuple(waiting),
                    max_loras=len(self.lora_slots.holds))

    def _propose(self, request: Request, room: int) -> int:
        """Propose up to K tokens for a decoding request (written after its tokens, see
        Request.set_proposals) within `room` budget tokens; how many."""
        spec = self.speculative
        if not self._speculating or room <= 0 or not request.may_speculate:
            return 0
        k = min(spec.num_speculative_tokens, room, request.max_proposals)
        if k <= 0:
            return 0
        proposals = propose_ngram(request.token_ids[: request.num_tokens],
                                  spec.prompt_lookup_min, spec.prompt_lookup_max, k)
        request.set_proposals(proposals)
        return len(proposals)

    def _choose_proposals(self, scheduled: list[Request], counts: list[int],
                          room: int) -> int:
        """Keep at most `room` proposals, those that pay for the token bucket they need
        (spec_policy.py); drop the rest, the least likely to be kept first. Returns how many
        are kept."""
        proposed = sum(r.num_proposed for r in scheduled)
        rows = [i for i, r in enumerate(scheduled) if r.num_proposed]
        gains = [expected_gains(self.spec_stats, scheduled[i].spec_drafts,
                                scheduled[i].spec_first_kept, scheduled[i].num_proposed)
                 for i in rows]
        plain = sum(counts) - proposed
        floor = self.config.pick_bucket(plain, len(scheduled))[0]
        keep = proposals_to_keep(plain, floor, gains, self._step_times, room)
        for i, kept in zip(rows, keep):
            counts[i] -= scheduled[i].num_proposed - kept
            scheduled[i].num_proposed = kept
        return sum(keep)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """Step `out` took `seconds` from dispatch to results: what the proposal choice
        weighs a bigger token bucket by (speculative decoding only)."""
        if self.speculative is not None and out.requests:
            bucket = self.config.pick_bucket(out.total_num_scheduled_tokens, len(out.requests))
            self._step_times.observe(bucket[0], seconds)

    def update_from_output(self, out: SchedulerOutput, sampled,
                           num_emitted=None) -> list[tuple[Request, int, int]]:
        """Fold a finished step into its requests: each row that sampled replaces its
        request's placeholder with the token sampled for it, and the request finishes on a
        stop token, EOS or length, freeing its blocks. Rows of requests that finished or
        were preempted since the step was scheduled are dropped.

        sampled.token_ids holds each row's num_proposed + 1 draws, row after row (the
        runner's slots), of which row r emitted num_emitted[r] (i32[R]; None: one each,
        sampled is i32[R]): its accepted proposals and one more. sampled.logprobs (same
        layout) adds to cumulative_logprob when the request asked for logprobs. Rejected
        proposals are uncomputed again. Returns (request, index into sampled of its first new
        token, how many) for each request that got tokens, in batch order."""
        if num_emitted is None:
            return self._take_one_each(out, sampled)
        appended = []
        token_ids = None  # the sampled tokens as a list, converted once when needed
        start = 0  # the row's first slot
        samples = out.samples
        for row, request in enumerate(out.requests):
            first, proposed = start, request.num_proposed
            start += proposed + 1
            request.steps_in_flight -= 1
            if not request.running:
                continue  # stopped (stop string), aborted, failed or preempted meanwhile
            if not samples[row]:
                continue  # a prefill chunk: nothing sampled yet
            request.num_placeholders -= 1
            if token_ids is None:
                token_ids = sampled.token_ids.tolist()
            request.num_proposed = 0
            emitted = int(num_emitted[row])
            if not 1 <= emitted <= proposed + 1:
                raise RuntimeError(f"row {row} emitted {emitted} tokens for {proposed} "
                                   "proposals")
            if proposed:
                request.num_computed_tokens -= proposed - (emitted - 1)
                self.spec_stats.record(proposed, emitted - 1)
                request.spec_drafts += 1
                request.spec_first_kept += emitted > 1
            taken = 0
            for index in range(first, first + emitted):
                if request.params.logprobs is not None:
                    request.cumulative_logprob += float(sampled.logprobs[index])
                taken += 1
                if request.take_token(token_ids[index]):
                    self.finish(request, request.status)
                    break
            appended.append((request, first, taken))
        return appended

    def _take_one_each(self, out: SchedulerOutput, sampled) -> list[tuple[Request, int, int]]:
        """update_from_output of a step without proposals: row r's token is sampled's r-th
        (every decode step of an engine that does not speculate: the loop to keep short)."""
        appended = []
        token_ids = sampled.token_ids.tolist()
        for row, (request, samples) in enumerate(zip(out.requests, out.samples)):
            request.steps_in_flight -= 1
            if not samples or not request.running:
                continue  # a prefill chunk, or stopped, aborted, failed or preempted meanwhile
            request.num_placeholders -= 1
            if request.params.logprobs is not None:
                request.cumulative_logprob += float(sampled.logprobs[row])
            if request.take_token(token_ids[row]):
                self.finish(request, request.status)
            appended.append((request, row, 1))
        return appended

    def drop_step(self, out: SchedulerOutput) -> None:
        """A step whose results will never be folded in (lost on the device): its rows stop
        holding their requests (the engine recomputes or fails them)."""
        for request in out.requests:
            request.steps_in_flight -= 1

    def _victim(self, index: int) -> Request:
        """The running request to preempt, from running[index:]: the newest (fcfs), or the
        one with the lowest priority, newest among equals (priority)."""
        if self.config.policy == "priority":
            return max(self.running[index:], key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.kv_manager.free(request)
        self._release_slot(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_placeholders = 0  # what steps in flight sample for it is dropped
        request.num_proposed = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the front of the waiting queue (of its priority class).
        index = 0
        while (self.config.policy == "priority" and index < len(self.waiting)
               and self.waiting[index].priority < request.priority):
            index += 1
        self.waiting.insert(index, request)

    def recompute(self, request: Request) -> None:
        """Send a running request back to the waiting queue, to be computed again from its
        first token: the results of its last step were lost. Its blocks are freed."""
        if request in self.running:
            self.running.remove(request)
            self._preempt(request)

    def _release_slot(self, request: Request) -> None:
        if request.lora_slot >= 0:
            self.lora_slots.release(request.lora_slot)
            request.lora_slot = -1
        if request.state_slot:
            self._free_slots.append(request.state_slot)
            request.state_slot = 0

    def finish(self, request: Request, status: RequestStatus,
               stop_reason: int | str | None = None, num_tokens: int | None = None) -> None:
        """Take a request out (finished or aborted) and free what it holds. stop_reason: the
        stop string that ended it (a stop token is recorded by update_from_output);
        num_tokens: where its tokens end (a stop string matched before the last of the
        tokens a speculative step appended: the later ones are dropped)."""
        request.status = status
        if stop_reason is not None:
            request.stop_reason = stop_reason
        if num_tokens is not None:
            request.drop_tokens_after(num_tokens)
        if request in self.running:
            self.running.remove(request)
            self.kv_manager.free(request)
            self._release_slot(request)
        elif request in self.waiting:
            self.waiting.remove(request)
