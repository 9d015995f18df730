"""The FastAPI application: routes, auth, bounded body reading, draining, error envelopes.

Built by create_app() around a started AsyncLLMEngine; `jaxserve serve` runs it with uvicorn.
Request bodies are read in full (up to max_body_bytes, within request_read_timeout) before a
route runs; the admission path (parsing, limits, templates, tokenization) then runs on the
prepare threads and grammar compiles on threads of their own, and large responses are
encoded on the encoding threads, so neither a slow client nor a large request stalls the
event loop that every other client shares. At most max_preparing_requests requests are
being prepared at once: beyond that a request gets 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from jaxserve.config.version import VERSION
from jaxserve.server.async_engine import AsyncLLMEngine
from jaxserve.server.dev_routes import dev_routes
from jaxserve.server.errors import APIError, from_validation_error
from jaxserve.server.lora_models import LoraModels, LoraSettings, lora_routes
from jaxserve.server.openai.options import ChatSettings, ResponseOptions
from jaxserve.server.openai.routes import completion_routes, tokenize_routes
from jaxserve.server.openai.serving import OpenAIServing
from jaxserve.server.pooling.routes import pooling_routes
from jaxserve.server.pooling.serving import PoolingServing
from jaxserve.server.responses.routes import responses_routes
from jaxserve.server.responses.serving import OpenAIResponses
from jaxserve.server.responses.store import ResponseStore
from jaxserve.server.routing import REQUEST_ID_KEY

logger = logging.getLogger(__name__)

_OPEN_PATHS = ("/health", "/ready", "/version")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # One name or several (aliases; the first is the main one, in metrics and logs).
    served_model_name: str | tuple[str, ...] = "model"
    # One key or several; a request needs "Authorization: Bearer <one of them>".
    api_key: str | tuple[str, ...] | None = None
    metrics_require_auth: bool = False
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    max_waiting_requests: int = 4096  # above max_embedding_inputs (2,048)
    shutdown_timeout: float = 30.0
    # A request's headers, then its body, must each arrive within this many seconds.
    request_read_timeout: float = 30.0
    keep_alive_timeout: float = 5.0  # an idle keep-alive connection is closed after this
    # A response whose client has not read what was sent for this many seconds is cut (its
    # request aborted, its blocks freed).
    stream_write_timeout: float = 60.0
    # Connections and requests at once (uvicorn's limit_concurrency; gRPC calls too);
    # beyond it, 503.
    limit_concurrency: int | None = None
    max_preparing_requests: int = 256  # requests being parsed / tokenized / compiled at once
    # /v1/responses kept for GET and previous_response_id (the least recently used evicted)
    max_stored_responses: int = 1024
    max_stored_response_bytes: int = 256 * 2**20  # ... and their size (server/responses/store.py)
    chat: ChatSettings = dataclasses.field(default_factory=ChatSettings)
    responses: ResponseOptions = dataclasses.field(default_factory=ResponseOptions)
    # Behind a proxy that routes a path prefix here and strips it (--root-path): the prefix.
    root_path: str = ""
    # HTTPS (--ssl-keyfile, --ssl-certfile; --ssl-ca-certs and --ssl-cert-reqs 2 for clients
    # with certificates), as uvicorn takes them.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    cors_credentials: bool = False  # --allow-credentials
    cors_methods: tuple[str, ...] = ("*",)  # --allowed-methods
    cors_headers: tuple[str, ...] = ("*",)  # --allowed-headers
    openapi: bool = True  # /openapi.json (--disable-fastapi-docs turns it off)
    request_id_headers: bool = False  # X-Request-Id on every response
    uvicorn_log_level: str = "info"
    access_log: bool = True  # uvicorn's line per HTTP request (--disable-uvicorn-access-log)
    access_log_quiet_paths: tuple[str, ...] = ()  # --disable-access-log-for-endpoints
    h11_max_incomplete_event_size: int | None = None  # bytes of headers (uvicorn's default)
    log_stats: bool = True  # the throughput line every few seconds (--disable-log-stats)
    # LoRA adapters by name (--lora-modules), runtime updates and their allowed folders
    lora: LoraSettings = dataclasses.field(default_factory=LoraSettings)

    @property
    def served_names(self) -> tuple[str, ...]:
        name = self.served_model_name
        return (name,) if isinstance(name, str) else tuple(name)

    @property
    def api_keys(self) -> tuple[str, ...]:
        key = self.api_key
        return () if not key else (key,) if isinstance(key, str) else tuple(k for k in key if k)

    def __post_init__(self) -> None:
        if not self.served_names or not all(self.served_names):
            raise ValueError("served_model_name needs at least one non-empty name.")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}.")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}.")
        for name in ("shutdown_timeout", "keep_alive_timeout"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
        for name in ("request_read_timeout", "stream_write_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}.")
        for name in ("limit_concurrency", "max_preparing_requests", "max_stored_responses",
                     "max_stored_response_bytes", "max_waiting_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}.")
        if self.root_path and (not self.root_path.startswith("/") or
                               self.root_path.endswith("/")):
            raise ValueError(f"root_path must start with '/' and not end with one, got "
                             f"{self.root_path!r} (e.g. /jaxserve).")
        if (self.ssl_keyfile or self.ssl_ca_certs or self.ssl_cert_reqs) and \
                not self.ssl_certfile:
            raise ValueError("--ssl-keyfile, --ssl-ca-certs and --ssl-cert-reqs configure "
                             "HTTPS: add --ssl-certfile (the certificate chain).")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"--{name.replace('_', '-')} {path}: no such file.")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"ssl_cert_reqs must be 0 (none), 1 (optional) or 2 (required), "
                             f"as Python's ssl.CERT_*, got {self.ssl_cert_reqs}.")
        if self.ssl_cert_reqs and not self.ssl_ca_certs:
            raise ValueError("--ssl-cert-reqs asks for client certificates: add "
                             "--ssl-ca-certs (the CAs that sign them).")

    @property
    def url(self) -> str:
        """Where clients reach the server (the prefix a proxy strips included)."""
        scheme = "https" if self.ssl_certfile else "http"
        return f"{scheme}://{self.host}:{self.port}{self.root_path}"


class ServerState:
    """What the routes share: the engine, the config, the thread pools, how many requests
    are being prepared, and whether the server is draining."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        threads = min(4, os.cpu_count() or 1)
        # Parsing, chat templates and tokenization (the tokenizer releases the GIL).
        self.workers = ThreadPoolExecutor(threads, thread_name_prefix="jaxserve-prepare")
        # Grammar compiles (each waits for the sandbox process): never the threads above.
        self.grammar_workers = ThreadPoolExecutor(2, thread_name_prefix="jaxserve-grammar")
        # Large responses to JSON / protobuf.
        self.encoders = ThreadPoolExecutor(2, thread_name_prefix="jaxserve-encode")
        self.serving = OpenAIServing(engine, config.served_names, config.chat,
                                     grammar_pool=self.grammar_workers, encoders=self.encoders,
                                     options=config.responses)
        self.serving.loras = LoraModels(engine.processor, config.served_names,
                                        config.lora)
        self.responses_api = OpenAIResponses(self.serving,
                                             ResponseStore(config.max_stored_responses,
                                                           config.max_stored_response_bytes))
        self.pooling = PoolingServing(self.serving)
        self.draining = False
        self.started = time.time()
        self.num_preparing = 0  # requests in the admission path (event-loop thread only)

    async def off_loop(self, fn, *args):
        """Run fn(*args) in a prepare thread and await its result."""
        return await asyncio.get_running_loop().run_in_executor(self.workers, fn, *args)

    @contextlib.asynccontextmanager
    async def preparing(self):
        """Count a request while it is prepared (SIGTERM's drain waits for it); a 503 with
        Retry-After when max_preparing_requests are already being prepared."""
        if self.num_preparing >= self.config.max_preparing_requests:
            raise APIError(503, f"{self.num_preparing} requests are being prepared (the cap "
                           f"is {self.config.max_preparing_requests}); retry later.",
                           code="overloaded", headers={"Retry-After": "1"})
        self.num_preparing += 1
        try:
            yield
        finally:
            self.num_preparing -= 1


