"""The engine core process: the engine (scheduler, runner, grammars) stepping in a process of
its own, as vLLM v1's EngineCore, behind core_client.EngineCoreClient.

Why a process: the server's HTTP work (parsing, SSE encoding, socket writes for hundreds of
streams) and the engine's host work between device steps cannot share one interpreter
lock without the device waiting for the HTTP side. Here the core only schedules, launches,
folds in tokens and sends each step's news; detokenization and output objects are the
front end's (the client mirrors every request, output_processor's code on its side).

The protocol, two one-way pipes (multiprocessing.Connection, pickled tuples):
- front end -> core: ("add", EngineRequest without its compiled grammar: the core compiles
  it again from the request, unsandboxed, since the front end's admission path compiled it
  in its sandbox), ("abort", request id), ("reset-prefix-cache",), ("call", call id,
  method, args): a utility call, one of UTILITY_CALLS on the engine (sleep mode, weight
  updates), answered by a "reply"; ("close",). A closed pipe (the front end is gone) stops
  the core too.
- core -> front end: ("ready", EngineConfig) or ("failed", exception) once at start-up;
  then ("step", ids, tokens, records, stats) after each step and ("stats", [], [], [],
  stats) when idle and commands or compiles changed something; ("reply", call id, True,
  result) or ("reply", call id, False, exception) for each call, in the order they came;
  ("dead", reason) before it exits on an engine failure. stats is (EngineStats, sequences
  added so far, HostTimes steps, HostTimes seconds, compile_stats.CompileRecords or None
  when they have not changed).

ids[k], tokens[k]: request ids[k] (of one choice) got the one token tokens[k] and goes on,
the common case, kept flat so that a step of hundreds of sequences pickles fast. A record
is (request id, choices, extra): choices lists (index, new token ids, finish
reason or None, stop_reason, cumulative logprob or None, new logprob entries or None) for
each choice with news since the last record; extra is None, or a dict with what a front end
learns once or rarely (num_cached_tokens, prompt_logprobs, the choices' scheduled times,
error and error_param; a finished pooling request's output array, "pooled").
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from jaxserve.engine.failures import EngineDeadError, describe
from jaxserve.engine.sleep_mode import EngineSleepingError, RequestsUnfinishedError

logger = logging.getLogger(__name__)

# The engine methods a "call" may run (interface.EngineInterface's), and the exceptions that
# cross back as they are (anything else: a RuntimeError saying what it was).
UTILITY_CALLS = ("sleep", "wake_up", "is_sleeping", "update_weights")
_PLAIN_ERRORS = (ValueError, RuntimeError, RequestsUnfinishedError, EngineSleepingError)

_IDLE_WAIT_S = 0.05  # how long an idle core waits for a command before it looks again
_COMPILE_POLL_S = 0.005  # how often one with only grammars compiling looks at them


def run_engine_core(commands, results, factory, args: tuple, log_level: str) -> None:
    """The core process's main: build the engine with factory(*args) (in this process:
    only it touches the accelerator), report ready (its EngineConfig) or failed, then
    step until the front end closes. Ctrl-C in a terminal reaches the whole process group:
    the front end decides when the core stops, so the core ignores it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck core's stacks, on demand
    from jaxserve.config import logs

    logs.configure(log_level)  # the front end's format (cli.main), through the environment
    # Progress bars (weight loading) lock their output with a thread lock here: tqdm's
    # default is a multiprocessing lock, a semaphore the exit below would leak.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    try:
        engine = factory(*args)
    except BaseException as err:  # noqa: BLE001 - reported to the front end, which raises it
        # A bad setting is a ValueError the front end raises as its own (the CLI prints it);
        # anything else is logged here and raised there as a RuntimeError. Plain built-in
        # exceptions, so that they always cross the pipe.
        if isinstance(err, ValueError):
            failure = ValueError(str(err))
        else:
            logger.error("The engine could not start", exc_info=err)
            failure = RuntimeError(f"the engine could not start: {describe(err)}")
        results.send(("failed", failure))
        return
    gc.collect()
    gc.freeze()  # start-up's objects (weights, compiled steps) live as long as the process
    results.send(("ready", engine.config))
    core = EngineCore(engine, commands, results)
    try:
        core.run()
    finally:
        compiling = engine.stats().compiling
        engine.close()
        if compiling:
            # An XLA compile cannot be interrupted, and a thread torn down inside one aborts
            # the interpreter: leave without waiting for it.
            logging.shutdown()
            os._exit(0)


