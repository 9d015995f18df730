"""vLLM's development-mode routes: sleep mode and weight updates, for reinforcement-learning
trainers that drive a server between generation phases. They exist only when the server's
environment has VLLM_SERVER_DEV_MODE=1 (read once, when the app is made), as in vLLM;
otherwise they answer 404 like any unknown path.

    POST /sleep?level=1                               200, empty (level 1 or 2; default 1)
    POST /wake_up[?tags=weights][&tags=kv_cache]      200, empty (no tags: both)
    GET  /is_sleeping                                 {"is_sleeping": bool}
    POST /update_weights  {"path": "<folder>"}        {"updated": parameters changed}

/update_weights is jaxserve's: every safetensors tensor in the folder (on the server's
machine) replaces the weight it maps to, without recompiling (engine/sleep_mode.py). Each
input is checked with a 400 naming the query parameter or field: a bad level, an unknown tag
or query parameter, a body where none is taken, bad JSON, a missing or unknown field, a path
that is not a directory, a tensor that does not fit. Sleeping while requests run is a 409;
while the engine sleeps, generation requests get a 503 (engine_calls.EngineAsleepError).
The calls run on the engine thread (engine_calls.py); the API key and draining apply as to
every route.
"""

from __future__ import annotations

import logging
import os

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import Response

from jaxserve.engine.failures import EngineDeadError
from jaxserve.engine.sleep_mode import TAGS, RequestsUnfinishedError
from jaxserve.server.errors import APIError, short
from jaxserve.server.request_body import parse_body

logger = logging.getLogger(__name__)

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
MAX_PATH = 4096  # characters of /update_weights' path


class UpdateWeightsBody(BaseModel):
    """POST /update_weights: unknown fields are refused by name (not vLLM's schema)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    path: str = Field(min_length=1, max_length=MAX_PATH)


def dev_mode(environ=os.environ) -> bool:
    """Whether VLLM_SERVER_DEV_MODE turns the development routes on ("1", as vLLM; "true",
    "yes" and "on" too)."""
    return environ.get(DEV_MODE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def install_dev_routes(app, state) -> bool:
    """Add the routes to `app` (state: its ServerState) when the environment asks for
    development mode; whether it did."""
    router = dev_routes(state)
    if router is not None:
        app.include_router(router)
    return router is not None


def dev_routes(state) -> APIRouter | None:
    """The routes (state: the app's ServerState) when the environment asks for development
    mode, else None."""
    if not dev_mode():
        return None
    logger.warning("Development mode (%s=1): POST /sleep, /wake_up, /update_weights and GET "
                   "/is_sleeping are served; expose this server to trusted clients only.",
                   DEV_MODE_ENV)
    engine = state.engine
    router = APIRouter()

    @router.post("/sleep")
    async def sleep(request: Request):
        await _no_body(request, "level as a query parameter, e.g. /sleep?level=2")
        query = _query(request, ("level",))
        level = _level(query.get("level", []))
        await _engine_call(engine.sleep(level))
        return Response(status_code=200)

    @router.post("/wake_up")
    async def wake_up(request: Request):
        await _no_body(request, "tags as query parameters, e.g. /wake_up?tags=weights")
        tags = _tags(_query(request, ("tags",)).get("tags", []))
        await _engine_call(engine.wake_up(tags))
        return Response(status_code=200)

    @router.get("/is_sleeping")
    async def is_sleeping(request: Request):
        _query(request, ())
        return {"is_sleeping": await _engine_call(engine.is_sleeping())}

    @router.post("/update_weights")
    async def update_weights(request: Request):
        _query(request, ())
        body = await state.off_loop(parse_body, await request.body(), UpdateWeightsBody)
        try:
            is_dir = os.path.isdir(body.path)
        except (ValueError, OSError):  # e.g. a NUL character
            is_dir = False
        if not is_dir:
            raise APIError(400, f"path: {body.path!r:.200} is not a directory on the "
                           "server; give a folder of *.safetensors files.", param="path",
                           code="invalid_value")
        count = await _engine_call(engine.update_weights(body.path), param="path")
        return {"updated": count}

    return router


async def _no_body(request: Request, instead: str) -> None:
    if (await request.body()).strip():
        raise APIError(400, f"POST {request.url.path[:40]} takes no body: give {instead}.",
                       code="invalid_value")


def _query(request: Request, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """The query parameters, each name among `allowed`, as lists of values."""
    params = request.query_params
    for name in params.keys():
        if name not in allowed:
            takes = " and ".join(allowed) if allowed else "no query parameters"
            raise APIError(400, f"Unknown query parameter {name!r:.40}: "
                           f"{request.url.path[:40]} takes {takes}.", param=name[:40],
                           code="invalid_value")
    return {name: params.getlist(name) for name in allowed if name in params}


def _level(values: list[str]) -> int:
    if not values:
        return 1
    if len(values) > 1 or values[0].strip() not in ("1", "2"):
        given = values[0] if len(values) == 1 else ", ".join(v[:10] for v in values[:3])
        raise APIError(400, f"level must be 1 (weights to host memory, KV cache dropped) or "
                       f"2 (both dropped), once; got {given!r:.40}.", param="level",
                       code="invalid_value")
    return int(values[0])


def _tags(values: list[str]) -> list[str] | None:
    for tag in values:
        if tag not in TAGS:
            raise APIError(400, f"tags: unknown tag {tag!r:.40}; wake_up takes "
                           f"{' and '.join(TAGS)} (no tags: both).", param="tags",
                           code="invalid_value")
    return list(dict.fromkeys(values)) or None


async def _engine_call(call, param: str | None = None):
    """Await an engine call (engine_calls.py), its refusals as API errors."""
    try:
        return await call
    except RequestsUnfinishedError as err:
        raise APIError(409, short(str(err)), code="requests_unfinished") from None
    except ValueError as err:
        raise APIError(400, short(str(err)), param=param, code="invalid_value") from None
    except EngineDeadError as err:
        raise APIError(503, short(str(err)), code="engine_dead") from None