def create_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="jaxserve", version=VERSION, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json" if config.openapi else None)
    state = ServerState(engine, config)
    app.state.jaxserve = state
    _install_errors(app)
    app.add_middleware(_Guard, state=state)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=list(config.cors_methods),
                           allow_headers=list(config.cors_headers),
                           allow_credentials=config.cors_credentials)
    _install_routes(app, state)
    return app


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError):
        return err.response(err.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError):
        return from_validation_error(err).response()

    @app.exception_handler(404)
    async def not_found(request: Request, _):
        return APIError(404, f"No route {request.url.path[:80]}.", code="not_found").response()

    @app.exception_handler(405)
    async def bad_method(request: Request, _):
        return APIError(405, f"Method {request.method} is not allowed here.",
                        code="method_not_allowed").response()

    @app.exception_handler(Exception)
    async def internal(_: Request, err: Exception):
        # Only for an error in the guard itself (the guard catches and logs every other):
        # uvicorn logs it once when Starlette re-raises it after this response.
        return APIError(500, "internal server error", code="internal_error").response()


class _Guard:
    """Pure ASGI middleware (so streaming and disconnect detection pass through untouched):
    a request id, API key, draining, and the bounded body read, before any route runs; and
    the one place an unhandled error is logged (once, with the request id) and answered."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state
        self.expected = [f"Bearer {key}".encode() for key in state.config.api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        config, path = self.state.config, _route_path(scope)
        request_id = uuid.uuid4().hex
        scope.setdefault("state", {})[REQUEST_ID_KEY] = request_id
        headers = dict(scope["headers"])
        if config.request_id_headers:
            send = _with_request_id(send, headers.get(b"x-request-id") or
                                    request_id.encode())
        open_path = path in _OPEN_PATHS or (path == "/metrics" and not config.metrics_require_auth)
        if self.expected and not open_path and scope["method"] != "OPTIONS":
            given = headers.get(b"authorization", b"")
            # Every key is compared (no early exit), so timing tells nothing about which.
            if not sum(hmac.compare_digest(given, key) for key in self.expected):
                error = APIError(401, "Missing or invalid API key: send 'Authorization: Bearer "
                                 "<key>'.", code="invalid_api_key")
                return await error.response()(scope, receive, send)
        if self.state.draining and path not in _OPEN_PATHS and path != "/metrics":
            error = APIError(503, "The server is shutting down.", code="draining")
            return await error.response()(scope, receive, send)
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = headers.get(b"content-length", b"0")
            if not length.isdigit() or int(length) > config.max_body_bytes:
                return await _too_large(config)(scope, receive, send)
            messages = await self._read_body(scope, receive, send, request_id)
            if messages is None:
                return  # answered (408, 413) or the client left
            return await self._run(scope, _replay(messages, receive), send, request_id)
        await self._run(scope, receive, send, request_id)

    async def _read_body(self, scope, receive, send, request_id: str) -> list | None:
        """The body's messages, read up to the size cap and within the read timeout; None
        once the request is answered or the client has gone."""
        config = self.state.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.request_read_timeout
        size, messages = 0, []
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                logger.info("Request %s: the body did not arrive within %g s; answering 408",
                            request_id, config.request_read_timeout)
                error = APIError(408, f"The request body did not arrive within "
                                 f"{config.request_read_timeout:g} s.", code="request_timeout")
                await error.response(headers={"Connection": "close"})(scope, receive, send)
                return None
            if message["type"] != "http.request":  # http.disconnect
                logger.debug("Request %s: the client left before sending its body", request_id)
                return None
            messages.append(message)
            size += len(message.get("body", b""))
            if size > config.max_body_bytes:
                await _too_large(config)(scope, receive, send)
                return None
            if not message.get("more_body", False):
                return messages

    async def _run(self, scope, receive, send, request_id: str) -> None:
        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as err:  # noqa: BLE001 - logged once here, answered with a 500
            logger.error("Unhandled error in %s %s (request %s)", scope["method"],
                         scope["path"][:80], request_id, exc_info=err)
            if not started:
                error = APIError(500, "internal server error", code="internal_error")
                await error.response()(scope, receive, send)
            else:  # end the response already under way (the client sees it cut short)
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": b"",
                                "more_body": False})


def _route_path(scope) -> str:
    """The path the routes see: without the prefix of --root-path (uvicorn puts root_path
    in front of the path, as the ASGI spec has it)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        return path[len(root):] or "/"
    return path


