"""The runner's compiled functions: built once each, on demand or by a warm-up.

Keys are ("step", T, R) for the step of bucket (T, R), ("score", T) for prompt scoring and,
on a pooling engine, ("pool", T, R) for the pooling function of bucket (T, R) (which is then
all a warm-up compiles beside the steps: pooling requests never score, bias or constrain).
A function is built (loaded from the executable cache, or traced, lowered and compiled) by
whichever thread asks first; a thread asking while another builds it waits for that build.
A warm-up builds every function on a pool of compile threads (XLA compiles in parallel and
releases the GIL), with progress; a background warm-up builds the first bucket now and the
rest in a thread, and until it is done step_limits / pick_bucket keep steps to compiled
buckets.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable

from jaxserve.config.engine_config import SchedulerConfig
from jaxserve.config.progress import progress

logger = logging.getLogger(__name__)

# Functions compiled at once by a warm-up: XLA compiles in parallel and releases the GIL,
# so half the host's cores (at most 8) shorten a warm-up without starving the engine.
COMPILE_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))


class CompiledFunctions:
    def __init__(self, build: Callable[[tuple], object], buckets: SchedulerConfig,
                 cache=None, pooling: bool = False, extra: tuple[str, ...] = ()) -> None:
        """build(key) -> a compiled function; buckets: the step buckets to warm up; cache:
        the executable cache (its hits are logged); pooling: the engine pools (its warm-up
        compiles each bucket's step and pooling function); extra: the names of functions
        without a bucket a warm-up builds too (("lora",): writing an adapter's slot)."""
        self._build = build
        self.extra = extra
        self.pooling = pooling
        self.buckets = buckets
        self.cache = cache
        self._lock = threading.Lock()
        self._functions: dict[tuple, object] = {}  # key -> compiled
        self._pending: dict[tuple, concurrent.futures.Future] = {}  # being built
        self._warming: threading.Thread | None = None
        self._warm_up_total = 0
        self._warm_up_failed = False
        self._closed = False
        self._pools: list[concurrent.futures.ThreadPoolExecutor] = []
        self._closed_pools: list[concurrent.futures.ThreadPoolExecutor] = []  # join() waits

    def ready(self) -> set[tuple]:
        """The keys built so far."""
        with self._lock:
            return set(self._functions)

    def close(self) -> None:
        """Skip the builds not started yet (one already compiling runs to its end: see
        compiling); the warm-up's threads end after it."""
        self._closed = True
        with self._lock:
            pools = list(self._pools)
            self._closed_pools = pools
        for pool in pools:
            # (not cancel_futures: a future cancelled there never wakes as_completed, and
            # the warm-up thread would wait in _compile_all for ever)
            pool.shutdown(wait=False)

    def join(self) -> None:
        """After close(): wait until the warm-up thread and the compile threads have ended
        (a compile in progress runs to its end), so that nothing holds the runner."""
        if self._warming is not None:
            self._warming.join()
        for pool in self._closed_pools:
            pool.shutdown(wait=True)

    def get(self, key: tuple):
        """The compiled function for key, built by whichever thread asks first; a thread
        asking while another builds it waits for that build."""
        with self._lock:
            ready = self._functions.get(key)
            if ready is not None:
                return ready
            pending = self._pending.get(key)
            owner = pending is None
            if owner:
                pending = self._pending[key] = concurrent.futures.Future()
        if not owner:
            return pending.result()
        try:
            compiled = self._build(key)
        except BaseException as error:
            with self._lock:
                del self._pending[key]
            pending.set_exception(error)
            raise
        with self._lock:
            self._functions[key] = compiled
            del self._pending[key]
        pending.set_result(compiled)
        return compiled

    def keys(self) -> list[tuple]:
        """Every function a warm-up builds, in its order."""
        return self._warm_up_order()

    def _warm_up_order(self) -> list[tuple]:
        """Every function to compile, the first one alone able to serve: the smallest T with
        its largest R, then the decode buckets of a few sequences, then by T."""
        pairs = list(self.buckets.step_buckets)
        first = max((p for p in pairs if p[0] == pairs[0][0]), key=lambda p: p[1])
        if self.pooling:
            rest = [p for p in pairs if p != first]
            return [(kind, *p) for p in [first] + rest for kind in ("step", "pool")]
        order = [("step", *first)]
        for t, r in pairs:
            if (t, r) != first:
                order.append(("step", t, r))
            if t == pairs[0][0] and r == 1:
                order.append(("score", t))
        order += [("score", t) for t in self.buckets.token_buckets
                  if ("score", t) not in order]
        return order + [("bias",), ("grammar",)] + [(name,) for name in self.extra]

    def warm_up(self, background: bool = False) -> None:
        """Compile (or load) every (T, R) step bucket and the prompt-scoring function per T,
        with progress, in a pool of compile threads (XLA compiles in parallel). background:
        compile the first bucket (it alone can run any step of the smallest size, see
        step_limits) now and the rest in a thread; steps meanwhile use only compiled
        buckets, and warm_up_done says when all are."""
        order = self._warm_up_order()
        self._warm_up_total = len(order)
        start = time.perf_counter()
        if background:
            logger.info("Warm-up: compiling step bucket (T, R) = %s first; the other %d "
                        "functions compile in the background while requests are served.",
                        order[0][1:], len(order) - 1)
            self.get(order[0])
            self._warming = threading.Thread(target=self._warm_up_rest,
                                             args=(order[1:], start), daemon=True,
                                             name="jaxserve-warm-up")
            self._warming.start()
            return
        with progress(total=len(order), desc="Compiling buckets", unit="bucket") as bar:
            self._compile_all(order, bar.update)
        self._log_warm_up(start)

    def _compile_all(self, keys: list[tuple], done: Callable[[int], object]) -> None:
        """Build every key, in order, on COMPILE_THREADS threads; done(1) after each. close()
        skips the builds not started yet."""
        pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS,
                                                     thread_name_prefix="jaxserve-compile")
        with self._lock:
            self._pools.append(pool)
        try:
            futures = [pool.submit(self._get_unless_closed, key) for key in keys]
            for future in concurrent.futures.as_completed(futures):
                future.result()
                done(1)
        finally:
            pool.shutdown(wait=not self._closed, cancel_futures=True)
            with self._lock:
                self._pools.remove(pool)

    def _get_unless_closed(self, key: tuple) -> None:
        if not self._closed:
            self.get(key)

    def _warm_up_rest(self, order: list[tuple], start: float) -> None:
        try:
            self._compile_all(order, lambda _: None)
        except Exception:  # a step that needs it compiles it again and reports the error
            logger.exception("Background warm-up stopped; buckets compile on first use.")
            self._warm_up_failed = True
            return
        if not self._closed:
            self._log_warm_up(start)

    @property
    def compiling(self) -> int:
        """Functions being compiled right now (a background warm-up's, or a step's)."""
        with self._lock:
            return len(self._pending)

    def _log_warm_up(self, start: float) -> None:
        cache = self.cache
        loaded = f"; {cache.hits} loaded from the executable cache" if cache else ""
        logger.info("Warm-up finished: %d functions ready in %.1f s%s (step buckets (T, R): "
                    "%s).", self._warm_up_total, time.perf_counter() - start, loaded,
                    list(self.buckets.step_buckets))

    @property
    def warm_up_done(self) -> bool:
        """Whether every bucket is compiled (always true without a background warm-up)."""
        with self._lock:
            return len(self._functions) >= self._warm_up_total or self._warm_up_failed

    def step_limits(self) -> tuple[int, int] | None:
        """(tokens, sequences) a step may hold so that a compiled bucket holds it, while a
        background warm-up runs; None when any step may run (warm-up done, or none)."""
        if self._warming is None or self.warm_up_done:
            return None
        with self._lock:
            ready = [k[1:] for k in self._functions if k[0] == "step"]
        return max(t for t, _ in ready), max(r for t, r in ready if t == max(ready)[0])

    def pick_bucket(self, num_tokens: int, num_rows: int) -> tuple[int, int]:
        """The smallest bucket that holds the step; while a background warm-up runs, the
        smallest compiled one (step_limits guarantees there is one). Otherwise an
        uncompiled bucket compiles now, on first use: a bigger compiled one would cost
        every later step of that size its padding."""
        if self.step_limits() is not None:
            with self._lock:
                for t, r in self.buckets.step_buckets:
                    if t >= num_tokens and r >= num_rows and ("step", t, r) in self._functions:
                        return t, r
        return self.buckets.pick_bucket(num_tokens, num_rows)
