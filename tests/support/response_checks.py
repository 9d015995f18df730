"""What every answer of the server to a fuzzed request must look like: a 2xx or a 4xx with the
error envelope, and streams that end as they should (server/test_fuzz.py,
server/test_pooling_api.py)."""

from __future__ import annotations

import json

import httpx

ENVELOPE_KEYS = {"message", "type", "param", "code"}


def check_response(resp: httpx.Response, path: str) -> None:
    assert resp.status_code < 500 and resp.status_code != 422, (path, resp.text[:500])
    if resp.status_code >= 400:
        body = resp.json()
        assert set(body) == {"error"} and ENVELOPE_KEYS <= set(body["error"]), body
    elif resp.headers.get("content-type", "").startswith("text/event-stream") and \
            path == "/v1/responses":
        check_responses_stream(resp)
    elif resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", resp.text[-300:]
        # An error inside a stream blames the request (a grammar over its per-step budget),
        # never the server.
        errors = [json.loads(e)["error"] for e in events[:-1] if '"error"' in e[:12]]
        assert all(e["type"] == "invalid_request_error" for e in errors), errors


def check_responses_stream(resp: httpx.Response) -> None:
    """A /v1/responses stream: numbered events, ending with the response's terminal event or
    an error event that blames the request (OpenAI's stream has no [DONE] line)."""
    events = [json.loads(ln[6:]) for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert events and [e["sequence_number"] for e in events] == list(range(len(events)))
    last = events[-1]
    assert last["type"] in ("response.completed", "response.incomplete", "error"), last
    assert last["type"] != "error" or last["code"] not in ("internal_error", "engine_dead"), last
