"""LLMEngine: queues admitted requests and runs scheduler -> runner -> outputs, step by step.

A request with n > 1 becomes n sequences (children) that share the prompt; each child has
its own seed (seed + i when a seed is given), detokenizer and finish reason.

One request never stops the engine: its FailureIsolation (failures.py, self.failures)
finds the request(s) that caused a failure and fails only those. Sleep mode and weight
updates are the engine's methods below (their argument checks, shared by every front end:
sleep_mode.py).
"""

from __future__ import annotations

import contextlib
import logging
import time

import numpy as np

from jaxserve.backends.protocol import Runner
from jaxserve.backends.selection import create_runner
from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.kv_groups import describe_groups
from jaxserve.config.latent_cache import kv_log_note
from jaxserve.core.input_builder import grammar_masks, prompt_score_targets
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.lora_slots import LoraSlots
from jaxserve.core.pooling import PoolingState, fold_pooled
from jaxserve.core.request import Request, RequestStatus
from jaxserve.core.scheduler import Scheduler
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.engine.admission import EngineRequest, InputProcessor
from jaxserve.engine.failures import EngineDeadError, FailureIsolation, describe
from jaxserve.engine.interface import EngineInterface
from jaxserve.engine.output_processor import (
    OutputBuilder,
    TrackedRequest,
    match_stop_strings,
    track,
)
from jaxserve.engine.outputs import RequestOutput
from jaxserve.engine.sleep_mode import (
    EngineSleepingError,
    check_enabled,
    check_level,
    check_tags,
    host_weights,
    unfinished,
)
from jaxserve.engine.stats import EngineStats, HostTimes

logger = logging.getLogger(__name__)


