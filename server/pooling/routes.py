"""vLLM's pooling routes (/v1/embeddings, /pooling, /classify, /score, /rerank and their
aliases) on the app's PoolingServing (serving.py): on a generating model each answers a 400
that says why, as the generation routes do on a pooling model. state: the app's
ServerState (server/routing.py)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request

from jaxserve.server.routing import admitted


def pooling_routes(state) -> APIRouter:
    router = APIRouter()
    pooling = state.pooling

    def route(prepare):
        async def pooled(request: Request):
            prepared = await admitted(state, request, prepare)
            return await pooling.respond(prepared, request)
        return pooled

    routes = {("/v1/embeddings",): pooling.prepare_embeddings,
              ("/pooling",): pooling.prepare_pooling, ("/classify",): pooling.prepare_classify,
              ("/score", "/v1/score"): pooling.prepare_score,
              ("/rerank", "/v1/rerank", "/v2/rerank"): pooling.prepare_rerank}
    for paths, prepare in routes.items():
        for path in paths:
            router.add_api_route(path, route(prepare), methods=["POST"],
                                 name=prepare.__name__.removeprefix("prepare_"))
    return router