class EngineCore:
    """Steps an engine (interface.EngineInterface with advance()) and sends each step's
    news to the front end, taking its commands between steps."""

    def __init__(self, engine, commands, results) -> None:
        self.engine = engine
        self.commands, self.results = commands, results
        self.grammars = engine.processor.grammars
        # Per request: output tokens already sent, per choice (None: its finish was sent).
        self._sent: dict[str, list[int | None]] = {}
        self._timed: set[str] = set()  # requests whose choices' scheduled times were sent
        # Of those, the ones of one choice without stop strings or logprobs, as in _sent:
        # their usual news is a token (see _news).
        self._plain: dict[str, list[int | None]] = {}
        self._may_be_plain: set[str] = set()  # such requests, until they are timed
        # Requests waiting for their grammars, compiled on a thread of their own (llguidance
        # releases the GIL while it compiles), and the requests behind them, in arrival
        # order, as (EngineRequest, Future of the grammar or None). A request leaves when it
        # is added (in order) or aborted.
        self._compiling: dict[str, tuple] = {}
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="jaxserve-core-grammar")
        self._added = 0  # sequences added to the engine so far (the front end's acks)
        self._compile_records = None  # the last compile records sent
        self._idle_key = None  # what the last stats sent while idle said about compiles

    def run(self) -> None:
        engine = self.engine
        while True:
            wait = 0.0 if engine.has_unfinished_requests() else (
                _COMPILE_POLL_S if self._compiling else _IDLE_WAIT_S)
            took = self._take_commands(wait)
            if took is None:
                return  # the front end closed
            took += self._add_compiled()
            if engine.has_unfinished_requests():
                try:
                    self.step()
                except EngineDeadError as err:
                    self._send(("dead", str(err)))
                    return
                except Exception as err:
                    logger.exception("The engine core failed")
                    self._send(("dead", f"the engine core failed: {describe(err)}"))
                    return
            else:  # idle: the front end hears of commands taken and of warm-up progress
                stats = self.engine.stats()
                key = (stats.compilations, stats.compiling, stats.warm_up_done)
                if took or key != self._idle_key or \
                        self.engine.compile_records() != self._compile_records:
                    self._idle_key = key
                    self._send(("stats", [], [], [], self._stats()))

    def step(self) -> None:
        """One engine step, and its news sent (the time that takes counts in the engine's
        HostTimes as outputs: it is what the core does instead of building them)."""
        changed = self.engine.advance()
        start = time.perf_counter()
        self._send(("step", *self._news(changed), self._stats()))
        times = getattr(self.engine, "host_times", None)  # (an LLMEngine's)
        if times is not None:
            times.add("outputs", time.perf_counter() - start)

    def add(self, request) -> None:
        """Take an admitted request (as the "add" command does)."""
        self._handle(("add", request))
        self._add_compiled()

    # ---- commands -----------------------------------------------------------------------
    def _take_commands(self, wait: float) -> int | None:
        """Handle the commands that came (waiting up to `wait` seconds for the first); how
        many, or None when the front end closed."""
        taken = 0
        try:
            if not self.commands.poll(wait):
                return 0
            while True:
                message = self.commands.recv()
                taken += 1
                if not self._handle(message):
                    return None
                if not self.commands.poll(0):
                    return taken
        except (EOFError, OSError):
            return None

    def _handle(self, message) -> bool:
        kind = message[0]
        if kind == "add":
            request = message[1]
            if request.params.structured_outputs is None and not self._compiling:
                self._add(request)
            else:  # in arrival order, behind the grammars compiling
                future = None
                if request.params.structured_outputs is not None:
                    future = self._compiler.submit(self.grammars.compile_checked,
                                                   request.params.structured_outputs)
                self._compiling[request.request_id] = (request, future)
        elif kind == "abort":
            request_id = message[1]
            if self._compiling.pop(request_id, None) is None:
                self.engine.abort_request(request_id, report=False)
                self._forget(request_id)
        elif kind == "reset-prefix-cache":
            self.engine.reset_prefix_cache()
        elif kind == "call":
            self._send(("reply", message[1], *self._call(message[2], message[3])))
        elif kind == "close":
            return False
        else:
            raise ValueError(f"unknown engine core command {kind!r}")
        return True

    def _call(self, method: str, args: tuple) -> tuple[bool, object]:
        """(True, result) of a utility call, or (False, the exception it raised, as one
        that crosses the pipe)."""
        try:
            if method not in UTILITY_CALLS:
                raise ValueError(f"unknown engine core call {method!r}")
            return True, getattr(self.engine, method)(*args)
        except Exception as err:  # noqa: BLE001 - the caller's to raise
            if type(err) in _PLAIN_ERRORS:
                return False, type(err)(str(err))
            if isinstance(err, ValueError):
                return False, ValueError(str(err))
            logger.error("The engine core's %s call failed", method, exc_info=err)
            return False, RuntimeError(f"{method} failed in the engine core: {describe(err)}")

    def _add_compiled(self) -> int:
        """Add the requests at the head of _compiling whose grammars are compiled, in
        arrival order (a slow grammar holds back those after it, as in one queue); how
        many."""
        added = 0
        while self._compiling:
            request_id, (request, future) = next(iter(self._compiling.items()))
            if future is not None and not future.done():
                break
            del self._compiling[request_id]
            added += 1
            if future is None:
                self._add(request)
                continue
            err = future.exception()
            if err is not None:
                self._send_failure(request, err)
            else:
                self._add(request.with_grammar(future.result()))
        return added

    def _add(self, request) -> None:
        try:
            self.engine.add_processed(request)
        except Exception as err:  # noqa: BLE001 - this request only
            self._send_failure(request, err)
            return
        params = request.params
        self._sent[request.request_id] = [0] * params.n
        if params.n == 1 and not params.stop and params.logprobs is None:
            self._may_be_plain.add(request.request_id)
        self._added += request.params.n

    def _send_failure(self, request, err: Exception) -> None:
        """A request the engine could not take: its front end reports it failed."""
        logger.error("Request %s could not be added: %s", request.request_id, describe(err))
        n = request.params.n
        param = "structured_outputs" if request.params.structured_outputs is not None \
            and isinstance(err, ValueError) else None
        error = (f"{param}: {str(err)[:300]}" if param else
                 f"the engine failed on this request while adding it ({type(err).__name__})")
        self._added += n  # (acknowledged: it is not waiting)
        self._send(("step", [], [], [(request.request_id,
                                      [(i, [], "error", None, None, None) for i in range(n)],
                                      {"error": error, "error_param": param})], self._stats()))

    def _forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)
        self._timed.discard(request_id)
        self._plain.pop(request_id, None)
        self._may_be_plain.discard(request_id)

    # ---- news -------------------------------------------------------------------------
    def _news(self, changed) -> tuple[list[str], list[int], list]:
        """A step's news: (ids, tokens, records). The common case, a request of one choice
        that got one token and goes on (no stop strings, logprobs or first news), is the
        pair ids[k], tokens[k]; every other change is a record (see the module's
        docstring)."""
        ids, tokens, records = [], [], []
        sent_by_id, plain = self._sent, self._plain
        for tracked in changed:
            request_id = tracked.request_id
            sent = plain.get(request_id)
            if sent is not None:
                child = tracked.children[0]
                have = sent[0]
                if not child.finished and child.num_tokens - child.num_prompt_tokens == have + 1:
                    ids.append(request_id)
                    tokens.append(child.output_view.item(have))
                    sent[0] = have + 1
                    continue
            else:
                sent = sent_by_id.get(request_id)
                if sent is None:
                    continue  # (aborted meanwhile)
            records.append(self._record(tracked, sent))
            if tracked.finished:
                self._forget(request_id)
        return ids, tokens, records

    def _record(self, tracked, sent: list) -> tuple:
        choices = []
        for i, child in enumerate(tracked.children):
            have = sent[i]
            if have is None:
                continue  # its finish was sent
            count = child.num_tokens - child.num_prompt_tokens
            finished = child.finished
            if count == have and not finished:
                continue
            tokens = child.output_view[have:count].tolist()
            logprobs = cumulative = None
            if child.params.logprobs is not None:
                logprobs = tracked.logprobs[i][have:count]
                cumulative = child.cumulative_logprob
            choices.append((i, tokens, child.status.value if finished else None,
                            child.stop_reason, cumulative, logprobs))
            sent[i] = None if finished else count
        extra = None
        if tracked.request_id not in self._timed or tracked.error is not None or \
                tracked.pooled is not None:
            extra = self._extra(tracked)
        return tracked.request_id, choices, extra

    def _extra(self, tracked) -> dict:
        """What a front end learns once (kept until every choice has been scheduled)."""
        times = [c.scheduled_time for c in tracked.children]
        if all(t is not None for t in times):
            request_id = tracked.request_id
            self._timed.add(request_id)
            if request_id in self._may_be_plain:
                self._plain[request_id] = self._sent[request_id]
        extra = {"scheduled": times,
                 "num_cached_tokens": tracked.children[0].num_cached_tokens,
                 "prompt_logprobs": tracked.prompt_logprobs}
        if tracked.error is not None:
            extra["error"], extra["error_param"] = tracked.error, tracked.error_param
        if tracked.pooled is not None:
            extra["pooled"] = tracked.pooled
        return extra

    def _stats(self) -> tuple:
        times = getattr(self.engine, "host_times", None)
        stats = self.engine.stats()
        records = self.engine.compile_records()  # this process's, sent when they change
        if records == self._compile_records:
            records = None
        else:
            self._compile_records = records
        return (stats, self._added, times.steps if times else 0,
                dict(times.seconds) if times else {}, records)

    def _send(self, message) -> None:
        try:
            self.results.send(message)
        except (BrokenPipeError, OSError):
            pass  # the front end is gone; the next command poll sees it
