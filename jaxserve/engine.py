"""LLMEngine: validates and admits requests, runs scheduler -> runner -> outputs, step by step.

A request with n > 1 becomes n sequences (children) that share the prompt; each child has
its own seed (seed + i when a seed is given), detokenizer and finish reason.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from pathlib import Path

import numpy as np

from jaxserve.compilation import compilation_count, enable_persistent_cache, install_counter
from jaxserve.config import EngineConfig
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.input_builder import MAX_BANNED_IDS
from jaxserve.kv_cache_manager import KVCacheManager, PrefixCacheStats
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.runner import ModelRunner, replica_mesh
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler, SchedulerOutput
from jaxserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Tracked:
    """One user request: its children sequences and what has been reported."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    prompt_logprobs: list | None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None,
                 rank: int = 0) -> None:
        """runner: the device side; built from config on data-parallel replica `rank`'s
        devices when not given (benchmarks pass a null runner to measure the host side)."""
        install_counter()
        enable_persistent_cache(config.compilation_cache_dir)
        self.config = config
        self.tokenizer = load_tokenizer(config.model.tokenizer)
        self.runner = runner if runner is not None else ModelRunner(
            config, replica_mesh(config, rank))
        self.eos_token_ids = frozenset(_eos_token_ids(config, self.tokenizer))
        blocks, size = self.runner.num_blocks, config.cache.block_size
        self.kv_cache = KVCacheManager(blocks, size,
                                       enable_caching=config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache)
        max_len = config.model.max_model_len
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB); max concurrency at "
                    "max_model_len=%d: %.2f; prefix caching %s", blocks - 1, size,
                    (blocks - 1) * size, blocks * self.runner.bytes_per_block / 2**20, max_len,
                    (blocks - 1) / self.runner.blocks_per_seq,
                    "on" if config.cache.enable_prefix_caching else "off")
        if config.precompile:
            self.runner.warm_up()
        self._rng = np.random.default_rng(config.model.seed)
        # A token's text for logprob entries (up to 21 per sampled token), cached per engine.
        self._decode_one = functools.lru_cache(maxsize=65536)(self._decode_token)
        self._tracked: dict[str, _Tracked] = {}
        self._by_child: dict[str, _Tracked] = {}
        # The step dispatched to the device and not collected yet: (its batch, its handle).
        self._in_flight: tuple[SchedulerOutput, object] | None = None

    # ---- admission ----------------------------------------------------------------------
    @property
    def num_compilations(self) -> int:
        return compilation_count()

    @property
    def in_flight(self) -> SchedulerOutput | None:
        """The batch of the step running on the device, not collected yet (None if none)."""
        return self._in_flight[0] if self._in_flight is not None else None

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Tokens looked up in the prefix cache and tokens served from it, so far."""
        return self.kv_cache.stats

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field for anything the engine cannot run."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params)}.")
        max_len, vocab = self.config.model.max_model_len, self.config.model.vocab_size
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt must not be empty (it has 0 tokens).")
        if len(prompt_token_ids) >= max_len:
            raise ValueError(f"prompt is {len(prompt_token_ids)} tokens long, but must be shorter "
                             f"than max_model_len={max_len} to leave room for output.")
        ids = np.asarray(prompt_token_ids)
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= vocab:
            bad = [t for t in prompt_token_ids if not (isinstance(t, (int, np.integer))
                                                       and 0 <= t < vocab)][:3]
            raise ValueError(f"prompt_token_ids must be integers in [0, {vocab}) (the model's "
                             f"vocabulary); got {bad}.")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got "
                             f"{params.stop_token_ids}.")
        if params.min_tokens and len(self.eos_token_ids | set(params.stop_token_ids)) > \
                MAX_BANNED_IDS:
            raise ValueError(f"min_tokens works with at most {MAX_BANNED_IDS} stop_token_ids "
                             "(EOS included).")

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0) -> None:
        if request_id in self._tracked:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        self.validate(prompt_token_ids, params)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        children, detoks = [], []
        for i in range(params.n):
            seed = (params.seed + i if params.seed is not None
                    else int(self._rng.integers(0, 2**32)))
            child = Request(f"{request_id}#{i}", prompt_token_ids, params, seed=seed % 2**32,
                            max_model_len=self.config.model.max_model_len,
                            eos_token_ids=self.eos_token_ids, priority=priority)
            children.append(child)
            detoks.append(IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens))
        tracked = _Tracked(request_id, prompt, prompt_token_ids, params, children, detoks,
                           [None] if params.prompt_logprobs is not None else None)
        self._tracked[request_id] = tracked
        for child in children:
            self._by_child[child.request_id] = tracked
            self.scheduler.add(child)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks. Returns its last output (unfinished choices
        end with finish_reason 'abort'), or None if it is not (or no longer) known."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        for child in tracked.children:
            if not child.finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)
            self._by_child.pop(child.request_id, None)
        return self._make_output(tracked)

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._tracked)

    # ---- one step -----------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Fold in the results of the step on the device, start the next one, and while it
        runs detokenize and build outputs (JAX dispatch is asynchronous, so that host work
        overlaps the device's).

        Returns the outputs of the requests that got tokens (finished ones are then
        forgotten); with final_only, only of those that finished (offline generation needs
        no intermediate outputs). Results come one call after the step that made them:
        call until has_unfinished_requests() is False."""
        appended = self._collect()  # sampling results: tokens, stop tokens, lengths
        self._launch()  # the next step, scheduled with those tokens
        changed: dict[str, _Tracked] = {}
        for tracked, req, token in appended:  # overlaps the device step just launched
            self._detokenize(tracked, req, token)
            changed[tracked.request_id] = tracked
        outputs = [self._make_output(t) for t in changed.values()
                   if not final_only or t.finished]
        for output in outputs:
            if output.finished:
                tracked = self._tracked.pop(output.request_id)
                for child in tracked.children:
                    self._by_child.pop(child.request_id, None)
        return outputs

    def _launch(self) -> None:
        out = self.scheduler.schedule()
        if out.empty:
            return
        targets = self._prompt_score_targets(out)
        try:
            self._in_flight = (out, self.runner.dispatch(out, targets))
        except BaseException:
            self._drop_cached_blocks()
            raise

    def _drop_cached_blocks(self) -> None:
        # Scheduling registered the blocks a step fills; if the step did not run (an error,
        # Ctrl-C), their KV may be missing, so no later request may hit them.
        self.kv_cache.reset_prefix_cache()

    def _collect(self) -> list[tuple[_Tracked, Request, int]]:
        """Wait for the step in flight and fold its results in: computed tokens, prompt
        logprobs, sampled tokens, and the finishes that need no text (stop token ids, EOS,
        length). Returns the (request, token) pairs sampled."""
        if self._in_flight is None:
            return []
        out, handle = self._in_flight
        self._in_flight = None
        try:
            result = self.runner.fetch(handle)
        except BaseException:
            self._drop_cached_blocks()
            raise
        appended = []
        start = 0
        for row, (req, count) in enumerate(zip(out.requests, out.num_scheduled_tokens)):
            first, start = start, start + count
            if req.finished:
                continue  # stopped (stop string) or aborted while the step ran: dropped
            tracked = self._by_child[req.request_id]
            if result.prompt_scores is not None and tracked.prompt_logprobs is not None \
                    and req is tracked.children[0]:
                self._record_prompt_logprobs(tracked, req, first, count, result.prompt_scores)
            req.num_computed_tokens += count
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk: nothing sampled yet
            appended.append((tracked, req, self._append(req, row, result.sampled)))
        return appended

    def _append(self, req: Request, row: int, sampled) -> int:
        token = int(sampled.token_ids[row])
        req.append_token(token)
        if req.params.logprobs is not None:
            k = req.params.logprobs
            req.logprobs.append(self._logprob_dict(
                token, float(sampled.logprobs[row]), int(sampled.ranks[row]),
                sampled.top_ids[row][:k], sampled.top_logprobs[row][:k]))
            req.cumulative_logprob += float(sampled.logprobs[row])
        if req.check_stop_token():
            self.scheduler.finish(req, req.status)
        return token

    def _detokenize(self, tracked: _Tracked, req: Request, token: int) -> None:
        """Text for the token, and stop strings: a request that matches one finishes now,
        and its row in the step already running is dropped when that step is collected."""
        detok = tracked.detokenizers[tracked.children.index(req)]
        stop_str = detok.update(
            [token], stop_terminated=req.status is RequestStatus.FINISHED_STOPPED,
            check_stop=req.num_output_tokens > req.params.min_tokens)
        if stop_str is not None:
            req.stop_reason = stop_str
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)

    def _prompt_score_targets(self, out) -> np.ndarray | None:
        wanted = []
        for req in out.requests:
            tracked = self._by_child[req.request_id]
            wanted.append(tracked.prompt_logprobs is not None and req is tracked.children[0]
                          and req.num_computed_tokens < req.num_prompt_tokens - 1)
        if not any(wanted):
            return None
        targets = np.full(out.total_num_scheduled_tokens, -1, np.int32)
        start = 0
        for req, count, want in zip(out.requests, out.num_scheduled_tokens, wanted):
            first = req.num_computed_tokens
            end = min(first + count, req.num_prompt_tokens - 1)
            if want and end > first:
                targets[start: start + end - first] = req.token_ids[first + 1: end + 1]
            start += count
        return targets

    def _record_prompt_logprobs(self, tracked, req, start, count, scores) -> None:
        k = tracked.params.prompt_logprobs
        have = len(tracked.prompt_logprobs)  # positions 0..have-1 are done
        first = req.num_computed_tokens
        for pos in range(max(first, have - 1), min(first + count, req.num_prompt_tokens - 1)):
            i = start + pos - first
            target = int(req.token_ids[pos + 1])
            tracked.prompt_logprobs.append(self._logprob_dict(
                target, float(scores.logprobs[i]), int(scores.ranks[i]),
                scores.top_ids[i][:k], scores.top_logprobs[i][:k]))

    def _logprob_dict(self, token, logprob, rank, top_ids, top_logprobs) -> dict[int, Logprob]:
        entries = {int(t): Logprob(float(lp), r + 1, self._decode_one(int(t)))
                   for r, (t, lp) in enumerate(zip(top_ids, top_logprobs))}
        if token not in entries:
            entries = {token: Logprob(logprob, rank, self._decode_one(token)), **entries}
        return entries

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _make_output(self, tracked: _Tracked) -> RequestOutput:
        completions = []
        for i, (child, detok) in enumerate(zip(tracked.children, tracked.detokenizers)):
            logprobs = cumulative = None
            if child.params.logprobs is not None:
                logprobs, cumulative = list(child.logprobs), child.cumulative_logprob
            # Safe text: while running, the tail that could still become a stop string (or
            # an incomplete character) is held back, so streamed deltas never retract.
            finished = child.finished
            text = detok.get_next_output_text(finished=finished, delta=False)
            reason = child.status.value if finished else None
            completions.append(CompletionOutput(i, text, child.output_token_ids, cumulative,
                                                logprobs, reason, child.stop_reason))
        scheduled = [c.scheduled_time for c in tracked.children if c.scheduled_time is not None]
        metrics = RequestMetrics(tracked.children[0].arrival_time,
                                 min(scheduled) if scheduled else None)
        # Prompt tokens served from the prefix cache, for the first choice (with n > 1 the
        # other choices usually hit the blocks the first one computed).
        cached = tracked.children[0].num_cached_tokens or 0
        return RequestOutput(tracked.request_id, tracked.prompt, tracked.prompt_token_ids,
                             tracked.prompt_logprobs, completions, tracked.finished,
                             num_cached_tokens=cached, metrics=metrics)


def _eos_token_ids(config: EngineConfig, tokenizer) -> set[int]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer."""
    path = Path(config.model.model) / "generation_config.json"
    for source in (json.loads(path.read_text()) if path.is_file() else {},
                   config.model.hf_config):
        eos = source.get("eos_token_id")
        if eos is not None:
            return set(eos) if isinstance(eos, list) else {int(eos)}
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
