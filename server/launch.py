"""`jaxserve serve`: build the engine, start its loop, run uvicorn (and the gRPC server, with
--grpc-port, on the same event loop), drain on SIGTERM.

SIGTERM (or Ctrl-C) stops admission (new HTTP requests get 503, new gRPC calls UNAVAILABLE,
gRPC health turns NOT_SERVING), lets in-flight requests of both, and those still being
prepared, finish for up to --shutdown-timeout seconds, ends the rest with finish_reason
"abort", then exits 0.

If the engine loop dies (an engine core process gone, a device lost; not its own stop, nor
sleep mode), the requests in flight get their error (HTTP 503 engine_dead, an error event in
a stream, gRPC UNAVAILABLE), and the server shuts down and exits ENGINE_DEAD_EXIT_CODE, so
that its supervisor restarts it (as vLLM's server exits once its engine is dead) instead of
a process that answers 503 forever.

Connections are bounded: --limit-concurrency (uvicorn's: connections and requests at once;
beyond it uvicorn answers 503), and a response whose client stops reading is cut once the
connection's send buffer has stayed full for --stream-write-timeout seconds (the request is
aborted, its blocks freed), so a stalled reader holds at most a socket buffer of memory.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxserve.config import logs
from jaxserve.server.app import ServerConfig, create_app
from jaxserve.server.async_engine import AsyncLLMEngine
from jaxserve.server.metrics import EngineMetrics

logger = logging.getLogger(__name__)

_FLUSH_S = 2.0  # after aborting, time for the last chunks to reach clients
_WATCH_S = 0.1  # how often the server looks whether the engine loop has died
ENGINE_DEAD_EXIT_CODE = 1  # `jaxserve serve`'s exit status once its engine has died


def _timed_protocol(header_timeout: float, write_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request's headers (uvicorn bounds
    idle keep-alive connections but not a client that connects and then sends its headers
    slowly or never: slowloris; the body has its own deadline in the app), and one for a
    client to take what was sent: once the transport's buffer is full (asyncio pauses
    writing) and stays so for write_timeout seconds, the connection is dropped. uvicorn then
    reports the disconnect to the app, which aborts the request."""

    class TimedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._write_timer = self.loop.call_later(write_timeout, self._write_late)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def _write_late(self) -> None:
            self._write_timer = None
            if not self.transport.is_closing():
                logger.info("Closing a connection whose client has not read its response for "
                            "%g s (--stream-write-timeout); its request is aborted",
                            write_timeout)
                self.transport.abort()  # drops what is buffered; connection_lost follows

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._watch_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_headers()

        def connection_lost(self, exc) -> None:
            self._stop_watch()
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None
            super().connection_lost(exc)

        def _watch_headers(self) -> None:
            """Runs from the first byte of a request until its headers are complete."""
            waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
            if not waiting:
                self._stop_watch()
            elif self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _stop_watch(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                logger.info("Closing a connection whose request headers did not arrive within "
                            "%g s", header_timeout)
                self.transport.close()

    return TimedH11Protocol


def uvicorn_config(app, server_config: ServerConfig) -> uvicorn.Config:
    """How `jaxserve serve` runs uvicorn (the serving benchmarks run it the same way).

    The event loop is asyncio's own, never uvloop (which uvicorn's "auto" picks whenever it
    is installed, as orbax's dependencies install it): the HTTP side and the engine thread
    share the GIL, and under uvloop the event loop keeps it from the engine thread far
    longer. Measured with scripts/bench_async_scheduling.py's server case (a 5 ms stand-in
    device step, 256 streaming clients): about 0.25 of the ideal steps/s under uvloop, 0.7
    under asyncio (64 clients: 0.7 and 0.9).

    uvicorn's own logging configuration is left out (log_config=None): its lines go through
    the root logger in jaxserve's format (logs.py), at --uvicorn-log-level."""
    c = server_config
    logs.configure_uvicorn(c.uvicorn_log_level, c.access_log, c.access_log_quiet_paths,
                           c.root_path)
    h11 = ({} if c.h11_max_incomplete_event_size is None
           else {"h11_max_incomplete_event_size": c.h11_max_incomplete_event_size})
    return uvicorn.Config(app, host=c.host, port=c.port, log_config=None,
                          log_level=c.uvicorn_log_level, access_log=c.access_log,
                          loop="asyncio",
                          http=_timed_protocol(c.request_read_timeout, c.stream_write_timeout),
                          timeout_keep_alive=c.keep_alive_timeout,
                          limit_concurrency=c.limit_concurrency, timeout_graceful_shutdown=5,
                          root_path=c.root_path, ssl_keyfile=c.ssl_keyfile,
                          ssl_certfile=c.ssl_certfile, ssl_ca_certs=c.ssl_ca_certs,
                          ssl_cert_reqs=c.ssl_cert_reqs, **h11)


class _DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains instead of cutting connections."""

    def __init__(self, config: uvicorn.Config, state, engine: AsyncLLMEngine,
                 timeout: float, grpc_config=None) -> None:
        super().__init__(config)
        self.state, self.engine, self.timeout = state, engine, timeout
        self.grpc_config = grpc_config
        self.grpc = None  # the GrpcServer, once serving
        self._draining_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine_died = False  # the engine loop died: serve() exits ENGINE_DEAD_EXIT_CODE

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        watcher = self._loop.create_task(self._watch_engine())
        if self.grpc_config is not None:
            from jaxserve.server.grpc.server import GrpcServer

            self.grpc = GrpcServer(self.state, self.grpc_config)
            await self.grpc.start()
        try:
            await super().serve(sockets)
        finally:
            watcher.cancel()
            if self.grpc is not None:
                await self.grpc.stop(grace=1.0)

    async def _watch_engine(self) -> None:
        """Stop serving once the engine loop has died (AsyncLLMEngine.error: never set by
        its own stop, nor by sleep mode). Its requests in flight already have their error;
        uvicorn's shutdown lets their responses finish, then serve() returns."""
        while not self.should_exit:
            if self.engine.error is not None:
                logger.critical("The engine is dead (%s): shutting the server down, exit "
                                "status %d, for its supervisor to restart it",
                                self.engine.dead_reason, ENGINE_DEAD_EXIT_CODE)
                self.engine_died = True
                self.should_exit = True
                return
            await asyncio.sleep(_WATCH_S)

    def handle_exit(self, sig, frame) -> None:
        if self._draining_task is not None or self._loop is None:
            return super().handle_exit(sig, frame)  # second signal: stop now
        logger.info("Received signal %s: draining (up to %.0f s)", sig, self.timeout)
        self.state.draining = True
        self._draining_task = self._loop.create_task(self._drain(sig, frame))

    async def _drain(self, sig, frame) -> None:
        if self.grpc is not None:
            await self.grpc.drain()
        deadline = time.monotonic() + self.timeout
        while (self.engine.num_in_flight or self.state.num_preparing) and \
                time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.engine.num_in_flight:
            logger.info("Shutdown timeout: aborting %d requests", self.engine.num_in_flight)
            self.engine.abort_all()
            flush = time.monotonic() + _FLUSH_S
            while self.engine.num_in_flight and time.monotonic() < flush:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # let the last responses leave
        # Not super().handle_exit: uvicorn would re-raise the captured SIGTERM on the way out
        # and the process would die by the signal instead of exiting 0.
        self.should_exit = True


def serve(engine, server_config: ServerConfig, grpc_config=None) -> int:
    """Serve `engine` (an engine.interface.EngineInterface: engine/core_client.py's
    EngineCoreClient, or an engine in this process) until a signal stops the server (then
    0) or the engine dies (then ENGINE_DEAD_EXIT_CODE), then close it; the process's exit
    status. grpc_config: a server/grpc/server.py's GrpcConfig to serve gRPC beside HTTP, or None."""
    # What start-up made (weights, tokenizer, compiled steps) lives as long as the server:
    # kept out of the collector's full passes, which would walk it again every few hundred
    # steps on the engine thread (vLLM freezes its heap after start-up the same way).
    gc.collect()
    gc.freeze()
    metrics = EngineMetrics(server_config.served_names[0],
                            warm_up_done=lambda: async_engine.warm_up_done,
                            max_model_len=engine.config.model.max_model_len,
                            num_speculative_tokens=(
                                engine.config.speculative.num_speculative_tokens
                                if engine.config.speculative else 0),
                            compile_records=engine.compile_records,
                            lora_stats=(lambda: async_engine.stats) if engine.config.lora
                            else None)
    options = server_config.responses
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=server_config.max_waiting_requests,
                                  metrics=metrics, log_requests=options.log_requests,
                                  log_outputs=options.log_outputs,
                                  log_stats=server_config.log_stats,
                                  max_log_len=options.max_log_len)
    _warn_unservable_limits(engine.config, server_config)
    async_engine.start()
    app = create_app(async_engine, server_config)
    config = uvicorn_config(app, server_config)
    server = _DrainingServer(config, app.state.jaxserve, async_engine,
                             server_config.shutdown_timeout, grpc_config)
    logger.info("Serving %s on %s", ", ".join(server_config.served_names), server_config.url)
    try:
        server.run()
    finally:
        async_engine.stop()
        engine.close()  # cancel the warm-up's pending compiles; release worker hosts
    status = ENGINE_DEAD_EXIT_CODE if server.engine_died else 0
    if engine.compiling:
        # An XLA compile cannot be interrupted, and a thread torn down inside one aborts the
        # interpreter: leave without waiting for it (the responses and logs are done).
        logger.info("Exiting while %d functions still compile.", engine.compiling)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _warn_unservable_limits(config, server_config: ServerConfig) -> None:
    """A pooling request may hold more inputs (max_embedding_inputs) than may wait at once
    (--max-waiting-requests): those requests are refused with a 400 (async_engine.py)."""
    inputs, cap = config.limits.max_embedding_inputs, server_config.max_waiting_requests
    if config.pooler is not None and inputs > cap:
        logger.warning("Request limit max_embedding_inputs (%d) is above "
                       "--max-waiting-requests (%d): a pooling request with more than %d "
                       "inputs is refused (400); raise --max-waiting-requests to serve them, "
                       "or lower max_embedding_inputs (--request-limits).", inputs, cap, cap)
