"""Grammars are tried first in a separate process, where a crash or a runaway cannot reach
the serving process.

llguidance is native code: a constraint that slips past the structural caps
(grammar_checks.py) could still overflow its stack (the process dies with no log line) or
spend seconds building its lexer. So every new grammar is compiled, its first next-token
mask computed (which builds the lexer), and a few tokens walked through it (the lowest
allowed one at each step: a grammar whose lexer blows up at its first tokens fails here, not
in a request), in a worker process (`python -m
jaxserve.core.grammar_sandbox`, started lazily, never forked from the engine) under a wall-clock
limit. Only a grammar that compiled there in time is compiled in the serving process; the
verdict names what went wrong otherwise (an error, a crash, a timeout), and the worker is
restarted after a crash or a timeout. The worker compiles on a thread with a smaller stack
than any of the server's threads, so a grammar that fits in the worker fits in the server.

Protocol, one JSON object per line: the parent first sends {"tokenizer": tokenizer.json's
text, "vocab_size", "eos_token_ids"} (the worker answers {"ready": true}), then
{"grammar": text} for each grammar (the worker answers {"error": null | text}). The worker
imports nothing but llguidance and numpy.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import select
import subprocess
import sys
import threading
import time

logger = logging.getLogger(__name__)

_WORKER_STACK_BYTES = 1 << 20  # the worker's compile thread: below any thread of the server
_START_TIMEOUT_S = 120.0  # building llguidance's tokenizer takes about a second
_WALK_STEPS = 8  # tokens walked through a new grammar after its first mask
PARSER_LIMITS = dict(  # llguidance's fuel: the same in the worker and in the server
    max_items_in_row=2000, initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
    step_max_items=50_000, max_lexer_states=250_000, max_grammar_size=500_000,
    precompute_large_lexemes=True, verbose_errors=False)


class SandboxTimeout(Exception):
    pass


class _Worker:
    """One worker process and its pipes (used by one thread at a time)."""

    def __init__(self, setup: bytes) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jaxserve.core.grammar_sandbox"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._buffer = b""
        self.ready = False
        try:
            self.process.stdin.write(setup)
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died at once: the first request reports it

    def request(self, grammar: str, timeout: float) -> str | None:
        """The worker's verdict on one grammar. SandboxTimeout past `timeout`; EOFError when
        the worker died (crashed on it)."""
        deadline = time.monotonic() + timeout
        if not self.ready:
            line = self._read_line(time.monotonic() + _START_TIMEOUT_S)
            if line.get("ready") is not True:
                raise EOFError("the grammar worker did not start")
            self.ready = True
            deadline = time.monotonic() + timeout
        try:
            self.process.stdin.write(json.dumps({"grammar": grammar}).encode() + b"\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            raise EOFError("the grammar worker has exited") from None
        return self._read_line(deadline).get("error")

    def _read_line(self, deadline: float) -> dict:
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SandboxTimeout()
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError("the grammar worker exited")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def exit_description(self) -> str:
        code = self.process.wait(5)
        return f"signal {-code}" if code < 0 else f"exit status {code}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class GrammarSandbox:
    """A small pool of worker processes that try grammars. Thread-safe: each call takes an
    idle worker (waiting for one when all are busy)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, *, workers: int = 2) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("structured outputs need a fast (tokenizer.json) tokenizer")
        self._setup = json.dumps({"tokenizer": backend.to_str(), "vocab_size": vocab_size,
                                  "eos_token_ids": sorted(eos_token_ids)}).encode() + b"\n"
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        for _ in range(workers):
            self._idle.put(None)  # a slot: a worker is started when first needed
        self._closed = False

    def check(self, grammar: str, timeout: float) -> str | None:
        """None when the grammar compiles and gives its first mask within `timeout` seconds
        in a worker; otherwise what went wrong, in words."""
        worker = self._idle.get()
        try:
            if worker is None or worker.process.poll() is not None:
                worker = self._start()
            started = time.monotonic()
            try:
                return worker.request(grammar, timeout)
            except SandboxTimeout:
                logger.info("A grammar took longer than %g s to compile; restarting the grammar "
                            "worker", timeout)
                self._drop(worker)
                worker = None
                return (f"compiling it took longer than {timeout:g} s (request limit "
                        "grammar_compile_timeout)")
            except EOFError:
                how = worker.exit_description()
                logger.warning("The grammar worker died (%s) on a grammar after %.1f s; it is "
                               "restarted, and the request refused", how,
                               time.monotonic() - started)
                self._drop(worker)
                worker = None
                return f"the grammar compiler crashed on it ({how})"
        finally:
            self._idle.put(worker)

    def _start(self) -> _Worker:
        if self._closed:
            raise RuntimeError("the grammar sandbox is closed")
        worker = _Worker(self._setup)
        with self._lock:
            self._workers.append(worker)
        return worker

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.kill()


# ---- the worker process ----------------------------------------------------------------------
def _serve() -> None:
    import llguidance
    import llguidance.numpy as llnp
    import numpy as np

    setup = json.loads(sys.stdin.buffer.readline())
    vocab_size = setup["vocab_size"]
    ll_tokenizer = llguidance.LLTokenizer(setup.pop("tokenizer"), n_vocab=vocab_size,
                                          eos_token=setup["eos_token_ids"] or None)
    limits = llguidance.LLParserLimits(**PARSER_LIMITS)
    mask = np.zeros((1, (vocab_size + 31) // 32), np.int32)
    out = sys.stdout.buffer

    eos = set(setup["eos_token_ids"])

    def verdict(grammar: str) -> str | None:
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0, limits=limits)
        for _ in range(_WALK_STEPS + 1):
            if matcher.is_error() or matcher.is_stopped():
                break
            llnp.fill_next_token_bitmask(matcher, mask, 0)
            token = _first_allowed(mask[0], eos)
            if matcher.is_error() or token is None:
                break
            matcher.consume_token(token)
        return matcher.get_error() if matcher.is_error() else None

    out.write(b'{"ready": true}\n')
    out.flush()
    threading.stack_size(_WORKER_STACK_BYTES)
    def answer(grammar: str, into: dict) -> None:
        into["error"] = verdict(grammar)

    for line in sys.stdin.buffer:
        result: dict = {}
        thread = threading.Thread(target=answer, args=(json.loads(line)["grammar"], result))
        thread.start()
        thread.join()
        out.write(json.dumps({"error": result.get("error", "the compiler raised")}).encode()
                  + b"\n")
        out.flush()


def _first_allowed(row, excluded: set[int]) -> int | None:
    """The lowest token id a bitmask row (i32[W]) allows, other than `excluded` ones."""
    import numpy as np

    words = row.view(np.uint32)
    for word in np.flatnonzero(words):
        bits = int(words[word])
        while bits:
            low = bits & -bits
            token = int(word) * 32 + low.bit_length() - 1
            if token not in excluded:
                return token
            bits ^= low
    return None


if __name__ == "__main__":
    _serve()