class LLMEngine(EngineInterface):
    def __init__(self, config: EngineConfig, runner: Runner | None = None,
                 rank: int = 0) -> None:
        """runner: the device side; built from config on data-parallel replica `rank`'s
        devices when not given (benchmarks pass a null runner to measure the host side).
        The stages: admission, the device and its scheduler, request tracking, the step
        pipeline, failure isolation."""
        self.config = config
        self._build_admission()
        self._build_device(runner, rank)
        self._init_tracking()
        self._init_steps()
        self.failures = FailureIsolation(self.scheduler, self.runner, self._by_child)

    def _build_admission(self) -> None:
        """The admission path (checks, templates, tokenization, grammars): every front end
        hands the engine what it made; the engine keeps its tokenizer, grammars and EOS."""
        self.processor = InputProcessor.for_config(self.config)
        self.tokenizer, self.grammars = self.processor.tokenizer, self.processor.grammars
        self.eos_token_ids = self.processor.eos_token_ids

    def _build_device(self, runner: Runner | None, rank: int) -> None:
        """The runner (built unless given), the KV block manager over its blocks and the
        scheduler; logs the cache and the model's sampling defaults, and starts the warm-up
        (config.precompile)."""
        config = self.config
        self.runner = runner if runner is not None else create_runner(config, rank)
        blocks, size = self.runner.num_blocks, config.cache.block_size
        groups = self.runner.kv_groups
        self.kv_manager = KVCacheManager(blocks, size, windows=groups.windows,
                                         enable_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, config.speculative,
                                   config.lora and LoraSlots(config.lora.max_loras))
        max_len = config.model.max_model_len
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB); max concurrency at "
                    "max_model_len=%d: %.2f; prefix caching %s%s", blocks - 1, size,
                    groups.tokens_held(blocks - 1, size), blocks * self.runner.bytes_per_block
                    / 2**20, max_len, (blocks - 1) / groups.blocks_held(max_len, size),
                    "on" if config.cache.enable_prefix_caching else "off",
                    describe_groups(groups) + kv_log_note(config))  # + a latent cache's size
        if config.model.sampling_defaults:
            logger.info("Default sampling parameters from the model's generation_config.json: "
                        "%s (a request's own values win; generation_config='vllm' / "
                        "--generation-config vllm ignores the file).",
                        config.model.sampling_defaults)
        if config.precompile:
            self.runner.warm_up(background=config.precompile == "background")

    def _init_tracking(self) -> None:
        """The tracked requests (by request id and by child id), the subsets of them that
        need work of some steps, the output builder, and the seeds' generator."""
        self._rng = np.random.default_rng(self.config.model.seed)
        self._pooling = self.config.pooler is not None  # (pooling requests: core/pooling.py)
        self.outputs = OutputBuilder(self.tokenizer)
        self._tracked: dict[str, TrackedRequest] = {}
        self._by_child: dict[str, TrackedRequest] = {}
        # The tracked requests that need work of some steps, done only while there are some:
        # prompt scores (prompt logprobs), grammar masks (structured outputs), synchronous
        # steps (inputs that read their known tokens: a grammar's mask, bad words; each
        # step is scheduled once the previous one's tokens are in, so they get a token every
        # step), logprob entries, stop strings matched token by token.
        self._subsets: dict[str, dict[str, TrackedRequest]] = {
            kind: {} for kind in ("scoring", "constrained", "reads_tokens", "logprobs", "stops")}
        (self._scoring, self._constrained, self._reads_tokens, self._with_logprobs,
         self._with_stops) = self._subsets.values()

    def _init_steps(self) -> None:
        """The step pipeline: the steps on the device not collected yet, whether steps are
        scheduled ahead (asynchronous scheduling), and the host-time counters."""
        # The last step dispatched to the device and not collected yet, as (batch, runner
        # handle, dispatch time) parts: one part, unless suspects or a failed dispatch split
        # the step. With asynchronous scheduling, the step before it too (_older), while a
        # step() that launched the next one first collects it.
        self._async = self.config.scheduler.async_scheduling
        self._in_flight: list[tuple[SchedulerOutput, object, float]] = []
        self._older: list[tuple[SchedulerOutput, object, float]] = []
        self._launched_ahead = False  # begin_step() launched this step() call's step
        self.host_times = HostTimes()  # where the engine thread's time goes, by stage
        self._outputs_start = time.perf_counter()
        self._final_only = False  # the current step() call's

    # ---- the EngineInterface ----------------------------------------------------------
    def close(self) -> None:
        """Stop the runner's background work (warm-up), release worker hosts, and stop the
        grammar sandbox's processes."""
        self.runner.close()
        self.grammars.close()

    def stats(self) -> EngineStats:
        """A snapshot of the load and counters; take it on the thread that steps the engine
        (other threads read the snapshot, never the queues)."""
        scheduler, kv, runner = self.scheduler, self.kv_manager, self.runner.stats()
        spec = scheduler.spec_stats
        return EngineStats(
            running=len(scheduler.running), waiting=len(scheduler.waiting),
            unfinished_requests=len(self._tracked), kv_usage=kv.usage,
            kv_capacity_tokens=self.runner.kv_groups.tokens_held(kv.usable_blocks, kv.block_size),
            prefix_cache_queries=kv.queries, prefix_cache_hits=kv.hits,
            preemptions=scheduler.num_preemptions, compilations=runner.compilations,
            compiling=runner.compiling, warm_up_done=runner.warm_up_done,
            spec_drafts=spec.num_drafts, spec_draft_tokens=spec.num_draft_tokens,
            spec_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=tuple(spec.accepted_per_pos), **scheduler.lora_stats())

    @property
    def async_scheduling(self) -> bool:
        """Whether steps are scheduled asynchronously (config.scheduler.async_scheduling, at
        first); may be changed between steps (the benchmarks time both)."""
        return self._async

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        if on and self.config.speculative is not None:
            raise ValueError("async_scheduling does not work with speculative_config.")
        self._async = bool(on)

    @property
    def in_flight(self) -> SchedulerOutput | None:
        """The batches of the steps on the device, not collected yet, as one (None if
        none)."""
        parts = self._older + self._in_flight
        if not parts:
            return None
        return SchedulerOutput.concat([out for out, _, _ in parts])

    def add_processed(self, request: EngineRequest) -> None:
        """Queue a request the admission path made (InputProcessor.process; with its grammar
        compiled when it has a structured output). Only the id is checked here: nothing
        else can have changed since admission."""
        assert isinstance(request, EngineRequest), type(request)
        params, ids = request.params, request.prompt_token_ids
        pooler = self.config.pooler
        assert (request.pooling is None) == (pooler is None), "pooling on a pooling engine only"
        assert 0 < len(ids) < self.config.model.max_model_len + (pooler is not None), len(ids)
        assert (params.structured_outputs is None) == (request.grammar is None), \
            "a structured output's grammar is compiled before the request is added"
        if request.request_id in self._tracked:
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        self._check_awake()  # (sleep mode: sleep() below)
        children = []
        budget = request.budget(self.config.model.max_model_len)  # (admission's, carried)
        for i in range(params.n):
            seed = (params.seed + i if params.seed is not None
                    else int(self._rng.integers(0, 2**32)))
            grammar = (None if request.grammar is None else
                       self.grammars.new_matcher(request.grammar))
            pooling = None if pooler is None else PoolingState(
                request.pooling, pooler.pooling_type, pooler.task)
            child = Request(f"{request.request_id}#{i}", ids, params, seed=seed % 2**32,
                            max_model_len=self.config.model.max_model_len,
                            eos_token_ids=self.eos_token_ids, priority=request.priority,
                            constraints=request.constraints, grammar=grammar, pooling=pooling,
                            lora=request.lora, max_output_tokens=budget)
            child.grammar_waits_for = request.grammar_start
            child.extra_keys = request.cache_keys()
            children.append(child)
        tracked = track(request, children, self.tokenizer)
        self._tracked[request.request_id] = tracked
        member = (tracked.prompt_logprobs is not None, request.grammar is not None,
                  children[0].needs_known_tokens, params.logprobs is not None, bool(params.stop))
        for subset, included in zip(self._subsets.values(), member):
            if included:
                subset[request.request_id] = tracked
        for child in children:
            self._by_child[child.request_id] = tracked
            self.scheduler.add(child)

    def abort_request(self, request_id: str, report: bool = True) -> RequestOutput | None:
        """Stop a request and free its blocks. Returns its last output (unfinished choices
        end with finish_reason 'abort'), or None if it is not (or no longer) known, or
        report is False (nobody reads it)."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        for child in tracked.children:
            if not child.finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)
        if not report:
            if tracked.error is not None:
                self.failures.failed.remove(tracked)
            return None
        if tracked.error is not None:  # failed, not reported yet: report it now instead
            self.failures.failed.remove(tracked)
            return self.outputs.error_output(tracked)
        return self.outputs.make_output(tracked)

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    # ---- sleep mode and weight updates (their checks: sleep_mode.py) -------------------
    def sleep(self, level: int = 1) -> None:
        """Free the device memory of the KV cache and of the weights (level 1: kept in host
        memory; level 2: dropped, read again at wake_up). Needs enable_sleep_mode and no
        unfinished request."""
        level = check_level(level)
        check_enabled(self.config)
        if self._tracked:
            raise unfinished(len(self._tracked))
        self._settle()
        self.runner.sleep(level)
        self.kv_manager.reset_prefix_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what tags name ("weights", "kv_cache"; None: both) and sleeps: the
        weights from host memory, or from the model's folder after level 2 (unless updates
        gave them all); the KV cache as zeros of the same shape (nothing recompiles). The
        prefix cache starts empty."""
        tags = check_tags(tags)
        if self.is_sleeping():
            self.runner.wake_up(tags)
        self.kv_manager.reset_prefix_cache()

    def is_sleeping(self) -> bool:
        """Whether the weights or the KV cache are off the device (partly woken counts)."""
        return bool(getattr(self.runner, "sleeping", False))

    def update_weights(self, weights) -> int:
        """Replace the weights the given tensors map to (a dict {Hugging Face tensor name:
        array}, or a folder of safetensors: every tensor in it), each new value of its
        parameter's shape, placed on its sharding and dtype: nothing recompiles. Every
        tensor is checked before any weight changes (ValueError naming it). Asleep, it
        replaces the host copy (level 1) or gives the weights wake_up uses (level 2). The
        prefix cache is reset. Returns how many parameters changed."""
        weights = host_weights(weights)
        update = getattr(self.runner, "update_weights", None)
        if update is None:
            raise ValueError(f"update_weights runs on the JAX backend; this engine runs "
                             f"backend={self.config.backend!r}.")
        self._wait_for_steps()
        count = update(weights)
        self.kv_manager.reset_prefix_cache()
        return count

    def _check_awake(self) -> None:
        if getattr(self.runner, "sleeping", False):
            raise EngineSleepingError()

    def _settle(self) -> None:
        """Collect the steps still on the device (with no request left, asynchronous
        scheduling may have launched one past the last finish), before their arrays go."""
        parts, self._older, self._in_flight = self._older + self._in_flight, [], []
        self._launched_ahead = False
        self._collect(parts)

    def _wait_for_steps(self) -> None:
        """Wait for the steps in flight (their results stay to be collected), so no device
        work reads a weight while it is replaced."""
        for _, handle, _ in self._older + self._in_flight:
            with contextlib.suppress(Exception):  # (a failed step is the collector's news)
                self.runner.fetch(handle)

    # ---- one step -----------------------------------------------------------------------
    def step(self, final_only: bool = False, wanted=None) -> list[RequestOutput]:
        """Fold in the results of the step on the device, start the next one, and while it
        runs detokenize and build outputs (JAX dispatch is asynchronous, so that host work
        overlaps the device's). With asynchronous scheduling the next step starts first,
        scheduled with placeholders for the tokens of the step it follows on the device,
        and that step's results are folded in while it runs.

        Returns the outputs of the requests that got tokens or failed (finished ones are
        then forgotten); with final_only, only of those that finished (offline generation
        needs no intermediate outputs); with wanted (request id -> bool), only of those it
        accepts and those that finished (a stream whose reader has not taken the last one
        needs no newer one yet: outputs are cumulative, the next one carries it all).
        Results come one call after the step that made them (two with asynchronous
        scheduling): call until has_unfinished_requests() is False. Raises
        EngineDeadError when the device no longer runs even an empty step."""
        changed = self._advance(final_only)
        outputs = self.outputs.step_outputs(
            changed, self.failures.failed, lambda tracked, err: self.failures.fail(
                tracked, err, "while building its output"), final_only, wanted)
        self.failures.take_failed()  # (reported above)
        for output in outputs:
            if output.finished:
                self._forget(output.request_id)
        self.host_times.add("outputs", time.perf_counter() - self._outputs_start)
        return outputs

    def advance(self) -> list[TrackedRequest]:
        """step() without building outputs (the engine core process sends what changed
        instead: core_process.py): the requests that got tokens, then those that failed;
        finished and failed ones are forgotten."""
        changed = []
        for tracked in self._advance(False):
            if tracked.error is None:
                changed.append(tracked)
                # (the last choice first: a plain attribute, read for every request)
                if tracked.children[-1].finished and tracked.finished:
                    self._forget(tracked.request_id)
        failed = self.failures.take_failed()
        for tracked in failed:
            self._forget(tracked.request_id)
        self.host_times.add("outputs", time.perf_counter() - self._outputs_start)
        return changed + failed

    def _advance(self, final_only: bool) -> list[TrackedRequest]:
        """Collect, launch, match stop strings: the requests that changed (see _step)."""
        self._check_awake()
        if self._async and not self._launched_ahead:
            self.begin_step()
        ahead, self._launched_ahead = self._launched_ahead, False
        self.host_times.steps += 1
        self._outputs_start = time.perf_counter()  # until _step() moves it past collecting
        self._final_only = final_only
        try:
            changed = self._step(ahead)
        except EngineDeadError:
            raise
        except Exception as err:  # noqa: BLE001 - outside any one request: fail them all
            self._fail_all(err)
            changed = []
        self.failures.check_device()  # after a culprit's step failed
        return changed

    def begin_step(self) -> None:
        """Asynchronous scheduling: schedule and launch the next step now, before the step
        on the device is collected by step() (a data-parallel front end launches every
        replica's step before it collects any). Without it, or when called twice, nothing;
        nor while requests whose step failed on the device run alone (suspects: each failure
        must be their own), or requests whose inputs read their tokens (structured outputs,
        bad words) run: then steps are synchronous."""
        if not self._async or self._launched_ahead or self.failures.has_suspects or \
                self._reads_tokens:
            return
        self._launched_ahead = True
        self._older, self._in_flight = self._older + self._in_flight, []
        try:
            self._launch()
        except Exception as err:  # noqa: BLE001 - outside any one request: fail them all
            self._fail_all(err)

    def _step(self, ahead: bool) -> list[TrackedRequest]:
        """Collect, launch (ahead: begin_step launched it already, before collecting),
        detokenize; the requests that got tokens."""
        if ahead:
            parts, self._older = self._older, []
            appended = self._collect(parts)  # sampling results: tokens, stops, lengths
        else:
            parts, self._older, self._in_flight = self._older + self._in_flight, [], []
            appended = self._collect(parts)
            self._launch()  # the next step, scheduled with those tokens
        self._outputs_start = time.perf_counter()
        changed: dict[str, TrackedRequest] = {}
        final_only = self._final_only
        if final_only and not self._with_stops:  # then only the finished ones have news
            appended = [taken for taken in appended if taken[0].finished]
        by_child = self._by_child
        for req, _, count in appended:  # overlaps the device step just launched
            stops = req.params.stop  # (the detokenizer's checks_stop_strings)
            if final_only and not stops and not req.finished:
                continue  # no output until it finishes
            tracked = by_child[req.request_id]
            if tracked.error is not None:
                continue
            if not stops:
                changed[tracked.request_id] = tracked
                continue
            try:
                # Stop strings are looked for token by token; other text waits until it is
                # read (OutputBuilder.make_output).
                match = match_stop_strings(tracked, req, req.token_ids[
                    req.num_tokens - count: req.num_tokens].tolist())
            except Exception as err:  # noqa: BLE001 - this request only
                self.failures.fail(tracked, err, "while detokenizing")
                continue
            if match is not None:  # it ends at that token; its row in the step already
                stop_str, later = match  # running is dropped when that step is collected
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED,
                                      stop_reason=stop_str, num_tokens=req.num_tokens - later)
            changed[tracked.request_id] = tracked
        return list(changed.values())

    def _forget(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        for subset in self._subsets.values():
            subset.pop(request_id, None)
        if tracked is not None:
            for child in tracked.children:
                self._by_child.pop(child.request_id, None)
            self.failures.forget(tracked)

    def _launch(self) -> None:
        start = time.perf_counter()
        out = self.scheduler.schedule(self.runner.step_limits())
        scheduled = time.perf_counter()
        self.host_times.add("schedule", scheduled - start)
        try:
            self._launch_parts(out)
        finally:
            self.host_times.add("prepare", time.perf_counter() - scheduled)

    def _launch_parts(self, out: SchedulerOutput) -> None:
        if out.empty:
            return
        if not self.failures.has_suspects:
            self._dispatch(out)
            return
        rest = []
        for row, req in enumerate(out.requests):
            if self.failures.is_suspect(req.request_id):
                self._dispatch(out.rows([row]))
            else:
                rest.append(row)
        if rest:
            self._dispatch(out.rows(rest))

    def _dispatch(self, out: SchedulerOutput) -> None:
        """Start a step on the device. If it cannot start, nothing of it ran: start its
        requests one at a time, and fail one that cannot start alone."""
        try:
            masks, broken = grammar_masks(out, self.grammars) if self._constrained \
                else (None, [])
            handle = self.runner.dispatch(out, self._prompt_score_targets(out), masks)
        except BaseException as err:
            self.reset_prefix_cache()
            if not isinstance(err, Exception):
                raise  # Ctrl-C, exit
            if len(out.requests) == 1:
                self.failures.fail(self._by_child[out.requests[0].request_id], err,
                           "while its step was prepared", device=True)
                return
            logger.warning("A step of %d requests could not start (%s); starting them one at "
                           "a time", len(out.requests), describe(err))
            for row, req in enumerate(out.requests):
                if not req.finished:
                    self._dispatch(out.rows([row]))
            return
        self._in_flight.append((out, handle, time.perf_counter()))
        self.failures.fail_masks(broken)

    def _fail_all(self, err: Exception) -> None:
        """The engine failed outside any one request: drop the steps in flight, forget the
        prefixes of the blocks they fill, and fail every request (FailureIsolation)."""
        self._in_flight, self._older = [], []
        self.reset_prefix_cache()  # the failed steps' blocks
        self.failures.fail_all(list(self._tracked.values()), err)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's reset_prefix_cache): later prompts hit nothing
        cached before now. Running requests keep their blocks; nothing is preempted. Also
        after a step that did not run (an error, Ctrl-C): scheduling registered the blocks it
        fills, whose KV may be missing, so no later request may hit them."""
        self.kv_manager.reset_prefix_cache()

    def _collect(self, parts) -> list[tuple[Request, int, int]]:
        """Wait for a step's parts and fold their results in: prompt logprobs, sampled
        tokens, and the finishes that need no text (stop token ids, EOS, length). Returns
        (sequence, its first slot in the step's results, how many new tokens) for each that
        got tokens."""
        appended = []
        for out, handle, started in parts:
            waiting = time.perf_counter()
            try:
                result = self.runner.fetch(handle)
            except BaseException as err:
                self.reset_prefix_cache()
                if not isinstance(err, Exception):
                    raise  # Ctrl-C, exit
                self.failures.step_failed(out, err)
                continue
            fetched = time.perf_counter()
            self.host_times.add("wait", fetched - waiting)
            if len(parts) == 1:  # a step that shared the device times nothing
                self.scheduler.observe_step(out, fetched - started)
            appended += self._fold(out, result)
            if self.failures.has_suspects:
                self.failures.clear_caught_up(out)
            self.host_times.add("fold", time.perf_counter() - fetched)
        return appended

    def _fold(self, out: SchedulerOutput, result) -> list[tuple[Request, int, int]]:
        """A step's results: prompt logprobs recorded, then the scheduler's update (computed
        tokens, sampled tokens, finishes), then the sampled tokens' logprob entries."""
        if result.prompt_scores is not None:
            start = 0
            for req, first, count in zip(out.requests, out.num_computed_tokens,
                                         out.num_scheduled_tokens):
                row_start, start = start, start + count
                tracked = self._by_child.get(req.request_id)
                # (A request no longer running since the step was scheduled has its rows
                # dropped: it finished, or is recomputed after a step failed.)
                if req.status is not RequestStatus.RUNNING or \
                        tracked.prompt_logprobs is None or req is not tracked.children[0]:
                    continue
                try:
                    self.outputs.record_prompt_logprobs(tracked, req, row_start, first, count,
                                                        result.prompt_scores)
                except Exception as err:  # noqa: BLE001 - this request only
                    self.failures.fail(tracked, err, "while its results were read")
        pooled = self._fold_pooled(out, result.pooled) if self._pooling else None
        sampled = result.sampled
        taken = self.scheduler.update_from_output(out, sampled, result.num_emitted)
        if pooled:  # (pooling requests finished by this step: before any of its tokens)
            taken = pooled + taken
        if not self._constrained and not self._with_logprobs:
            return taken
        appended = []
        for req, first, count in taken:
            if req.grammar is None and req.params.logprobs is None:
                appended.append((req, first, count))
                continue
            tracked = self._by_child[req.request_id]
            tokens = req.token_ids[req.num_tokens - count: req.num_tokens].tolist()
            if req.grammar is not None and not all(
                    self.failures.advance_grammar(tracked, req, token) for token in tokens):
                continue
            if req.params.logprobs is not None:
                k = req.params.logprobs
                try:
                    tracked.logprobs[tracked.children.index(req)].extend(
                        self.outputs.logprob_dict(token, float(sampled.logprobs[i]),
                                                  int(sampled.ranks[i]), sampled.top_ids[i][:k],
                                                  sampled.top_logprobs[i][:k])
                        for i, token in enumerate(tokens, first))
                except Exception as err:  # noqa: BLE001 - this request only
                    self.failures.fail(tracked, err, "while its results were read")
                    continue
            appended.append((req, first, count))
        return appended

    def _fold_pooled(self, out: SchedulerOutput, pooled) -> list[tuple[Request, int, int]]:
        """A pooling engine's step: each row's pooled hidden states into its request; the
        requests whose prompt it ended finished with their output (core/pooling.py), as
        (request, row, 0) for _step's changed requests."""
        done, failed = fold_pooled(self.scheduler, out, pooled)
        for req, err in failed:
            self.failures.fail(self._by_child[req.request_id], err, "while its output was pooled")
        for req, _, _ in done:
            self._by_child[req.request_id].pooled = req.pooling.result
        return done

    def _prompt_score_targets(self, out: SchedulerOutput) -> np.ndarray | None:
        """The prompt tokens whose logprobs this step scores (input_builder's targets), for
        the first child of each request that asked for prompt logprobs."""
        if not self._scoring:
            return None
        wanted = []
        for req in out.requests:
            tracked = self._by_child[req.request_id]
            wanted.append(tracked.prompt_logprobs is not None and req is tracked.children[0])
        return prompt_score_targets(out, wanted)
