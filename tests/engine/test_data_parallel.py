"""The data-parallel front end with stand-in replicas: routing to the least-loaded replica,
aborts reaching the owner, outputs of every replica, and the merged scheduler and KV views
the server's gauges read. (tests/config/test_mesh.py runs real replicas on fake devices.)"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import sys
import time
import types

import pytest

from jaxserve.core.kv_cache_manager import PrefixCacheStats
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.admission import EngineRequest
from jaxserve.engine.data_parallel import DataParallelEngine
from jaxserve.engine.stats import EngineStats
from jaxserve.server.async_engine import AsyncLLMEngine


@dataclasses.dataclass
class FakeOutput:
    request_id: str
    finished: bool
    outputs: list = dataclasses.field(default_factory=list)
    metrics: object = None


class PassThrough:
    """The admission path, standing in: every request is admitted as it is."""

    def check_params(self, params):
        return params

    def process(self, request_id, prompt, ids, params, priority=0, cache_salt=None,
                lora=None):
        return EngineRequest(request_id, prompt, list(ids), params, priority, cache_salt,
                             lora=lora)


class FakeReplica:
    """Requests finish after `steps_to_finish` steps; counts what it was asked to do. Its
    waiting queue changes as an engine's does: taken in at a step, refilled by adds."""

    def __init__(self, steps_to_finish: int, blocks_used: float, hits: int) -> None:
        self.requests: dict[str, int] = {}
        self.waiting: collections.deque[str] = collections.deque()
        self.steps_to_finish = steps_to_finish
        self.steps = 0
        self.tokenizer, self.runner, self.eos_token_ids = object(), object(), frozenset()
        self.processor = PassThrough()
        self.blocks_used, self.hits = blocks_used, hits
        # What the front end used to read from another thread (the race the snapshot ends).
        self.scheduler = types.SimpleNamespace(waiting=self.waiting, running=[],
                                               num_preemptions=1, num_unfinished=0)
        self.kv_cache = types.SimpleNamespace(usage=blocks_used, queries=10, hits=hits)
        self.num_compilations, self.warm_up_done = 3, True

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self.requests) - len(self.waiting),
                           waiting=len(self.waiting), unfinished_requests=len(self.requests),
                           kv_usage=self.blocks_used, prefix_cache_queries=10,
                           prefix_cache_hits=self.hits, preemptions=1, compilations=3)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_processed(self, request) -> None:
        self.requests[request.request_id] = 0
        self.waiting.append(request.request_id)

    def abort_request(self, request_id, report=True):
        self.requests.pop(request_id)
        if request_id in self.waiting:
            self.waiting.remove(request_id)
        return FakeOutput(request_id, True)

    log: list | None = None  # shared by the replicas of one engine: ("begin"/"step", self)

    def begin_step(self):
        if self.log is not None:
            self.log.append(("begin", self))

    def step(self, final_only=False, wanted=None):
        if self.log is not None:
            self.log.append(("step", self))
        self.steps += 1
        for _ in range(len(self.waiting)):
            self.waiting.popleft()
            time.sleep(0)  # let other threads run while the queue changes
        outputs = []
        for request_id in list(self.requests):
            self.requests[request_id] += 1
            done = self.requests[request_id] >= self.steps_to_finish
            if done:
                del self.requests[request_id]
            outputs.append(FakeOutput(request_id, done))
        return outputs


def make_engine():
    config = types.SimpleNamespace(parallel=types.SimpleNamespace(data_parallel_size=2),
                                   model=types.SimpleNamespace(max_model_len=512))
    replicas = [FakeReplica(2, 0.5, 3), FakeReplica(5, 0.1, 1)]
    return DataParallelEngine(config, replicas=replicas), replicas


def test_requests_go_to_the_least_loaded_replica_and_finish_everywhere():
    engine, (fast, slow) = make_engine()
    params = SamplingParams()
    for i in range(4):
        engine.add_request(f"r{i}", None, [1, 2], params)
    assert engine.routed == [2, 2] and engine.load() == [2, 2]
    finished = set()
    for _ in range(2):
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"r0", "r2"}  # the fast replica's
    engine.add_request("r4", None, [1], params)  # the fast replica is empty now
    assert engine.routed == [3, 2]
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {f"r{i}" for i in range(5)} and fast.steps and slow.steps


def test_every_replica_launches_its_next_step_before_any_replica_is_collected():
    """One replica's host work (collecting its step, outputs) never delays another's launch
    (asynchronous scheduling: LLMEngine.begin_step)."""
    engine, replicas = make_engine()
    log = []
    for replica in replicas:
        replica.log = log
    engine.add_request("a", None, [1], SamplingParams())
    engine.add_request("b", None, [1], SamplingParams())
    engine.step()
    assert [kind for kind, _ in log] == ["begin", "begin", "step", "step"]
    assert [r for _, r in log[:2]] == replicas == [r for _, r in log[2:]]


