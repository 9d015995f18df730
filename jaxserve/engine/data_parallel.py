"""Data parallelism: one engine per data rank behind one front end.

With `--mesh DxM`, D replicas each run a whole LLMEngine (its own scheduler, KV block pool
and compiled steps) on its own (1, M) sub-mesh: replica r gets devices r*M .. r*M + M - 1.
This front end implements LLMEngine's interface (interface.EngineInterface); it sends each
new request to the replica with the fewest unfinished requests (the lowest rank on a tie),
routes aborts to the owner, and steps every replica in turn. With asynchronous scheduling
every replica's next step is launched first (LLMEngine.begin_step), then each replica's
previous step is collected and its outputs built, so one replica's host work never delays
another's launch; without it a replica's step only launches device work and returns (JAX
dispatch is asynchronous), so while the host serves replica 1 the devices of replica 0 are
computing.

One engine per rank rather than one scheduler over all ranks: each replica's batch, blocks
and buckets are exactly those of a single-replica engine, so nothing in the scheduler, the
block manager or the runner knows about data parallelism, and a replica's requests never
wait for another replica's step.

On several hosts (backends/jax/distributed.py) the replicas whose lead host is another host
are RemoteReplicas (remote_replica.py): engine cores stepping on their own hosts, whose news
this front end collects without waiting on any one of them. A replica that is lost (its
host died: its connection broke; or its devices failed: EngineDeadError) fails the requests
it had, is never routed to again, and is reported in the stats (/health, /metrics); the
front end goes on with the others, and is dead only when every replica is lost. Sleep mode
and weight updates go to every live replica, once checked here (sleep_mode.py).
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.failures import EngineDeadError
from jaxserve.engine.interface import EngineInterface
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.remote_replica import CORE_CODEC, RemoteReplica
from jaxserve.engine.sleep_mode import (
    check_enabled,
    check_level,
    check_tags,
    host_weights,
    unfinished,
)
from jaxserve.engine.stats import EngineStats

logger = logging.getLogger(__name__)


def create_engine(config: EngineConfig):
    """An LLMEngine, or a DataParallelEngine when the mesh has more than one data rank."""
    if config.parallel.data_parallel_size == 1:
        return LLMEngine(config)
    return DataParallelEngine(config)


def engine_from_args(engine_args, model: str, precompile: bool | str):
    """`serve`'s engine (config.engine_args.EngineArgs for a resolved model folder), built
    in the core process: the accelerator is looked at only here, so only this process
    ever holds it."""
    from jaxserve.backends.selection import on_accelerator

    return create_engine(engine_args.engine_config(
        model, on_accelerator=on_accelerator(engine_args.backend), default_precompile=precompile))


class DataParallelEngine(EngineInterface):
    def __init__(self, config: EngineConfig, replicas: list | None = None) -> None:
        """replicas: the engines (tests pass stand-ins); one per data rank: an LLMEngine
        here, or a RemoteReplica for one led by another host."""
        self.config = config
        size = config.parallel.data_parallel_size
        self._news = threading.Event()  # a remote replica sent news (or was lost)
        self.replicas = replicas if replicas is not None else self._build_replicas(size)
        # Every replica runs the same model with the same limits: replica 0's tokenizer,
        # admission path and runner (for its sizes) stand for all of them.
        first = self.replicas[0]
        self.tokenizer, self.processor = first.tokenizer, first.processor
        self.runner, self.eos_token_ids = first.runner, first.eos_token_ids
        self._owner: dict[str, int] = {}  # request id -> the rank of its replica
        self.routed = [0] * size  # requests sent to each replica so far
        self.lost: dict[int, str] = {}  # rank -> why the replica was lost
        self._lost_stats: dict[int, EngineStats] = {}  # rank -> its last snapshot
        self._failed: list[RequestOutput] = []  # lost replicas' requests, for the next step

    def _build_replicas(self, size: int) -> list:
        """This host's replicas first (the other hosts build theirs meanwhile), then a
        connection to each replica another host leads, in rank order."""
        from jaxserve.backends import selection

        layout = selection.replica_hosts(self.config)
        replicas: list = [None] * size
        for rank, hosts in enumerate(layout):
            if hosts[0] == 0:
                logger.info("Data-parallel replica %d of %d", rank + 1, size)
                replicas[rank] = LLMEngine(self.config, rank=rank)
        for rank, hosts in enumerate(layout):
            if hosts[0] != 0:
                logger.info("Data-parallel replica %d of %d: on host %s, waiting until it is "
                            "ready", rank + 1, size, "/".join(map(str, hosts)))
                connection = selection.host_links().connect(hosts[0], f"core:{rank}",
                                                            CORE_CODEC)
                replicas[rank] = RemoteReplica(connection, f"replica {rank} (host {hosts[0]})",
                                               on_news=self._news.set)
        return replicas

    # ---- the EngineInterface: each call goes to every replica, or to a request's owner ---
    def stats(self) -> EngineStats:
        """The replicas' snapshots merged, with the lost ones named: counters over every
        replica (a lost one's as it last reported), the load and KV of those that serve
        (take it on the thread that steps the engine)."""
        live = [self.replicas[r].stats() for r in self._live()]
        parts = live + list(self._lost_stats.values())
        merged = EngineStats.merge(parts) if parts else EngineStats()
        if self.lost:
            now = EngineStats.merge(live) if live else EngineStats()
            merged = dataclasses.replace(merged, **{field: getattr(now, field) for field in (
                "running", "waiting", "unfinished_requests", "kv_usage", "kv_capacity_tokens",
                "compiling", "warm_up_done")})
        return dataclasses.replace(merged, replicas=len(self.replicas),
                                   replicas_lost=tuple(sorted(self.lost.items())))

    def reset_prefix_cache(self) -> None:
        for rank in self._live():
            self.replicas[rank].reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Every live replica to sleep, once all are checked (sleep_mode.py's rules)."""
        level = check_level(level)
        check_enabled(self.config)
        if self._owner:
            raise unfinished(len(self._owner))
        self._each("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._each("wake_up", check_tags(tags))

    def is_sleeping(self) -> bool:
        return any(self.replicas[rank].is_sleeping() for rank in self._live())

    def update_weights(self, weights) -> int:
        """The same tensors into every live replica (each checks them all before it changes
        anything: the first refuses what every replica would)."""
        counts = self._each("update_weights", host_weights(weights))
        return counts[0] if counts else 0

    def _each(self, method: str, *args) -> list:
        """replica.method(*args) on every live replica, in rank order; a remote replica lost
        meanwhile is dropped (as a step drops it)."""
        results = []
        for rank in self._live():
            replica = self.replicas[rank]
            try:
                results.append(getattr(replica, method)(*args))
            except EngineDeadError as err:
                if not _is_remote(replica):
                    raise
                self._lose(rank, err)
        self._check_alive()
        return results

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    def check_health(self) -> None:
        """Notice remote replicas lost while idle; EngineDeadError once every replica is
        lost."""
        for rank in self._live():
            replica = self.replicas[rank]
            if not _is_remote(replica):
                continue  # (a local engine reports its death from step())
            try:
                replica.check_health()
            except EngineDeadError as err:
                self._lose(rank, err)
        self._check_alive()

    def wake(self) -> None:
        self._news.set()  # (only a remote replica's step waits: for its news)

    def add_processed(self, request) -> None:
        """Queue an admitted request (admission.EngineRequest) on the least-loaded live
        replica."""
        if request.request_id in self._owner:
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        self._check_alive()
        live = self._live()
        rank = min(live, key=lambda i: self.replicas[i].num_unfinished_requests)
        try:
            self.replicas[rank].add_processed(request)
        except EngineDeadError as err:  # lost since it last stepped: the next one takes it
            if not _is_remote(self.replicas[rank]):
                raise
            self._lose(rank, err)
            return self.add_processed(request)
        self._owner[request.request_id] = rank
        self.routed[rank] += 1

    def abort_request(self, request_id: str, report: bool = True) -> RequestOutput | None:
        rank = self._owner.pop(request_id, None)
        if rank is None or rank in self.lost:
            return None
        try:
            return self.replicas[rank].abort_request(request_id, report)
        except EngineDeadError as err:
            if not _is_remote(self.replicas[rank]):
                raise
            self._lose(rank, err)
            return None

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner or self._failed)

    def step(self, final_only: bool = False, wanted=None) -> list[RequestOutput]:
        """One step of every replica that has work; their outputs together (those of a
        replica lost meanwhile: its requests, failed)."""
        outputs = []
        for rank, replica, remote in self._begin_steps():
            if not remote:  # (this host's devices failing ends the front end, as alone)
                outputs.extend(replica.step(final_only, wanted))
                continue
            try:
                outputs.extend(replica.step(final_only, wanted, wait=0))
            except EngineDeadError as err:
                self._lose(rank, err)
        outputs.extend(self._failed)
        self._failed = []
        for output in outputs:
            if output.finished:
                self._owner.pop(output.request_id, None)
        self._check_alive()
        return outputs

    def advance(self) -> list:
        """One step of every replica that has work, without outputs (see EngineInterface;
        replicas of this process only: an engine core does not run over several hosts)."""
        changed = []
        for _, replica, _ in self._begin_steps():
            changed.extend(replica.advance())
        for tracked in changed:
            if tracked.finished:  # (a failed request's choices are finished too)
                self._owner.pop(tracked.request_id, None)
        return changed

    def _begin_steps(self) -> list[tuple[int, EngineInterface, bool]]:
        """(rank, replica, remote) of the live replicas that have work, each local one's
        next step launched (asynchronous scheduling) before any replica's host work on the
        step it follows. With only remote replicas busy, waits a little for their news."""
        busy = [(rank, self.replicas[rank], _is_remote(self.replicas[rank]))
                for rank in self._live() if self.replicas[rank].has_unfinished_requests()]
        for _, replica, remote in busy:
            if not remote:
                replica.begin_step()
        if busy and all(remote for _, _, remote in busy):
            self._news.wait(_REMOTE_WAIT_S)
        self._news.clear()
        return busy

    def load(self) -> list[int]:
        """Unfinished requests per replica (0 for a lost one)."""
        return [0 if r in self.lost else self.replicas[r].num_unfinished_requests
                for r in range(len(self.replicas))]

    # ---- lost replicas ------------------------------------------------------------------
    def _live(self) -> list[int]:
        return [r for r in range(len(self.replicas)) if r not in self.lost]

    def _lose(self, rank: int, err: Exception) -> None:
        """Stop routing to a remote replica that can no longer step; its requests' last
        outputs (failed) come with the next step."""
        if rank in self.lost:
            return
        self.lost[rank] = str(err)
        self._lost_stats[rank] = self.replicas[rank].stats()
        logger.error("Data-parallel replica %d is lost (%s); %d of %d replicas serve.", rank,
                     err, len(self.replicas) - len(self.lost), len(self.replicas))
        self._failed.extend(self.replicas[rank].fail_all())
        for request_id in [i for i, r in self._owner.items() if r == rank]:
            del self._owner[request_id]

    def _check_alive(self) -> None:
        if len(self.lost) == len(self.replicas):
            raise EngineDeadError("every data-parallel replica is lost: " + "; ".join(
                f"replica {rank}: {why}" for rank, why in sorted(self.lost.items())))


_REMOTE_WAIT_S = 0.05  # the longest a step waits for news when only remote replicas work


def _is_remote(replica) -> bool:
    """A replica another host runs, which can be lost alone."""
    return isinstance(replica, RemoteReplica)
