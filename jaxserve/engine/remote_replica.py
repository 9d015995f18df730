"""Data-parallel replicas on other hosts of a multi-host run (backends/jax/distributed.py).

A replica whose lead host is not host 0 runs on that host as an engine core: its LLMEngine
(scheduler, KV blocks, runner) steps there, and host 0 drives it through RemoteReplica, an
EngineCoreClient over a socket instead of a pipe: the same protocol (core_process.py), the
same mirrors, detokenization and outputs on host 0. So each replica's host work runs on its
own host, and host 0 only admits, routes and builds outputs.

What crosses is plain data (backends/wire.py), never pickles: CORE_CODEC carries the
protocol's messages and builds, of classes, only those it lists (the configs, requests and
their parameters, stats, compile records, logprob entries, and the exceptions that cross as
they are); the connection is a host link authenticated with the operator's key
(backends/host_link.py).

run_host is a non-zero host's whole job: build the engine of each replica it leads and the
runner of each replica it only follows (in replica order, as every host does, so that
replicas over several hosts build together), then serve each engine to host 0 and follow
each lead host's steps, each on a thread of its own, until host 0 closes them.
"""

from __future__ import annotations

import logging
import threading

from jaxserve.backends.compile_stats import CompileRecords, CompileTimes
from jaxserve.backends.wire import Codec
from jaxserve.config.engine_config import (
    AttentionConfig,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from jaxserve.config.lora import LoraConfig
from jaxserve.config.mesh import MeshShape
from jaxserve.config.pooler import PoolerConfig
from jaxserve.config.request_limits import RequestLimits
from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.core.pooling_params import PoolingParams
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.structured_output import StructuredOutputsParams
from jaxserve.core.token_constraints import TokenConstraints
from jaxserve.engine.admission import EngineRequest
from jaxserve.engine.core_client import EngineCoreClient
from jaxserve.engine.failures import EngineDeadError, describe
from jaxserve.engine.outputs import Logprob, RequestOutput
from jaxserve.engine.sleep_mode import EngineSleepingError, RequestsUnfinishedError
from jaxserve.engine.stats import EngineStats
from jaxserve.models.lora import LoRARequest

logger = logging.getLogger(__name__)

# The classes the engine core protocol carries between hosts (core_process.py's messages):
# "ready"'s EngineConfig, "add"'s EngineRequest, "step"'s records and stats, "reply"'s
# results and the exceptions that cross as they are (core_process._PLAIN_ERRORS).
CORE_CODEC = Codec([
    EngineConfig, ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, AttentionConfig,
    MeshShape, RequestLimits, SpeculativeConfig, LoraConfig, PoolerConfig,
    EngineRequest, SamplingParams, StructuredOutputsParams, TokenConstraints, PoolingParams,
    LoRARequest, EngineStats, CompileRecords, CompileTimes, Logprob,
    EngineDeadError, EngineSleepingError, RequestsUnfinishedError])


class RemoteReplica(EngineCoreClient):
    def __init__(self, connection, where: str, on_news=None) -> None:
        """connection: a duplex host link (host_link.Link with CORE_CODEC) to the replica's
        engine core (serve_core on its lead host), which answers ("ready", EngineConfig) once its engine is built, or
        ("failed", exception); where: the replica, for messages; on_news: called from the
        reader thread when news comes or the core is lost."""
        self.where = where
        self._connection = self._commands = self._results = connection
        self._news_hook = on_news
        try:
            kind, payload = connection.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"{where} was lost during start-up; its host's log says "
                               "why") from None
        if kind == "failed":
            raise payload
        try:
            self._start(payload)
        except BaseException:
            connection.send(("close",))
            raise

    def fail_all(self) -> list[RequestOutput]:
        """Once the replica is lost (step() raised EngineDeadError): every request it had,
        finished with an error saying so; nothing is tracked afterwards."""
        outputs = []
        for tracked in self._tracked.values():
            tracked.error = f"{self.where} was lost while running this request ({self._dead})"
            outputs.append(self.outputs.error_output(tracked))
        self._tracked.clear()
        return outputs

    def _stop_core(self) -> None:
        self._connection.close()

    def _exit_reason(self) -> str:
        return f"{self.where} is gone (its host stopped or the connection broke)"

    def _on_news(self) -> None:
        if self._news_hook is not None:
            self._news_hook()


def run_host(config) -> None:
    """A non-zero host of a multi-host run: run the replicas it has devices of until host 0
    closes them (see the module's docstring)."""
    from jaxserve.backends import selection
    from jaxserve.engine.llm_engine import LLMEngine

    me = selection.process_index()
    links = selection.host_links()
    leads, follows = [], []
    for rank, hosts in enumerate(selection.replica_hosts(config)):
        if me not in hosts:
            continue
        if hosts[0] != me:
            runner = selection.create_runner(config, rank)
            if config.precompile:
                runner.warm_up(background=config.precompile == "background")
            follows.append((rank, runner))
            continue
        logger.info("Host %d: building replica %d's engine.", me, rank)
        try:
            leads.append((rank, LLMEngine(config, rank=rank)))
        except BaseException as err:  # noqa: BLE001 - reported to host 0, which raises it
            logger.error("Replica %d could not start", rank, exc_info=err)
            leads.append((rank, err))
    if not leads and not follows:
        logger.info("Host %d holds no replica of mesh %s.", me, config.parallel.mesh)
        return
    threads = [threading.Thread(target=_follow, args=(runner, rank),
                                name=f"jaxserve-follow-{rank}") for rank, runner in follows]
    for thread in threads:
        thread.start()
    for rank, engine in leads:  # host 0 connects in replica order, each once the last is ready
        connection = links.accept(f"core:{rank}", CORE_CODEC)
        threads.append(threading.Thread(target=serve_core, args=(engine, connection, rank),
                                        name=f"jaxserve-replica-{rank}"))
        threads[-1].start()
    for thread in threads:
        thread.join()


def serve_core(engine, connection, rank: int) -> None:
    """Serve one replica's engine to host 0 until it closes the connection (or says close);
    `engine` is the exception its start-up raised when it could not start."""
    from jaxserve.engine.core_process import EngineCore

    if isinstance(engine, BaseException):
        failure = ValueError(f"replica {rank}: {engine}") if isinstance(engine, ValueError) \
            else RuntimeError(f"replica {rank} could not start: {describe(engine)}")
        connection.send(("failed", failure))
        connection.close()
        return
    connection.send(("ready", engine.config))
    logger.info("Replica %d: serving host 0.", rank)
    try:
        EngineCore(engine, connection, connection).run()
    except EngineDeadError:
        pass
    finally:
        engine.close()
        connection.close()
        logger.info("Replica %d: stopped after %d steps.", rank, engine.runner.padding.steps)


def _follow(runner, rank: int) -> None:
    logger.info("Replica %d: following its lead host's steps.", rank)
    steps = runner.follow()
    logger.info("Replica %d: its lead host stopped after %d steps.", rank, steps)