def test_abort_reaches_the_owner_and_ids_stay_unique():
    engine, (fast, slow) = make_engine()
    engine.add_request("a", None, [1], SamplingParams())
    engine.add_request("b", None, [1], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", None, [1], SamplingParams())
    assert engine.abort_request("b").request_id == "b" and "b" not in slow.requests
    assert engine.abort_request("b") is None
    assert engine.load() == [1, 0]


def test_gauges_merge_the_replicas():
    engine, _ = make_engine()
    engine.add_request("a", None, [1], SamplingParams(n=1))
    stats = engine.stats()
    assert stats.kv_usage == pytest.approx(0.3) and stats.waiting == 1
    assert engine.prefix_cache_stats == PrefixCacheStats(20, 4)
    assert stats.prefix_cache_hit_rate == pytest.approx(0.2)
    assert engine.num_preemptions == 2 and stats.unfinished_requests == 1
    assert stats.compilations == 3  # process-wide: not summed


def test_submits_while_replicas_step_read_only_snapshots():
    """The server's admission check runs on the event loop while the engine thread steps
    the replicas: it must read a snapshot, never the replicas' queues as they change."""
    engine, _ = make_engine()
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=100_000)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: a racy read shows up at once
    async_engine.start()
    params = SamplingParams(max_tokens=1)

    async def flood():
        streams = []
        for i in range(3000):
            streams.append(async_engine.submit(EngineRequest(f"r{i}", None, [1], params)))
            if i % 50 == 0:
                await asyncio.sleep(0)
        for stream in streams[::97]:
            async for _ in stream:
                pass

    try:
        asyncio.run(asyncio.wait_for(flood(), 120))
        assert async_engine.is_running, async_engine.dead_reason
    finally:
        sys.setswitchinterval(interval)
        async_engine.stop()


def remote_and_local(folder):
    """A DataParallelEngine over a stand-in local replica and a RemoteReplica whose core is
    the other end of a pipe; one request on each (r0 local, r1 remote)."""
    import multiprocessing

    from jaxserve.config.engine_args import EngineArgs
    from jaxserve.engine.remote_replica import RemoteReplica

    config = EngineArgs(model=str(folder), dtype="float32").engine_config(
        str(folder), on_accelerator=False, default_precompile=False)
    here, there = multiprocessing.Pipe()
    there.send(("ready", config))  # the remote host's engine core, standing in
    local = FakeReplica(50, 0.5, 1)
    remote = RemoteReplica(here, "replica 1 (host 1)")
    engine = DataParallelEngine(types.SimpleNamespace(
        parallel=types.SimpleNamespace(data_parallel_size=2)), replicas=[local, remote])
    for i in range(2):
        engine.add_processed(EngineRequest(f"r{i}", None, [1, 2, 3], SamplingParams(max_tokens=4)))
    assert there.recv()[0] == "add" and engine.load() == [1, 1]
    return engine, local, remote, there


def wait_dead(remote) -> None:
    """Until the reader thread of a RemoteReplica has seen its connection close."""
    from jaxserve.engine.failures import EngineDeadError

    deadline = time.monotonic() + 10
    while True:
        try:
            remote.check_health()
        except EngineDeadError:
            return
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_lost_remote_replica_fails_its_requests_and_routing_skips_it(tiny_checkpoint):
    """A replica on another host (a RemoteReplica over a connection) whose connection breaks:
    its request ends with an error at the next step, the stats name it lost, and new
    requests go to the replica that is left."""
    engine, local, remote, there = remote_and_local(tiny_checkpoint)
    # The core's last news: its counters so far.
    there.send(("stats", [], [], [], (EngineStats(preemptions=4, prefix_cache_queries=7), 1,
                                      0, {}, None)))
    deadline = time.monotonic() + 10
    while remote.stats().preemptions != 4:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    there.close()  # the remote host dies
    wait_dead(remote)
    outputs = engine.step()
    failed = next(o for o in outputs if o.request_id == "r1")
    assert failed.finished and "replica 1 (host 1) was lost" in failed.error
    stats = engine.stats()
    assert [rank for rank, _ in stats.replicas_lost] == [1] and stats.replicas == 2
    # Counters keep the lost replica's last totals; the load is the replica that serves.
    assert (stats.preemptions, stats.prefix_cache_queries) == (1 + 4, 10 + 7)
    assert (stats.running, stats.waiting, stats.kv_usage) == (1, 0, 0.5)
    engine.add_processed(EngineRequest("r2", None, [1], SamplingParams(max_tokens=4)))
    assert engine.load() == [2, 0] and engine.routed == [2, 1]
    while engine.has_unfinished_requests():
        engine.step()
    assert not local.requests


def test_an_abort_on_a_lost_remote_replica_still_ends_the_request(tiny_checkpoint):
    """Aborted after its replica's host died but before a step noticed: the abort's output
    (what a stream waiting for it gets), and nothing more of it afterwards."""
    engine, _, remote, there = remote_and_local(tiny_checkpoint)
    there.close()
    wait_dead(remote)
    output = engine.abort_request("r1")
    assert output is not None and output.finished
    assert [c.finish_reason for c in output.outputs] == ["abort"]
    assert not [o for o in engine.step() if o.request_id == "r1"]
    engine.check_health()  # (as the server's loop does when idle): the loss is noticed
    assert [rank for rank, _ in engine.stats().replicas_lost] == [1]
