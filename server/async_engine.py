"""AsyncLLMEngine: the engine stepping in one background thread, shared by many requests.

The HTTP side lives on an asyncio loop; the engine (JAX calls that block) runs in a thread of
its own. Requests (admitted: admission.EngineRequest, made off the event loop) and aborts
cross to the engine thread through a queue. Each request's outputs come back coalesced: a
RequestOutput is cumulative, so the stream keeps only the latest one (or a final error) until
its consumer takes it, and a slow reader holds one output, never a queue of them. Every step
serves every connection at once (continuous batching across connections). A request whose
consumer goes away (client disconnect, cancelled task) is aborted and its KV blocks are freed
on the next loop turn. Pooling requests (embeddings, classifications, scores) take the same
path and end with one output (encode, encode_many). Calls on the engine (the prefix-cache
flush, sleep mode, weight updates) cross the same queue and are awaited: engine_calls.py.
What the front ends read of the engine (its admission path, tokenizer, model config) is
engine_view.py's: no front end reaches into the engine itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from jaxserve.engine.admission import EngineRequest
from jaxserve.engine.llm_engine import EngineDeadError, LLMEngine
from jaxserve.engine.outputs import PoolingRequestOutput, RequestOutput
from jaxserve.engine.sleep_mode import EngineSleepingError
from jaxserve.engine.stats import EngineStats
from jaxserve.server.engine_calls import EngineAsleepError, EngineCalls, run_call
from jaxserve.server.engine_view import EngineView
from jaxserve.server.loads import RollingRate
from jaxserve.server.metrics import EngineMetrics
from jaxserve.server.request_log import log_finished
from jaxserve.server.stats_log import StatsLog

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05

__all__ = ["AsyncLLMEngine", "EngineDeadError", "OverloadedError", "RequestFailedError"]


class OverloadedError(RuntimeError):
    """Too many requests are waiting; the client should retry later."""


class RequestFailedError(RuntimeError):
    """The engine failed this request alone (the message says where); others go on.
    param: the request field whose value caused it (a bad request), else None."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    arrival: float
    num_prompt_tokens: int
    n: int = 1
    max_tokens: int = 0  # the most tokens each sequence may generate
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    # The output (or error) its consumer has not taken yet: the engine thread replaces it
    # with each newer one (an error is final), and wakes the consumer once per take.
    latest: RequestOutput | BaseException | None = None
    wake_pending: bool = False
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def put(self, item) -> bool:
        """Engine thread: make item the latest; False when the consumer's loop is gone."""
        if not self.replace(item):
            return True
        try:
            self.loop.call_soon_threadsafe(self.ready.set)
        except RuntimeError:  # "Event loop is closed": nobody reads it any more
            return False
        return True

    def replace(self, item) -> bool:
        """Engine thread: make item the latest; True when the consumer must be woken (its
        ready event set on its loop: put, or a step's wakes all at once)."""
        with self.lock:
            if not isinstance(self.latest, BaseException):
                self.latest = item
            if self.wake_pending:
                return False
            self.wake_pending = True
            return True

    async def take(self):
        """Event loop: the latest output or error, once there is one."""
        while True:
            await self.ready.wait()
            with self.lock:
                item, self.latest = self.latest, None
                self.wake_pending = False
                self.ready.clear()
            if item is not None:
                return item


