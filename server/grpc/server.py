"""`jaxserve serve --grpc-port P`: the VllmEngine service beside HTTP, on the same event loop
and engine, with grpc.health.v1 and server reflection.

Loopback by default (the HTTP --host); TLS with --grpc-ssl-certfile/--grpc-ssl-keyfile. When
the server has API keys, every call but health and reflection needs `authorization: Bearer
<key>` metadata (UNAUTHENTICATED otherwise). Health is SERVING for "" and the VllmEngine
service while the engine runs, NOT_SERVING once it stops or the server drains.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import pathlib

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from jaxserve.server.grpc.servicer import SERVICE_NAME, VllmEngineServicer

logger = logging.getLogger(__name__)

_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_HEALTH_POLL_S = 0.5
_SEND_CAP_BYTES = 256 * 1024 * 1024  # a long output's logprobs; what a reply may carry


@dataclasses.dataclass(frozen=True)
class GrpcConfig:
    port: int
    host: str = "127.0.0.1"
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    max_receive_bytes: int = 4 * 1024 * 1024  # a request's size cap (HTTP's body cap)
    # Calls at once (beyond: RESOURCE_EXHAUSTED; --limit-concurrency) and HTTP/2 streams per
    # connection.
    max_concurrent_rpcs: int | None = None
    max_concurrent_streams: int = 1024

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"grpc_port must be in 1..65535, got {self.port}.")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            raise ValueError("TLS for gRPC needs both --grpc-ssl-certfile and "
                             "--grpc-ssl-keyfile.")
        for name in ("ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is not None and not pathlib.Path(path).is_file():
                raise ValueError(f"--grpc-{name.replace('_', '-')}: no file at {path!r}.")
        if self.max_receive_bytes < 1024:
            raise ValueError(f"max_receive_bytes must be >= 1024, got {self.max_receive_bytes}.")
        if self.max_concurrent_rpcs is not None and self.max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got "
                             f"{self.max_concurrent_rpcs}.")

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class GrpcServer:
    """The running gRPC server: start() on the event loop, drain() when shutting down."""

    def __init__(self, state, config: GrpcConfig) -> None:
        """state: the HTTP app's ServerState (engine, API keys, draining flag, workers)."""
        self.state, self.config = state, config
        self.health = health.aio.HealthServicer()
        interceptors = [_ApiKeyCheck(state.config.api_keys)] if state.config.api_keys else []
        self.server = grpc.aio.server(interceptors=interceptors,
                                      maximum_concurrent_rpcs=config.max_concurrent_rpcs,
                                      options=[
            ("grpc.max_receive_message_length", config.max_receive_bytes),
            ("grpc.max_send_message_length", _SEND_CAP_BYTES),
            ("grpc.max_concurrent_streams", config.max_concurrent_streams),
            # Routers ping idle connections (the SMG gateway every 30 s): allow it.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ])
        pb_grpc.add_VllmEngineServicer_to_server(VllmEngineServicer(state), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self.server)
        try:
            if config.ssl_certfile:
                credentials = grpc.ssl_server_credentials([(
                    pathlib.Path(config.ssl_keyfile).read_bytes(),
                    pathlib.Path(config.ssl_certfile).read_bytes())])
                self.port = self.server.add_secure_port(config.address, credentials)
            else:
                self.port = self.server.add_insecure_port(config.address)
        except RuntimeError as err:  # grpc's "Failed to bind"
            raise ValueError(f"--grpc-port: cannot listen on {config.address} ({err}); is "
                             "another process using the port?") from None
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        await self.server.start()
        await self._set_health()
        self._watch = asyncio.create_task(self._watch_engine())
        logger.info("Serving gRPC (vllm.grpc.engine.VllmEngine) on %s%s", self.config.address,
                    " with TLS" if self.config.ssl_certfile else "")

    async def drain(self) -> None:
        """Health NOT_SERVING now (new Generate calls are refused while draining)."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float = 1.0) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def _set_health(self) -> None:
        serving = self.state.engine.is_running and not self.state.draining
        status = health_pb2.HealthCheckResponse.SERVING if serving else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def _watch_engine(self) -> None:
        """Keep health in step with the engine (a loop that died) and the draining flag."""
        while True:
            await asyncio.sleep(_HEALTH_POLL_S)
            if self.state.draining:
                await self.drain()
                return
            await self._set_health()


class _ApiKeyCheck(grpc.aio.ServerInterceptor):
    """`authorization: Bearer <key>` on every call but health and reflection."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.expected = [f"Bearer {key}".encode() for key in keys]

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_METHODS):
            return handler
        given = next((value for key, value in details.invocation_metadata or ()
                      if key == "authorization"), "")
        given = given.encode() if isinstance(given, str) else given
        # Every key is compared (no early exit), so timing tells nothing about which.
        if sum(hmac.compare_digest(given, key) for key in self.expected):
            return handler
        return _denied(handler)


_DENIED = "Missing or invalid API key: send 'authorization: Bearer <key>' metadata."


def _denied(handler):
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _DENIED)
        yield  # an async generator, as a streaming method must be

    kinds = {"unary_unary": (grpc.unary_unary_rpc_method_handler, unary),
             "unary_stream": (grpc.unary_stream_rpc_method_handler, streaming),
             "stream_unary": (grpc.stream_unary_rpc_method_handler, unary),
             "stream_stream": (grpc.stream_stream_rpc_method_handler, streaming)}
    for kind, (make, behaviour) in kinds.items():
        if getattr(handler, kind) is not None:
            return make(behaviour, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    raise TypeError(f"unknown handler kind for {handler!r}")
