"""Scheduler: forms each step's ragged batch under a token budget (host side).

One invariant, as in vLLM v1: every scheduled request moves num_computed_tokens toward
num_tokens. Running requests go first (oldest first), then waiting ones in FCFS order (by
priority first, when given). Long prompts are cut into chunks that fit the budget. When the
KV pool runs dry, the newest running request is preempted: its blocks are freed and it is
recomputed later (from its cached prefix, when prefix caching still holds its blocks).

A waiting request is admitted with its cached prefix (KVCacheManager.get_computed_blocks):
it starts with those blocks and num_computed_tokens at their end, and only the rest is
scheduled and charged to the token budget.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

from jaxserve.config import SchedulerConfig
from jaxserve.kv_cache_manager import KVCacheManager
from jaxserve.request import Request, RequestStatus


@dataclasses.dataclass
class SchedulerOutput:
    requests: list[Request]  # batch order
    num_scheduled_tokens: list[int]  # per request, same order
    preempted: list[Request]

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._free_slots = list(range(config.max_num_seqs, 0, -1))  # penalty-state rows

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        # Lower value first, FCFS among equals: insert after the last request that goes
        # first. Scanning from the back keeps preempted requests (put at the front) in place.
        index = len(self.waiting)
        while index and self.waiting[index - 1].priority > request.priority:
            index -= 1
        self.waiting.insert(index, request)

    def schedule(self, limits: tuple[int, int] | None = None) -> SchedulerOutput:
        """limits: (tokens, sequences) this step may hold at most, below the configured
        budget (the compiled buckets while a background warm-up runs); a running request
        over the sequence limit waits for a later step."""
        budget = self.config.max_num_batched_tokens
        max_seqs = self.config.max_num_seqs
        if limits is not None:
            budget, max_seqs = min(budget, limits[0]), min(max_seqs, limits[1])
        scheduled: list[Request] = []
        counts: list[int] = []
        preempted: list[Request] = []

        index = 0
        while index < len(self.running) and budget > 0 and index < max_seqs:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv_cache.allocate_slots(request, num_new):
                # Victims come from the end of running, past index: none of them has been
                # scheduled in this pass. That matters for prefix caching: allocate_slots
                # registers the blocks a scheduled request fills this step, and those must
                # be written by this step; a scheduled request is never preempted before.
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            scheduled.append(request)
            counts.append(num_new)
            budget -= num_new
            index += 1

        # Admit waiting requests only when nothing had to give way this step.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < max_seqs):
            request = self.waiting[0]
            hits = self.kv_cache.get_computed_blocks(request)  # no reference taken yet
            num_hit = len(hits) * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_hit, budget)
            if not self.kv_cache.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit
            self.kv_cache.record_lookup(request, num_hit)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:
                request.scheduled_time = time.monotonic()
            request.state_slot = self._free_slots.pop()
            request.needs_state_reset = True
            self.running.append(request)
            scheduled.append(request)
            counts.append(num_new)
            budget -= num_new
        return SchedulerOutput(scheduled, counts, preempted)

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        self._release_slot(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def recompute(self, request: Request) -> None:
        """Send a running request back to the waiting queue, to be computed again from its
        first token: the results of its last step were lost. Its blocks are freed."""
        if request in self.running:
            self.running.remove(request)
            self._preempt(request)

    def _release_slot(self, request: Request) -> None:
        if request.state_slot:
            self._free_slots.append(request.state_slot)
            request.state_slot = 0

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out (finished or aborted) and free what it holds."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
            self.kv_cache.free(request)
            self._release_slot(request)
        elif request in self.waiting:
            self.waiting.remove(request)
