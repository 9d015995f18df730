"""The OpenAI API's routes: /v1/completions and /v1/chat/completions (completion_routes), and
vLLM's /tokenize and /detokenize (tokenize_routes), on the app's OpenAIServing (serving.py).
state: the app's ServerState (server/routing.py)."""

from __future__ import annotations

import json

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from jaxserve.server.routing import admitted


def completion_routes(state) -> APIRouter:
    router = APIRouter()
    serving = state.serving

    @router.post("/v1/completions")
    async def completions(request: Request):
        prepared = await admitted(state, request, serving.prepare_completion,
                                  serving.with_grammar)
        return await serving.respond(prepared, request)

    @router.post("/v1/chat/completions")
    async def chat(request: Request):
        prepared = await admitted(state, request, serving.prepare_chat, serving.with_grammar)
        return await serving.respond(prepared, request)

    return router


def tokenize_routes(state) -> APIRouter:
    """A prompt or a conversation to token ids and back (vLLM's), encoded to JSON on a
    prepare thread (a long prompt's ids are megabytes)."""
    router = APIRouter()
    serving = state.serving

    @router.post("/tokenize")
    async def tokenize(request: Request):
        async with state.preparing():
            return _json(await state.off_loop(_encoded, serving.tokenize, await request.body()))

    @router.post("/detokenize")
    async def detokenize(request: Request):
        async with state.preparing():
            return _json(await state.off_loop(_encoded, serving.detokenize,
                                              await request.body()))

    return router


def _encoded(fn, *args) -> bytes:
    """fn(*args) as JSON bytes (in a worker thread)."""
    return json.dumps(fn(*args), ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def _json(content: bytes) -> Response:
    return Response(content, media_type="application/json")