def _with_request_id(send, request_id: bytes):
    """send with an X-Request-Id header on the response (--enable-request-id-headers): the
    client's own, else the id the server gave the request."""

    async def send_with_id(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []),
                                              (b"x-request-id", request_id[:256])]}
        await send(message)

    return send_with_id


def _replay(messages: list, receive):
    """An ASGI receive that first hands out the body messages already read."""

    async def replay():
        return messages.pop(0) if messages else await receive()

    return replay


def _too_large(config: ServerConfig) -> JSONResponse:
    return APIError(413, f"The request body is larger than {config.max_body_bytes} bytes.",
                    code="body_too_large").response()


def _install_routes(app: FastAPI, state: ServerState) -> None:
    """The route table: one router per API, in this order (no two routes' paths overlap, so
    the order decides only how /openapi.json lists them). The guard (_Guard) runs before
    every one of them: API keys, draining, the body read."""
    routers = (completion_routes(state), responses_routes(state), pooling_routes(state),
               lora_routes(state), _model_routes(state), tokenize_routes(state),
               _health_routes(state),
               dev_routes(state))  # VLLM_SERVER_DEV_MODE=1: /sleep, /wake_up, ...
    for router in routers:
        if router is not None:  # (LoRA's and the dev routes exist only when turned on)
            app.include_router(router)