class AsyncLLMEngine(EngineCalls, EngineView):
    def __init__(self, engine: LLMEngine, *, max_waiting_requests: int = 4096,
                 metrics: EngineMetrics | None = None, log_requests: bool = False,
                 log_outputs: bool = False, log_stats: bool = True,
                 max_log_len: int | None = None) -> None:
        """log_requests: a line per finished request (--enable-log-requests), with its
        output text when log_outputs (--enable-log-outputs; at most max_log_len characters);
        log_stats: the throughput line every few seconds (off: --disable-log-stats)."""
        self.engine = engine
        self.log_requests, self.log_outputs = log_requests, log_outputs
        self.log_stats, self.max_log_len = log_stats, max_log_len
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams between the two threads
        self._pending = 0  # sequences sent to the engine thread, not yet taken in
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        # The engine's latest EngineStats, taken on the engine thread after every loop turn:
        # other threads read it (and _pending) under _lock, never the scheduler's queues.
        self._stats = engine.stats()
        self._stats_log = StatsLog(self._stats.compilations)
        self.generation_rate = RollingRate()  # tokens generated per second (gRPC GetLoads)

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._notify()
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def dead_reason(self) -> str:
        """Why the engine loop stopped (for /health), '' while it runs."""
        if self.error is not None:
            return f"the engine loop has stopped: {self.error}"[:300]
        return "" if self._thread.is_alive() else "the engine loop is not running"

    @property
    def warm_up_done(self) -> bool:
        """Whether every bucket is compiled (the background warm-up has finished)."""
        return self.stats.warm_up_done

    @property
    def stats(self) -> EngineStats:
        """The engine's latest snapshot (at most one loop turn old)."""
        with self._lock:
            return self._stats

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def waiting_prompt_tokens(self, sequences: int) -> int:
        """The prompt tokens of the youngest requests with no token out yet that hold at
        most `sequences` sequences (the engine's waiting count): the engine starts requests
        first come first served, so the older ones without a token are in prefill."""
        with self._lock:
            streams = list(self._streams.values())
        tokens = 0
        for stream in reversed(streams):  # (submission order: the youngest last)
            if stream.first_token is not None:
                continue
            if stream.n > sequences:
                break
            sequences -= stream.n
            tokens += stream.num_prompt_tokens
        return tokens

    def _notify(self) -> None:
        """Wake the engine thread: idle, or in a step() that waits for an engine core."""
        self._wake.set()
        self.engine.wake()

    # ---- the HTTP side ------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Queue one admitted request now (raising OverloadedError, EngineDeadError or
        ValueError, at once: an id in use, or more sequences than max_waiting_requests) and
        return the iterator of its outputs.
        Leaving the iteration before the request finishes aborts it. Call from the event
        loop."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: list[EngineRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Queue several admitted requests (the prompts of one user request) all or none:
        the admission cap is checked for all of them at once, so refusing a large request
        never refuses or aborts anyone else's; one with more sequences than the cap itself
        gets ValueError (it could never be admitted: a 400, where OverloadedError is a 429 to
        retry). Nothing heavy runs here (the admission path did the work off the event
        loop)."""
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "the engine loop has stopped")
        self.check_awake()  # (sleep mode: engine_calls.py)
        sequences = sum(r.params.n for r in requests)
        if sequences > self.max_waiting_requests:
            # Never admitted, however empty the queue: a 400, not a 429 clients would retry.
            raise ValueError(
                f"This request holds {sequences} sequences (inputs or prompts x n), more than "
                f"the {self.max_waiting_requests} that may wait at once "
                f"(--max-waiting-requests): it can never be admitted. Send at most "
                f"{self.max_waiting_requests} (fewer inputs or prompts, or a smaller n), or "
                "raise --max-waiting-requests.")
        loop, max_len = asyncio.get_running_loop(), self.max_model_len
        streams = [_Stream(loop, time.monotonic(), len(r.prompt_token_ids), r.params.n,
                           r.budget(max_len)) for r in requests]
        ids = [r.request_id for r in requests]
        with self._lock:
            waiting = self._stats.waiting + self._pending
            if waiting + sequences > self.max_waiting_requests:
                raise OverloadedError(
                    f"{waiting} sequences are already waiting and this request adds "
                    f"{sequences} (the cap is {self.max_waiting_requests}); retry later")
            if len(set(ids)) != len(ids) or any(i in self._streams for i in ids):
                raise ValueError("request_id must be unique: this one is already in use")
            self._streams.update(zip(ids, streams))
            self._pending += sequences
        for request in requests:
            self._inbox.put(("add", request))
        self._notify()
        return [self._outputs(request_id, stream) for request_id, stream in zip(ids, streams)]

    async def encode(self, request: EngineRequest) -> PoolingRequestOutput:
        """Queue one admitted pooling request (InputProcessor.process_pooling) and await its
        output, as encode_many."""
        return (await self.encode_many([request]))[0]

    async def encode_many(self, requests: list[EngineRequest]) -> list[PoolingRequestOutput]:
        """Queue the admitted pooling requests of one embedding, classification or scoring
        request, all or none (as submit_many: OverloadedError, EngineDeadError, ValueError at
        once), and await their outputs, in order. A request the engine failed raises
        RequestFailedError; cancelling the call aborts those still running."""
        if any(r.pooling is None for r in requests):
            raise ValueError("encode takes pooling requests (InputProcessor.process_pooling); "
                             "generation requests go through submit.")
        streams = self.submit_many(requests)

        async def last(stream) -> PoolingRequestOutput:
            async for output in stream:
                final = output
            if final.error is not None:
                raise RequestFailedError(final.error, final.error_param)
            return final

        tasks = [asyncio.ensure_future(last(stream)) for stream in streams]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # (one failed or the call was cancelled: stop the others)
                task.cancel()

    async def _outputs(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.take()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._notify()

    def stop_request(self, request_id: str) -> None:
        """End a request now and hand its consumer the final output (finish_reason
        "abort"), as vLLM's abort does to a stream that is still read; unknown ids are
        ignored."""
        self.stop_requests([request_id])

    def stop_requests(self, request_ids) -> int:
        """stop_request for several ids at once: only the known ones cross to the engine
        thread, in one message. Returns how many were known."""
        with self._lock:
            known = [i for i in dict.fromkeys(request_ids) if i in self._streams]
        if known:
            self._inbox.put(("abort-report", known))
            self._notify()
        return len(known)

    def abort_all(self) -> None:
        with self._lock:
            ids = list(self._streams)
        self.stop_requests(ids)

    # ---- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        """The engine thread. A request the engine fails ends alone (its output carries the
        error); the loop stops only when the engine is dead (EngineDeadError: the device
        fails even with no request in the step) or on an error outside the engine."""
        try:
            while not self._stop.is_set():
                self._take_inbox()
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step(wanted=self._wants_output)
                    now = time.monotonic()
                    wakes: dict = {}  # event loop -> its streams to wake, at once
                    for output in outputs:
                        self._deliver(output, now, wakes)
                    self._wake_all(wakes)
                else:
                    self.engine.check_health()  # (an engine core may die while idle)
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
                self._update_gauges()
        except BaseException as err:  # noqa: BLE001 - reported to every waiting request
            self.error = err
            logger.error("The engine loop stopped (%s); failing all %d requests in flight",
                         err, self.num_in_flight, exc_info=err)
            with self._lock:
                streams = list(self._streams.values())
                self._streams.clear()
            for stream in streams:
                _send(stream, EngineDeadError(self.dead_reason))

    def _take_inbox(self) -> None:
        taken = 0  # sequences added (or refused): counted in the next snapshot, not _pending
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                if taken:
                    self._publish_stats(taken)
                return
            if kind == "add":
                request_id, params = payload.request_id, payload.params
                with self._lock:
                    stream = self._streams.get(request_id)
                try:
                    self.engine.add_processed(payload)
                except EngineSleepingError:  # (sleep came first in the inbox)
                    self._close(request_id, EngineAsleepError())
                    continue
                except EngineDeadError:
                    raise  # not this request's failure: the loop stops
                except ValueError as err:
                    self._close(request_id, err)
                    continue
                except Exception as err:  # noqa: BLE001 - this request only
                    logger.error("Request %s could not be added: %s", request_id, err,
                                 exc_info=err)
                    self._close(request_id, RequestFailedError(
                        f"the engine failed on this request while adding it "
                        f"({type(err).__name__})"))
                    continue
                finally:
                    taken += params.n
                if stream is not None and self.metrics:
                    self.metrics.prompt_tokens.inc(stream.num_prompt_tokens)
            elif kind == "abort":  # the consumer is gone: nobody to tell
                output = self.engine.abort_request(payload)
                stream = self._forget(payload)
                if output is not None and stream is not None:
                    self._record_finish(output, stream, time.monotonic())
            elif kind == "abort-report":  # end the requests and tell their consumers
                for request_id in payload:
                    output = self.engine.abort_request(request_id)
                    if output is not None:
                        self._deliver(output, time.monotonic())
            elif kind == "call":  # prefix-cache flush, sleep mode (engine_calls.py)
                run_call(payload)

    def _wants_output(self, request_id: str) -> bool:
        """Engine thread: whether a request's stream has taken its last output (a newer one
        would only replace an untaken one: the engine skips building it)."""
        stream = self._streams.get(request_id)  # (a dict read; the lock guards writes)
        return stream is None or not stream.wake_pending

    def _wake_all(self, wakes: dict) -> None:
        """Wake the consumers of a step's outputs: one call into each event loop (not one
        per stream). A loop that has closed has nobody reading: its requests are aborted."""
        for loop, streams in wakes.items():
            try:
                loop.call_soon_threadsafe(_set_ready, [s.ready for _, s in streams])
            except RuntimeError:  # "Event loop is closed"
                for request_id, _ in streams:
                    if request_id is not None:
                        self._forget(request_id)
                        self.engine.abort_request(request_id)

    def _deliver(self, output: RequestOutput, now: float, wakes: dict | None = None) -> None:
        """Hand an output to its stream: woken at once, or (wakes given) added to the
        step's wakes for _wake_all."""
        with self._lock:
            stream = self._streams.get(output.request_id)
        if stream is None:
            return
        tokens = 0 if isinstance(output, PoolingRequestOutput) else sum(
            len(c.token_ids) for c in output.outputs)
        new = tokens - stream.num_tokens
        if new > 0:
            self._record_tokens(stream, new, now)
        if output.finished:
            self._record_finish(output, stream, now)
            self._forget(output.request_id)
        if wakes is not None:
            if stream.replace(output):  # (a finished one has nothing left to abort)
                wakes.setdefault(stream.loop, []).append(
                    (None if output.finished else output.request_id, stream))
            return
        if not _send(stream, output) and not output.finished:
            # Its consumer's event loop is gone (nobody reads it any more): abort it now.
            self._forget(output.request_id)
            self.engine.abort_request(output.request_id)

    def _close(self, request_id: str, err: BaseException) -> None:
        stream = self._forget(request_id)
        if stream is not None:
            _send(stream, err)

    def _forget(self, request_id: str) -> _Stream | None:
        with self._lock:
            return self._streams.pop(request_id, None)

    # ---- metrics and logs ---------------------------------------------------------------
    def _record_tokens(self, stream: _Stream, new: int, now: float) -> None:
        self.generation_rate.add(new, now)
        if self.metrics:
            self.metrics.generation_tokens.inc(new)
            if stream.first_token is None:
                self.metrics.time_to_first_token.observe(now - stream.arrival)
            else:
                self.metrics.token_gap((now - stream.last_token) / new)
        if stream.first_token is None:
            stream.first_token = now
        stream.last_token = now
        stream.num_tokens += new

    def _record_finish(self, output: RequestOutput, stream: _Stream, now: float) -> None:
        if self.log_requests:
            ttft = (stream.first_token - stream.arrival) if stream.first_token else float("nan")
            log_finished(output, stream.num_prompt_tokens, stream.num_tokens, ttft,
                         now - stream.arrival, self.log_outputs, self.max_log_len)
        if self.metrics:
            self.metrics.request_finished(output, stream.arrival, stream.first_token, now,
                                          stream.n, stream.max_tokens)

    def _publish_stats(self, taken: int = 0) -> EngineStats:
        """Take a snapshot (engine thread); `taken` sequences left _pending and are in it."""
        stats = self.engine.stats()
        with self._lock:
            self._stats = stats
            self._pending -= taken
        return stats

    def _update_gauges(self) -> None:
        stats = self._publish_stats()
        if self.metrics:
            self.metrics.update_gauges(running=stats.running, waiting=stats.waiting,
                                       kv_usage=stats.kv_usage, preemptions=stats.preemptions,
                                       prefix_cache=(stats.prefix_cache_queries,
                                                     stats.prefix_cache_hits),
                                       replicas=(stats.replicas - len(stats.replicas_lost),
                                                 len(stats.replicas_lost)))
            self.metrics.update_spec_decode(stats.spec_drafts, stats.spec_draft_tokens,
                                            stats.spec_accepted_tokens,
                                            stats.spec_accepted_per_pos)
        if self.metrics and self.log_stats:
            self._stats_log.maybe_log(stats, self.metrics)


def _set_ready(events) -> None:
    """On an event loop: wake these streams' consumers."""
    for event in events:
        event.set()


def _send(stream: _Stream, item) -> bool:
    """Hand an output (or an error) to the stream's consumer; False when its event loop has
    closed (its consumer is gone: a client of a short-lived loop, a server shutting down),
    which must never stop the engine thread."""
    return stream.put(item)
