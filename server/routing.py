"""What every API's routes share: the ids a request carries, and its way through admission.

Each API builds its own APIRouter (server/openai/routes.py, server/responses/routes.py,
server/pooling/routes.py; lora_models.py, dev_routes.py), and server/app.py puts them
in its route table. A route reads everything off the app's ServerState (`state`: the
engine, the API objects, the thread pools), so these folders never import the app.
"""

from __future__ import annotations

import uuid

from starlette.requests import Request

REQUEST_ID_KEY = "jaxserve_request_id"  # in the ASGI scope's state, set by the app's guard


def request_ids(request: Request) -> tuple[str | None, str]:
    """(the X-Request-Id header or None, this HTTP request's own id)."""
    return (request.headers.get("x-request-id") or None,
            request.scope.get("state", {}).get(REQUEST_ID_KEY) or uuid.uuid4().hex)


async def admitted(state, request: Request, prepare, grammar=None):
    """A request through the admission path, never on the event loop: its body through
    prepare(body, ids) on a prepare thread, then (grammar given) `await grammar(prepared)`,
    which compiles a structured output on the grammar threads; counted all along by
    state.preparing() (503 beyond max_preparing_requests; the drain waits for it)."""
    async with state.preparing():
        prepared = await state.off_loop(prepare, await request.body(), request_ids(request))
        if grammar is not None:
            prepared = await grammar(prepared)
    return prepared