def _model_routes(state: ServerState) -> APIRouter:
    """/v1/models: the served names and the LoRA adapters, with what the model serves."""
    router = APIRouter()
    engine, config = state.engine, state.config

    @router.get("/v1/models")
    async def models():
        # tasks (a jaxserve extension): what the model serves, in vLLM's task names
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(state.started),
            "owned_by": "jaxserve", "root": engine.model_config.model,
            "max_model_len": engine.max_model_len, "tasks": state.pooling.tasks}
            for name in config.served_names] + state.serving.loras.cards(
                int(state.started), engine.max_model_len)}

    return router


def _health_routes(state: ServerState) -> APIRouter:
    """/health, /ready, /version and /metrics (the first three open without an API key; the
    last too unless --metrics-require-auth)."""
    router = APIRouter()
    engine = state.engine

    @router.get("/health")
    async def health():
        if not engine.is_running:
            reason = engine.dead_reason or "the engine loop has stopped"
            return APIError(503, f"{reason[:1].upper()}{reason[1:]}.",
                            code="engine_dead").response()
        stats = engine.stats
        if stats.replicas_lost:  # still serving, on fewer data-parallel replicas
            return {"status": "degraded", "replicas": stats.replicas,
                    "replicas_serving": stats.replicas - len(stats.replicas_lost),
                    "replicas_lost": [{"replica": rank, "reason": why}
                                      for rank, why in stats.replicas_lost]}
        return Response(status_code=200)

    @router.get("/ready")
    async def ready():
        # Ready: the loop runs, every bucket is compiled, and we are not draining. /health
        # answers 200 earlier: requests are served while the warm-up compiles in background.
        if not engine.is_running or state.draining:
            return APIError(503, "Not ready.", code="not_ready").response()
        if not engine.warm_up_done:
            return APIError(503, "Warming up: compiling the remaining shape buckets; requests "
                            "are served meanwhile.", code="warming_up").response()
        return {"status": "ready"}

    @router.get("/version")
    async def version():
        return {"version": VERSION}

    @router.get("/metrics")
    async def metrics():
        body = engine.metrics.render() if engine.metrics else b""
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4")

    return router
