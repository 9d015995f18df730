"""EngineInterface: what the front ends (LLM, the async server engine, gRPC) call on an engine.

LLMEngine (one replica) and DataParallelEngine (D replicas behind one front end) both
implement it, so a front end never knows which it has. An implementation provides the
primitives below; the counters and the admission entry point are derived from them here,
once, so a data-parallel front end forwards nothing member by member.
"""

from __future__ import annotations

import abc

from jaxserve.core.kv_cache_manager import PrefixCacheStats
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.stats import EngineStats


class EngineInterface(abc.ABC):
    # Set by an implementation's __init__ (what front ends read: server/engine_view.py):
    config: object  # the engine's config (config.engine_config.EngineConfig)
    tokenizer: object  # the model's tokenizer (inputs.tokenizer.Tokenizer)
    processor: object  # the admission path (engine.admission.InputProcessor)
    runner: object  # the device side (backends.protocol.Runner); a replica's, under DP
    eos_token_ids: frozenset[int]

    # ---- the primitives -----------------------------------------------------------------
    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """A snapshot of the load and counters; take it on the thread that steps the engine
        (other threads read the snapshot, never the queues)."""

    @abc.abstractmethod
    def add_processed(self, request) -> None:
        """Queue a request the admission path made (admission.EngineRequest); ValueError if
        its id is already in use."""

    @abc.abstractmethod
    def abort_request(self, request_id: str, report: bool = True) -> RequestOutput | None:
        """Stop a request and free its blocks. Returns its last output (unfinished choices
        end with finish_reason 'abort'), or None if it is not (or no longer) known, or
        report is False (nobody reads it)."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abc.abstractmethod
    def step(self, final_only: bool = False, wanted=None) -> list[RequestOutput]:
        """Advance every request by a step; the outputs of those that changed (with
        final_only, of those that finished; with wanted, a callable of the request id, of
        those it accepts and those that finished)."""

    def advance(self) -> list:
        """step() without building outputs, for an engine run by the engine core process
        (core_process.py), which sends what changed instead: the output_processor
        TrackedRequests that got tokens, finished or failed; finished and failed ones are
        forgotten."""
        raise NotImplementedError(f"{type(self).__name__} cannot run in an engine core process")

    def compile_records(self):
        """The compile records of the process where the engine compiles
        (compile_stats.CompileRecords, for /metrics): this one's."""
        from jaxserve.backends.compile_stats import compile_records

        return compile_records()

    def check_health(self) -> None:  # noqa: B027 - optional: engines that can die apart
        """Raise EngineDeadError if the engine can no longer step (vLLM's check_health): its
        core process has died. An engine in this process reports that from step()."""

    def wake(self) -> None:  # noqa: B027 - optional: engines whose step() waits
        """A front end has new work for the engine (a request, an abort): a step() waiting
        for results returns now, so the front end can hand it over."""

    def begin_step(self) -> None:  # noqa: B027 - optional: engines that schedule ahead
        """Start the next step's device work now, before step() collects the one it
        follows (asynchronous scheduling; a no-op for an engine that does not schedule
        ahead). step() calls it itself when it was not called."""

    @abc.abstractmethod
    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's reset_prefix_cache): later prompts hit nothing
        cached before now. Running requests keep their blocks; nothing is preempted."""

    # ---- sleep mode and weight updates (sleep_mode.py) ----------------------------------
    @abc.abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Free the KV cache's and the weights' device memory (level 1: the weights kept in
        host memory; level 2: dropped). ValueError without enable_sleep_mode, or while
        requests are unfinished (RequestsUnfinishedError); asleep already at that level or
        deeper: nothing."""

    @abc.abstractmethod
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what tags name ("weights", "kv_cache"; None: both); the prefix cache
        starts empty. What is awake stays as it is."""

    @abc.abstractmethod
    def is_sleeping(self) -> bool:
        """Whether the weights or the KV cache are off the device."""

    @abc.abstractmethod
    def update_weights(self, weights) -> int:
        """Replace the weights the given tensors map to ({Hugging Face tensor name: array},
        or a folder of safetensors), asleep or awake, without recompiling; ValueError naming
        a tensor that does not fit, before anything changes. Returns how many parameters
        changed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop background work (warm-up, grammar sandboxes) and release other hosts."""

    # ---- derived ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0,
                    cache_salt: str | None = None, lora_request=None) -> None:
        """Admit a request through the admission path (self.processor: limits, the model's
        checks, bad words, the grammar) and queue it; ValueError naming the field for
        anything it refuses. priority: lower runs first (needs the priority scheduling
        policy); cache_salt: the request shares cached prefix blocks only with requests of
        the same salt; lora_request: its LoRA adapter (a LoRARequest; enable_lora)."""
        params = self.processor.check_params(params)
        self.add_processed(self.processor.process(request_id, prompt, prompt_token_ids, params,
                                                  priority, cache_salt, lora=lora_request))

    @property
    def num_unfinished_requests(self) -> int:
        return self.stats().unfinished_requests

    @property
    def num_compilations(self) -> int:
        """XLA compilations in this process so far."""
        return self.stats().compilations

    @property
    def compiling(self) -> int:
        """Functions being compiled right now."""
        return self.stats().compiling

    @property
    def warm_up_done(self) -> bool:
        """Whether every bucket is compiled (a background warm-up may still be running)."""
        return self.stats().warm_up_done

    @property
    def num_preemptions(self) -> int:
        return self.stats().preemptions

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Tokens looked up in the prefix cache and tokens served from it, so far."""
        stats = self.stats()
        return PrefixCacheStats(stats.prefix_cache_queries, stats.prefix_cache_hits)
