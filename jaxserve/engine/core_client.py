"""EngineCoreClient: the front end's engine when the engine runs in a process of its own.

It implements interface.EngineInterface, so the server's AsyncLLMEngine (and gRPC) drive it
as they drive an LLMEngine, while the scheduler, the runner and the grammars step in the
engine core process (core_process.py) without sharing this process's interpreter lock.
Here stay the admission path (InputProcessor: limits, templates, tokenization, grammars
checked in the sandbox) and the outputs: each request is mirrored by an output_processor
TrackedRequest whose choices are core.request.Request objects that receive the core's
tokens and finishes, so detokenization, stop-string text, logprob entries and
RequestOutputs are made by the same code as in one process, and match it token for token.
Stop strings are matched by the core too (it stops the request there); the front end's
detokenizer finds the same match, since both see the same tokens.

A reader thread drains the core's messages as they come (so the core never blocks on a
full pipe); step() folds in everything that came since the last call and builds outputs
once per request, however many steps the core ran meanwhile. Sleep mode and weight updates
are utility calls: a "call" the core runs between steps and answers with a "reply", whose
result is returned (or exception raised) in the caller (_call).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import Future

from jaxserve.backends.compile_stats import CompileRecords
from jaxserve.core.request import Request, RequestStatus
from jaxserve.engine.admission import EngineRequest, InputProcessor
from jaxserve.engine.core_process import run_engine_core
from jaxserve.engine.failures import EngineDeadError, describe
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
    check_level,
    check_tags,
    host_weights,
)
from jaxserve.engine.stats import EngineStats, HostTimes

logger = logging.getLogger(__name__)

_STEP_WAIT_S = 0.05  # the longest step() waits for the core's news (wake() cuts it short)

# The fewest CPUs with which `serve` steps the engine in a process of its own by default.
# Measured (scripts/bench_async_scheduling.py, 256 streams, a 5 ms stand-in device step, the
# clients on the same 2-CPU machine): with a CPU to itself the core kept the device 0.99
# busy, against 0.64-0.70 on a thread; sharing the two CPUs with the HTTP side and the
# clients, it got 0.42-0.74.
ENGINE_PROCESS_MIN_CPUS = 4


def engine_process_by_default() -> bool:
    """Whether `serve` runs the engine core process when neither --engine-process nor
    --no-engine-process is given: when this process may use ENGINE_PROCESS_MIN_CPUS CPUs."""
    return len(os.sched_getaffinity(0)) >= ENGINE_PROCESS_MIN_CPUS


class EngineCoreClient(EngineInterface):
    def __init__(self, factory, args: tuple = (), *, log_level: str | None = None) -> None:
        """Start the engine core process, which builds its engine with factory(*args) (a
        module-level function: the process is spawned, not forked, so that only it ever
        initializes the accelerator), and wait until it is ready. Raises what the factory
        raised (a ValueError for a bad setting), or RuntimeError if the process died.
        log_level: the core's logging level (default: the "jaxserve" logger's here)."""
        context = multiprocessing.get_context("spawn")
        commands, self._commands = context.Pipe(duplex=False)
        self._results, results = context.Pipe(duplex=False)
        level = log_level or logging.getLevelName(
            logging.getLogger("jaxserve").getEffectiveLevel())
        self._process = context.Process(
            target=run_engine_core, args=(commands, results, factory, args, level),
            name="jaxserve-engine-core")
        self._process.start()
        commands.close()
        results.close()
        try:
            kind, payload = self._results.recv()
        except (EOFError, OSError):
            self._process.join(5)
            raise RuntimeError(f"the engine core process exited during start-up (exit code "
                               f"{self._process.exitcode}); its log says why") from None
        if kind == "failed":
            self._process.join(5)
            raise payload
        try:
            self._start(payload)
        except BaseException:
            self._commands.send(("close",))
            self._process.join(30)
            raise
        logger.info("The engine core runs in process %d", self._process.pid)

    def _start(self, config) -> None:
        """What follows the core's "ready" (its EngineConfig): the admission path, the
        mirrors, and the reader thread."""
        self.config = config
        self.processor = InputProcessor.for_config(self.config)
        self.tokenizer, self.eos_token_ids = self.processor.tokenizer, \
            self.processor.eos_token_ids
        self.runner = None  # on the core's side
        self.outputs = OutputBuilder(self.tokenizer)
        self.host_times = HostTimes()  # the core's, as of its last message
        self._tracked: dict[str, TrackedRequest] = {}
        self._failed: list[TrackedRequest] = []  # failed here (while building outputs)
        self._stats = EngineStats()
        self._compile_records = CompileRecords()  # the core's, as of its last message
        self._seqs_sent = 0  # sequences sent to the core (its stats count those it took)
        self._seqs_taken = 0
        self._send_lock = threading.Lock()  # one message at a time into the pipe
        self._process_lock = threading.Lock()  # one thread at a time waits for the process
        self._news: list = []  # the core's messages not folded in yet
        self._news_ready = threading.Condition()
        self._dead: str | None = None
        self._closed = False
        self._calls: dict[int, Future] = {}  # utility calls sent, waiting for their reply
        self._call_ids = itertools.count()
        self._sleeping = False  # as of the last sleep / wake_up call (they all come here)
        self._reader = threading.Thread(target=self._read, name="jaxserve-core-reader",
                                        daemon=True)
        self._reader.start()

    # ---- the EngineInterface ----------------------------------------------------------
    def stats(self) -> EngineStats:
        """The core's latest snapshot; the sequences sent to it and not yet taken count as
        waiting, and unfinished requests are those this front end still follows."""
        stats = self._stats
        return dataclasses.replace(
            stats, waiting=stats.waiting + self._seqs_sent - self._seqs_taken,
            unfinished_requests=len(self._tracked))

    def add_processed(self, request: EngineRequest) -> None:
        assert isinstance(request, EngineRequest), type(request)
        if request.request_id in self._tracked:
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._sleeping:
            raise EngineSleepingError()
        params = request.params
        max_len = self.config.model.max_model_len
        children = [Request(f"{request.request_id}#{i}", request.prompt_token_ids, params,
                            seed=0, max_model_len=max_len, eos_token_ids=self.eos_token_ids,
                            priority=request.priority,
                            max_output_tokens=request.budget(max_len))
                    for i in range(params.n)]
        tracked = track(request, children, self.tokenizer)
        # The compiled grammar (an llguidance matcher) does not cross processes: the core
        # compiles it again.
        self._send(("add", request.with_grammar(None)))
        self._tracked[request.request_id] = tracked
        self._seqs_sent += params.n

    def abort_request(self, request_id: str, report: bool = True) -> RequestOutput | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        with contextlib.suppress(EngineDeadError):  # (a core that is gone stopped it too)
            self._send(("abort", request_id))
        if tracked in self._failed:
            self._failed.remove(tracked)
        if not report:
            return None
        if tracked.error is not None:
            return self.outputs.error_output(tracked)
        for child in tracked.children:
            if not child.finished:
                child.status = RequestStatus.FINISHED_ABORTED
        try:
            return self.outputs.make_output(tracked)
        except Exception as err:  # noqa: BLE001 - this request's output only
            self._fail_here(tracked, err)
            self._failed.remove(tracked)  # reported here, not by a later step
            return self.outputs.error_output(tracked)

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked)

    def step(self, final_only: bool = False, wanted=None,
             wait: float = _STEP_WAIT_S) -> list[RequestOutput]:
        """Fold in what the core sent since the last call (waiting up to `wait` seconds for
        its next message when nothing came) and build the outputs of the requests it
        changed, as LLMEngine.step. Raises EngineDeadError once the core has died."""
        with self._news_ready:
            if not self._news and self._dead is None and wait > 0:
                self._news_ready.wait(wait)
            news, self._news = self._news, []
        if not news and self._dead is not None:
            raise EngineDeadError(self._dead)
        changed: dict[str, TrackedRequest] = {}
        tracked_by_id = self._tracked
        for ids, tokens, records in news:
            for request_id, token in zip(ids, tokens):  # one token, nothing else
                tracked = tracked_by_id.get(request_id)
                if tracked is not None:  # (else aborted here meanwhile)
                    tracked.children[0].append_token(token)
                    changed[request_id] = tracked
            for record in records:
                tracked = self._apply(record)
                if tracked is not None:
                    changed[tracked.request_id] = tracked
        outputs = self.outputs.step_outputs(changed.values(), self._failed, self._fail_here,
                                            final_only, wanted)
        self._failed = []
        for output in outputs:
            if output.finished:
                self._tracked.pop(output.request_id, None)
        return outputs

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def compile_records(self) -> CompileRecords:
        """The core's compile records, as of its last message."""
        return self._compile_records

    def wake(self) -> None:
        with self._news_ready:
            self._news_ready.notify_all()

    def reset_prefix_cache(self) -> None:
        """Sent to the core, which handles it before any request sent after it."""
        self._send(("reset-prefix-cache",))

    # ---- utility calls: run by the core between steps, answered in order ------------------
    def sleep(self, level: int = 1) -> None:
        self._call("sleep", check_level(level))
        self._sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call("wake_up", check_tags(tags))
        self._sleeping = self._call("is_sleeping")

    def is_sleeping(self) -> bool:
        return self._sleeping

    def update_weights(self, weights) -> int:
        """The tensors cross the pipe (a folder, by its path: the core reads it)."""
        return self._call("update_weights", host_weights(weights))

    def _call(self, method: str, *args):
        """engine.method(*args) in the core: its result, or what it raised (EngineDeadError
        when the core dies first)."""
        future: Future = Future()
        with self._news_ready:  # (the reader fails the calls waiting when the core dies)
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        try:
            self._send(("call", call_id, method, args))
        except BaseException:
            with self._news_ready:
                self._calls.pop(call_id, None)
            raise
        return future.result()

    def close(self) -> None:
        """Stop the core (it closes its engine) and wait for it to exit."""
        if self._closed:
            return
        self._closed = True
        try:
            self._send(("close",))
        except EngineDeadError:
            pass
        self._stop_core()
        # Nothing compiles in a process that has exited (it left without waiting).
        self._stats = dataclasses.replace(self._stats, compiling=0)
        self.processor.grammars.close()

    def _stop_core(self) -> None:
        """After "close" was sent: wait for the core process to exit (kill it after 30 s)."""
        with self._process_lock:
            self._process.join(30)
        if self._process.is_alive():
            logger.warning("The engine core process did not stop within 30 s: killing it "
                           "(its threads' stacks follow)")
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._process.pid, signal.SIGUSR1)
                time.sleep(1.0)
            self._process.kill()
            self._process.join(5)

    @property
    def pid(self) -> int | None:
        """The engine core process's id."""
        return self._process.pid

    @property
    def exitcode(self) -> int | None:
        """The engine core process's exit code; None while it runs."""
        return self._process.exitcode

    # ---- the core's news ----------------------------------------------------------------
    def _read(self) -> None:
        """The reader thread: takes every message as it comes (the core never waits for a
        full pipe)."""
        while True:
            try:
                message = self._results.recv()
            except (EOFError, OSError):
                reason = self._exit_reason()
                break
            if message[0] == "dead":
                reason = f"the engine core stopped: {message[1]}"
                break
            if message[0] == "reply":
                self._reply(*message[1:])
                continue
            _, ids, tokens, records, stats = message
            # The load and counters at once (stats() reads them while no step runs too);
            # the requests' news when step() folds it in.
            self._stats, self._seqs_taken, steps, seconds, compiled = stats
            self.host_times.steps, self.host_times.seconds = steps, seconds
            if compiled is not None:
                self._compile_records = compiled
            if ids or records:
                with self._news_ready:
                    self._news.append((ids, tokens, records))
                    self._news_ready.notify_all()
                self._on_news()
        if not self._closed:
            logger.error("%s", reason)
        with self._news_ready:
            self._dead = self._dead or reason
            self._news_ready.notify_all()
            calls, self._calls = self._calls, {}
        for future in calls.values():
            future.set_exception(EngineDeadError(self._dead))
        self._on_news()

    def _reply(self, call_id: int, ok: bool, value) -> None:
        with self._news_ready:
            future = self._calls.pop(call_id, None)
        if future is None:
            return  # (its caller gave up)
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def _exit_reason(self) -> str:
        """Why the core's pipe closed (its process exited)."""
        with self._process_lock:  # (two threads must not wait for it at once)
            self._process.join(5)
        return f"the engine core process exited (exit code {self._process.exitcode})"

    def _on_news(self) -> None:
        """The reader thread got news or saw the core die (a data-parallel front end
        listening to several cores hooks this)."""

    def _apply(self, record) -> TrackedRequest | None:
        """One request's news into its mirror, as LLMEngine folds a step in: each token
        taken (a stop token or the length ends the choice), stop strings matched, then the
        core's finish (which is the truth: aborts, errors, grammars that ended)."""
        request_id, choices, extra = record
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None  # aborted here meanwhile
        if extra is not None:
            self._apply_extra(tracked, extra)
        elif tracked.error is not None:
            return None  # failed here: already reported, the core is told to stop it
        for i, tokens, finish, stop_reason, cumulative, logprobs in choices:
            child = tracked.children[i]
            for token in tokens:
                child.take_token(token)
            if logprobs is not None:
                tracked.logprobs[i].extend(logprobs)
                child.cumulative_logprob = cumulative
            if tokens and child.params.stop and tracked.error is None:
                try:
                    match_stop_strings(tracked, child, tokens)
                except Exception as err:  # noqa: BLE001 - this request only
                    self._fail_here(tracked, err)
            if finish is not None:
                child.status = RequestStatus(finish)
                child.stop_reason = stop_reason
        return tracked

    def _apply_extra(self, tracked: TrackedRequest, extra: dict) -> None:
        for child, scheduled in zip(tracked.children, extra["scheduled"]):
            child.scheduled_time = scheduled
        tracked.children[0].num_cached_tokens = extra["num_cached_tokens"]
        if extra["prompt_logprobs"] is not None:
            tracked.prompt_logprobs = extra["prompt_logprobs"]
        if "pooled" in extra:
            tracked.pooled = extra["pooled"]
        if "error" in extra and tracked.error is None:
            tracked.error, tracked.error_param = extra["error"], extra["error_param"]
            self._failed.append(tracked)

    def _fail_here(self, tracked: TrackedRequest, err: Exception) -> None:
        """A request whose output this front end cannot build (its detokenizer failed):
        reported failed, and stopped in the core."""
        if tracked.error is not None:
            return
        logger.error("Request %s failed while building its output: %s", tracked.request_id,
                     describe(err), exc_info=err)
        tracked.error = f"the engine failed on this request while building its output " \
            f"({type(err).__name__})"
        for child in tracked.children:
            if not child.finished:
                child.status = RequestStatus.FINISHED_ERROR
        self._failed.append(tracked)
        with contextlib.suppress(EngineDeadError):  # (a core that is gone stopped it too)
            self._send(("abort", tracked.request_id))

    def _send(self, message) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        try:
            with self._send_lock:
                self._commands.send(message)
        except (BrokenPipeError, OSError) as err:
            raise EngineDeadError(f"the engine core process is gone ({describe(err)})") \
                from None

