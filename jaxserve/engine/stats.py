"""EngineStats: one immutable snapshot of an engine's load and counters.

Taken on the engine thread (LLMEngine.stats()), so readers on other threads (the server's
admission check, /metrics, the 10-second log line) never touch the scheduler's queues or
the block pool while the engine changes them. A data-parallel front end merges its
replicas' snapshots (EngineStats.merge).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EngineStats:
    running: int = 0  # sequences in the running set
    waiting: int = 0  # sequences waiting (new or preempted)
    unfinished_requests: int = 0  # requests (of n sequences each) not finished
    kv_usage: float = 0.0  # fraction of the usable KV blocks in use, 0..1
    kv_capacity_tokens: int = 0  # tokens the usable KV blocks hold
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache so far
    prefix_cache_hits: int = 0  # of those, tokens served from it
    preemptions: int = 0  # so far
    compilations: int = 0  # XLA compilations in this process so far
    compiling: int = 0  # functions being compiled now
    warm_up_done: bool = True  # every bucket compiled
    # Speculative decoding, so far: rows that verified proposals, proposals verified, kept,
    # and kept by position (K entries; empty when the engine does not speculate).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # Data parallelism: replicas in all, and (rank, why) of those lost (their host died).
    replicas: int = 1
    replicas_lost: tuple[tuple[int, str], ...] = ()
    # LoRA (enable_lora): the adapters of the running and of the waiting requests, by name,
    # and the engine's max_loras (0: LoRA off).
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_loras: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries \
            if self.prefix_cache_queries else 0.0

    @classmethod
    def merge(cls, parts: list[EngineStats]) -> EngineStats:
        """Replicas seen as one: counts summed, KV usage averaged (replicas have equal
        pools), compilations process-wide (the first's), warm-up done when all are."""
        return cls(
            running=sum(p.running for p in parts), waiting=sum(p.waiting for p in parts),
            unfinished_requests=sum(p.unfinished_requests for p in parts),
            kv_usage=sum(p.kv_usage for p in parts) / len(parts),
            kv_capacity_tokens=sum(p.kv_capacity_tokens for p in parts),
            prefix_cache_queries=sum(p.prefix_cache_queries for p in parts),
            prefix_cache_hits=sum(p.prefix_cache_hits for p in parts),
            preemptions=sum(p.preemptions for p in parts),
            compilations=parts[0].compilations, compiling=sum(p.compiling for p in parts),
            warm_up_done=all(p.warm_up_done for p in parts),
            spec_drafts=sum(p.spec_drafts for p in parts),
            spec_draft_tokens=sum(p.spec_draft_tokens for p in parts),
            spec_accepted_tokens=sum(p.spec_accepted_tokens for p in parts),
            spec_accepted_per_pos=tuple(map(sum, zip(*(p.spec_accepted_per_pos
                                                       for p in parts)))),
            lora_running=tuple(sorted({n for p in parts for n in p.lora_running})),
            lora_waiting=tuple(sorted({n for p in parts for n in p.lora_waiting})),
            max_loras=parts[0].max_loras)


# The stages of the engine thread's work per step, in order (HostTimes).
STAGES = ("schedule", "prepare", "wait", "fold", "outputs")


class HostTimes:
    """Seconds the engine thread spent in each stage of its steps, summed since it started
    (a clock read per stage per step): schedule (Scheduler.schedule), prepare (grammar
    masks, inputs, launch: the runner's dispatch), wait (blocked until the device's results
    came: the runner's fetch), fold (results into the requests: tokens, stops, grammars,
    logprobs), outputs (detokenizing, RequestOutputs). All but wait is host work."""

    def __init__(self) -> None:
        self.steps = 0
        self.seconds = dict.fromkeys(STAGES, 0.0)

    def add(self, stage: str, seconds: float) -> None:
        self.seconds[stage] += seconds
