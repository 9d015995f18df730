"""What a router reads from this worker: the SchedulerLoad that gRPC GetLoads answers.

A router (the SMG gateway, vLLM's router) polls GetLoads to balance: its least-load and
power-of-two policies divide the queued prompt tokens by `gen_throughput` (an expected
wait) and weigh KV pressure, and its overload guard leaves out a worker whose waiting queue
or KV usage is past a threshold. The queues, KV usage and prefix-cache hit rate come from
the engine's EngineStats snapshot; the two figures the engine does not keep are estimated
here as vLLM's gRPC servicer estimates them: the tokens generated per second over the last
GEN_THROUGHPUT_WINDOW_S seconds (RollingRate), and the prompt tokens of the waiting
requests not expected from the prefix cache (their prompts discounted by the hit rate, as a
request's cached prefix is known only once it starts). `utilization` is the KV usage, as
SGLang's scheduler and vLLM's servicer report it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from smg_grpc_proto.generated import vllm_engine_pb2 as pb

from jaxserve.engine.stats import EngineStats

# Seconds of generated tokens `gen_throughput` averages: the SMG gateway's default load poll
# interval (--load-monitor-interval 10), so that each poll sees the tokens since the last.
GEN_THROUGHPUT_WINDOW_S = 10.0
_SPANS = 20  # a window is kept as at most this many spans of counts (bounded memory)


class RollingRate:
    """Events per second over the last window_s seconds (tokens generated, for GetLoads).

    Counts are kept in spans of at most window_s / 20 seconds, so memory stays bounded however
    many events come; a span leaves the window window_s seconds after its last event (so the
    rate is 0.0 once window_s seconds pass without one). Until window_s seconds have passed
    since it was made, the rate is over the time since then. Thread-safe: the engine thread adds, the event loop reads.
    clock: seconds, monotonic (time.monotonic; tests pass their own)."""

    def __init__(self, window_s: float = GEN_THROUGHPUT_WINDOW_S, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        self.window_s = float(window_s)
        self._span_s = self.window_s / _SPANS
        self._clock = clock
        self._start = clock()
        self._spans: collections.deque[list] = collections.deque()  # [first, last, count]
        self._total = 0
        self._lock = threading.Lock()

    def add(self, count: int, now: float | None = None) -> None:
        """count events happened now (or at `now`, on the same clock)."""
        if count <= 0:
            return
        now = self._clock() if now is None else now
        with self._lock:
            last = self._spans[-1] if self._spans else None
            if last is not None and now - last[0] < self._span_s:
                last[1] = max(last[1], now)
                last[2] += count
            else:
                self._spans.append([now, now, count])
            self._total += count
            self._drop_old(now)

    def rate(self, now: float | None = None) -> float:
        """Events per second over the window ending now (0.0 when none came in it)."""
        now = self._clock() if now is None else now
        with self._lock:
            self._drop_old(now)
            total = self._total
        if total == 0:
            return 0.0
        return total / max(min(self.window_s, now - self._start), self._span_s)

    def _drop_old(self, now: float) -> None:
        while self._spans and self._spans[0][1] <= now - self.window_s:
            self._total -= self._spans.popleft()[2]


def scheduler_load(stats: EngineStats, *, max_num_seqs: int, gen_throughput: float,
                   waiting_prompt_tokens: int) -> pb.SchedulerLoad:
    """GetLoads' one SchedulerLoad (rank 0) from the engine's snapshot: with data-parallel
    replicas, all that serve seen as one (their queues and KV summed, their max_num_seqs
    too). gen_throughput: tokens per second (RollingRate.rate); waiting_prompt_tokens: the
    prompt tokens of the requests that have not started
    (AsyncLLMEngine.waiting_prompt_tokens)."""
    capacity = stats.kv_capacity_tokens
    serving = stats.replicas - len(stats.replicas_lost)
    hit_rate = stats.prefix_cache_hit_rate
    return pb.SchedulerLoad(
        dp_rank=0, num_running_reqs=stats.running, num_waiting_reqs=stats.waiting,
        num_total_reqs=stats.running + stats.waiting,
        num_used_tokens=round(stats.kv_usage * capacity), max_total_num_tokens=capacity,
        token_usage=stats.kv_usage, gen_throughput=gen_throughput, cache_hit_rate=hit_rate,
        utilization=stats.kv_usage, max_running_requests=max_num_seqs * serving,
        num_waiting_uncached_tokens=round(waiting_prompt_tokens * (1.0 - hit_rate)))
