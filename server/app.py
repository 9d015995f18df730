"""The FastAPI application: routes, auth, body-size cap, draining, error envelopes.

Built by create_app() around a started AsyncLLMEngine; `jaxserve serve` runs it with uvicorn.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

import jaxserve
from jaxserve.server.async_engine import AsyncLLMEngine
from jaxserve.server.errors import APIError, from_validation_error
from jaxserve.server.openai_serving import OpenAIServing
from jaxserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestLimits,
    TokenizeRequest,
)
from jaxserve.tokenizer import apply_chat_template

logger = logging.getLogger(__name__)

_OPEN_PATHS = ("/health", "/ready", "/version")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "model"
    api_key: str | None = None
    metrics_require_auth: bool = False
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    max_waiting_requests: int = 1024
    shutdown_timeout: float = 30.0
    limits: RequestLimits = dataclasses.field(default_factory=RequestLimits)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}.")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}.")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}.")


class ServerState:
    """What the routes share: the engine, the config, and whether the server is draining."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.serving = OpenAIServing(engine, config.served_model_name, config.limits)
        self.draining = False
        self.started = time.time()


def create_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="jaxserve", version=jaxserve.__version__, docs_url=None,
                  redoc_url=None)
    state = ServerState(engine, config)
    app.state.jaxserve = state
    _install_errors(app)
    app.add_middleware(_Guard, state=state)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    _install_routes(app, state)
    return app


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError):
        return err.response()

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
        logger.exception("Unhandled error")
        return APIError(500, "internal server error", code="internal_error").response()


class _Guard:
    """Pure ASGI middleware (so streaming and disconnect detection pass through untouched):
    API key, draining, and the body-size cap, before any route runs."""

    def __init__(self, app, state: ServerState) -> None:
        self.app, self.state = app, state
        key = state.config.api_key
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        config, path = self.state.config, scope["path"]
        headers = dict(scope["headers"])
        open_path = path in _OPEN_PATHS or (path == "/metrics" and not config.metrics_require_auth)
        if self.expected is not None and not open_path and scope["method"] != "OPTIONS":
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                error = APIError(401, "Missing or invalid API key: send 'Authorization: Bearer "
                                 "<key>'.", code="invalid_api_key")
                return await error.response()(scope, receive, send)
        if self.state.draining and path not in _OPEN_PATHS and path != "/metrics":
            error = APIError(503, "The server is shutting down.", code="draining")
            return await error.response()(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > config.max_body_bytes:
            return await _too_large(config)(scope, receive, send)
        body, messages = 0, []
        while True:  # read the whole body first, stopping at the cap
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += len(message.get("body", b""))
            if body > config.max_body_bytes:
                return await _too_large(config)(scope, receive, send)
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


def _too_large(config: ServerConfig) -> JSONResponse:
    return APIError(413, f"The request body is larger than {config.max_body_bytes} bytes.",
                    code="body_too_large").response()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def _json_body(request: Request, model):
    """Parse the body ourselves so that every malformed input gets the 400 envelope."""
    try:
        data = json.loads(await request.body(), parse_constant=_reject_constant)
        json.dumps(data, ensure_ascii=False).encode("utf-8")  # no lone surrogates
    except (ValueError, UnicodeError):
        raise APIError(400, "The request body is not valid JSON (UTF-8, no NaN or Infinity).",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(data)
    except Exception as err:  # pydantic.ValidationError
        if hasattr(err, "errors"):
            raise from_validation_error(err) from None
        raise


def _install_routes(app: FastAPI, state: ServerState) -> None:
    serving = state.serving
    engine = state.engine
    tokenizer = engine.engine.tokenizer
    config = state.config

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.completions(await _json_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serving.chat(await _json_body(request, ChatCompletionRequest), request)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": int(state.started),
            "owned_by": "jaxserve", "root": engine.engine.config.model.model,
            "max_model_len": engine.engine.config.model.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json_body(request, TokenizeRequest)
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Give exactly one of prompt or messages.", param="prompt")
        if body.messages is not None:
            try:
                ids = apply_chat_template(tokenizer, [m.as_template_message()
                                                      for m in body.messages],
                                          add_generation_prompt=body.add_generation_prompt)
            except ValueError as err:
                raise APIError(400, str(err)[:300], param="messages") from None
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids),
                "max_model_len": engine.engine.config.model.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _json_body(request, DetokenizeRequest)
        serving.check_model(body.model)
        vocab = engine.engine.config.model.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab}).", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return APIError(503, "The engine loop has stopped.", code="engine_dead").response()
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        # The app is built after warm-up, so "ready" is: the loop runs and we are not draining.
        if not engine.is_running or state.draining:
            return APIError(503, "Not ready.", code="not_ready").response()
        return {"status": "ready"}

    @app.get("/version")
    async def version():
        return {"version": jaxserve.__version__}

    @app.get("/metrics")
    async def metrics():
        body = engine.metrics.render() if engine.metrics else b""
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4")
