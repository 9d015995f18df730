"""What gRPC GetLoads tells a router (server/loads.py): generation throughput over a rolling
window, the queues and KV usage of the engine's snapshot, the waiting prompt tokens."""

from __future__ import annotations

import asyncio

import pytest

from jaxserve import SamplingParams
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.stats import EngineStats
from jaxserve.server.async_engine import AsyncLLMEngine
from jaxserve.server.loads import RollingRate, scheduler_load


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def load(stats=None, rate=0.0, waiting_prompt_tokens=0):
    return scheduler_load(stats or EngineStats(), max_num_seqs=8, gen_throughput=rate,
                          waiting_prompt_tokens=waiting_prompt_tokens)


def test_gen_throughput_is_the_windows_tokens_per_second_then_zero():
    clock = Clock()
    rate = RollingRate(10.0, clock=clock)
    assert load(rate=rate.rate()).gen_throughput == 0.0  # nothing generated yet
    clock.now += 30.0
    for _ in range(32):  # 320 tokens over 4 seconds (times exact in binary)
        clock.now += 0.125
        rate.add(10)
    assert load(rate=rate.rate()).gen_throughput == 320 / 10.0
    clock.now += 5.0  # all of them still within the last 10 s
    assert rate.rate() == 32.0
    clock.now += 2.0  # the first 3 s of them have left the window (to within a span)
    assert 20.0 <= rate.rate() < 32.0
    clock.now += 3.0 - 2 ** -10  # the last tokens are 10 s old, less a millisecond
    assert rate.rate() > 0.0
    clock.now += 2 ** -10  # and now the window holds none
    assert load(rate=rate.rate()).gen_throughput == 0.0
    rate.add(50)  # generating again
    assert rate.rate() == 5.0


def test_a_young_server_rates_over_its_age_and_memory_stays_bounded():
    clock = Clock()
    rate = RollingRate(10.0, clock=clock)
    clock.now += 2.0
    rate.add(100)
    assert rate.rate() == pytest.approx(50.0)  # 100 tokens in the 2 s it has run
    for _ in range(20_000):  # 200 tokens a second for 100 s
        clock.now += 0.005
        rate.add(1)
    assert len(rate._spans) <= 21
    assert rate.rate() == pytest.approx(200.0, rel=0.06)
    with pytest.raises(ValueError, match="window_s"):
        RollingRate(0)


def test_the_load_tracks_the_engine_snapshot():
    stats = EngineStats(running=3, waiting=2, kv_usage=0.25, kv_capacity_tokens=4096,
                        prefix_cache_queries=200, prefix_cache_hits=50)
    got = load(stats, rate=123.5, waiting_prompt_tokens=40)
    assert (got.num_running_reqs, got.num_waiting_reqs, got.num_total_reqs) == (3, 2, 5)
    assert got.token_usage == got.utilization == 0.25
    assert (got.num_used_tokens, got.max_total_num_tokens) == (1024, 4096)
    assert got.cache_hit_rate == 0.25 and got.gen_throughput == 123.5
    assert got.max_running_requests == 8
    assert got.num_waiting_uncached_tokens == 30  # 40 prompt tokens, a quarter cached
    idle = load(EngineStats(kv_capacity_tokens=4096))
    assert (idle.num_running_reqs, idle.num_waiting_reqs, idle.token_usage,
            idle.utilization, idle.num_used_tokens, idle.num_waiting_uncached_tokens) == \
        (0, 0, 0.0, 0.0, 0, 0)
    # Data-parallel replicas, one of three lost: the two that serve, as one worker.
    replicas = EngineStats(running=5, replicas=3, replicas_lost=((2, "its host died"),))
    assert load(replicas).max_running_requests == 16


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    config = EngineConfig.create(str(tiny_checkpoints["llama"]), max_model_len=128,
                                 max_num_seqs=4, max_num_batched_tokens=64, precompile=False)
    return LLMEngine(config)


def test_waiting_prompt_tokens_are_the_youngest_not_started(engine):
    idle = AsyncLLMEngine(engine, max_waiting_requests=100)  # not started: nothing runs
    processor = engine.processor

    def admitted(request_id, ids, n=1):
        params = SamplingParams(max_tokens=4, n=n, temperature=1.0 if n > 1 else 0.0)
        return processor.process(request_id, None, ids, processor.check_params(params))

    async def main():
        idle._thread = type("Alive", (), {"is_alive": lambda self: True})()
        idle.submit(admitted("a", [5] * 7))
        idle.submit(admitted("b", [5] * 5, n=2))
        idle.submit(admitted("c", [5] * 3))
        # The engine's waiting sequences are the youngest requests: c, then b (2 sequences)
        assert [idle.waiting_prompt_tokens(k) for k in (0, 1, 2, 3, 4, 9)] == \
            [0, 3, 3, 8, 15, 15]
        assert load(EngineStats(waiting=3), waiting_prompt_tokens=idle.waiting_prompt_tokens(
            3)).num_waiting_uncached_tokens == 8

    asyncio.run(main())
