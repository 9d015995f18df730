"""The Responses API's routes (/v1/responses: create, retrieve, delete, cancel) on the app's
OpenAIResponses (serving.py). state: the app's ServerState (server/routing.py)."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request

from jaxserve.server.routing import admitted


def responses_routes(state) -> APIRouter:
    router = APIRouter()
    responses = state.responses_api

    @router.post("/v1/responses")
    async def create_response(request: Request):
        prepared = await admitted(state, request, responses.prepare, responses.with_grammar)
        return await responses.respond(prepared, request)

    @router.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request):
        return await responses.retrieve(response_id, request.query_params)

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return responses.delete(response_id)

    @router.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return responses.cancel(response_id)

    return router
