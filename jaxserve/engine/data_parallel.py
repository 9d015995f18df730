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
"""

from __future__ import annotations

import logging

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.interface import EngineInterface
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.stats import EngineStats

logger = logging.getLogger(__name__)


def create_engine(config: EngineConfig):
    """An LLMEngine, or a DataParallelEngine when the mesh has more than one data rank."""
    if config.parallel.data_parallel_size == 1:
        return LLMEngine(config)
    return DataParallelEngine(config)


class DataParallelEngine(EngineInterface):
    def __init__(self, config: EngineConfig, replicas: list | None = None) -> None:
        """replicas: the engines (tests pass stand-ins); one LLMEngine per data rank."""
        self.config = config
        size = config.parallel.data_parallel_size
        if replicas is None:
            replicas = []
            for rank in range(size):
                logger.info("Data-parallel replica %d of %d", rank + 1, size)
                replicas.append(LLMEngine(config, rank=rank))
        self.replicas = replicas
        # Every replica runs the same model with the same limits: replica 0's tokenizer,
        # admission path and runner (for its sizes) stand for all of them.
        first = self.replicas[0]
        self.tokenizer, self.processor = first.tokenizer, first.processor
        self.runner, self.eos_token_ids = first.runner, first.eos_token_ids
        self._owner: dict[str, LLMEngine] = {}
        self.routed = [0] * size  # requests sent to each replica so far

    # ---- the EngineInterface: each call goes to every replica, or to a request's owner ---
    def stats(self) -> EngineStats:
        """The replicas' snapshots merged (take it on the thread that steps the engine)."""
        return EngineStats.merge([replica.stats() for replica in self.replicas])

    def reset_prefix_cache(self) -> None:
        for replica in self.replicas:
            replica.reset_prefix_cache()

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    def add_processed(self, request) -> None:
        """Queue an admitted request (admission.EngineRequest) on the least-loaded replica."""
        if request.request_id in self._owner:
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        rank = min(range(len(self.replicas)),
                   key=lambda i: self.replicas[i].num_unfinished_requests)
        self.replicas[rank].add_processed(request)
        self._owner[request.request_id] = self.replicas[rank]
        self.routed[rank] += 1

    def abort_request(self, request_id: str, report: bool = True) -> RequestOutput | None:
        replica = self._owner.pop(request_id, None)
        return replica.abort_request(request_id, report) if replica is not None else None

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner)

    def step(self, final_only: bool = False, wanted=None) -> list[RequestOutput]:
        """One step of every replica that has work; their outputs together."""
        outputs = []
        for replica in self._begin_steps():
            outputs.extend(replica.step(final_only, wanted))
        for output in outputs:
            if output.finished:
                self._owner.pop(output.request_id, None)
        return outputs

    def advance(self) -> list:
        """One step of every replica that has work, without outputs (see EngineInterface)."""
        changed = []
        for replica in self._begin_steps():
            changed.extend(replica.advance())
        for tracked in changed:
            if tracked.finished:  # (a failed request's choices are finished too)
                self._owner.pop(tracked.request_id, None)
        return changed

    def _begin_steps(self) -> list[LLMEngine]:
        """The replicas that have work, each one's next step launched (asynchronous
        scheduling) before any replica's host work on the step it follows."""
        busy = [r for r in self.replicas if r.has_unfinished_requests()]
        for replica in busy:
            replica.begin_step()
        return busy

    def load(self) -> list[int]:
        """Unfinished requests per replica."""
        return [r.num_unfinished_requests for r in self.replicas]
