"""A real `jaxserve serve` under malformed and hostile requests: one request never stops the
engine, and every answer is a 2xx or a 4xx with the error envelope.

Values the device cannot hold, bodies nested 10,000 deep, bodies and headers that never
arrive, 1 MB prompts while others wait for /health, 1,100-prompt requests beside ordinary
ones, and clients that leave mid-body (the property-based fuzz of every surface:
tests/server/test_fuzz.py). The server's log must hold no ERROR line at the end.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import statistics
import threading
import time
from http.client import HTTPConnection

import httpx
import pytest
from support.server_helpers import SHARED_READ_TIMEOUT as READ_TIMEOUT

C, CH = "/v1/completions", "/v1/chat/completions"
NORMAL = {"model": "tiny", "prompt": [1, 5, 6, 7], "max_tokens": 4, "temperature": 0,
          "ignore_eos": True}
ENVELOPE_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(api_server):
    return api_server  # conftest: one server for the HTTP test modules


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, trust_env=False) as client:
        yield client


@pytest.fixture(scope="module")
def expected_tokens(http):
    """NORMAL's greedy tokens, before anything hostile happened."""
    return completion_tokens(http)


def completion_tokens(http) -> list[str]:
    resp = http.post(C, json={**NORMAL, "logprobs": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["logprobs"]["tokens"]


def assert_envelope(resp: httpx.Response, status: int | None = None, param=None) -> dict:
    if status is not None:
        assert resp.status_code == status, resp.text[:500]
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert set(body) == {"error"} and ENVELOPE_KEYS <= set(body["error"]), body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


def assert_serving(http, expected_tokens) -> None:
    assert http.get("/health").status_code == 200
    assert completion_tokens(http) == expected_tokens


# ---- values the device cannot hold ------------------------------------------------------
@pytest.mark.parametrize("path, field, raw", [
    (C, "top_k", "9223372036854775808"),  # 2**63
    (C, "top_k", "18446744073709551616"),  # 2**64
    (C, "top_k", '"9223372036854775808"'),  # as a string
    (C, "top_k", "2147483648"),  # one past int32
    (CH, "top_k", "18446744073709551616"),
    (C, "repetition_penalty", "1e-320"),
    (C, "repetition_penalty", "0"),
    (C, "temperature", "1e-320"),
    (C, "temperature", "1e39"),
    (C, "top_p", "1e-40"),
    (C, "presence_penalty", "1e-320"),
    (C, "max_tokens", "9223372036854775808"),
    (C, "min_tokens", "-9223372036854775809"),
    (C, "seed", "18446744073709551616"),
    (C, "stop_token_ids", "[4294967296]"),
    (CH, "max_completion_tokens", "18446744073709551616"),
])
def test_values_beyond_the_device_types_get_400_and_the_engine_keeps_serving(
        http, expected_tokens, path, field, raw):
    base = ('{"model": "tiny", "max_tokens": 2, '
            + ('"prompt": "Hello"' if path == C else
               '"messages": [{"role": "user", "content": "Hello"}]'))
    if field == "max_tokens":
        base = base.replace('"max_tokens": 2, ', "")
    resp = http.post(path, content=f'{base}, "{field}": {raw}}}'.encode(),
                     headers={"content-type": "application/json"})
    assert_envelope(resp, 400, field)
    assert_serving(http, expected_tokens)


def test_top_k_up_to_int32_means_no_limit(http):
    resp = http.post(C, json={**NORMAL, "top_k": 2**31 - 1, "temperature": 1.0, "seed": 1})
    assert resp.status_code == 200, resp.text


# ---- bounded parsing ----------------------------------------------------------------------
DEEP = 10_000
NESTED = {
    "array-body": b"[" * DEEP + b"]" * DEEP,
    "object-body": b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    "prompt": b'{"prompt": ' + b"[" * DEEP + b"]" * DEEP + b', "max_tokens": 2}',
    "chat-content": (b'{"max_tokens": 2, "messages": [{"role": "user", "content": '
                     + b"[" * DEEP + b"]" * DEEP + b"}]}"),
    "unclosed": b'{"prompt": ' + b"[" * DEEP,
}
ENDPOINTS = [C, CH, "/tokenize", "/detokenize"]


def keep_alive_post(conn: HTTPConnection, path: str, body: bytes):
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read()), resp.will_close


@pytest.mark.parametrize("path", ENDPOINTS)
def test_deeply_nested_bodies_get_400_and_the_connection_stays_usable(server, path):
    host, port = server.url.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=30)
    try:
        for name, body in NESTED.items():
            status, payload, will_close = keep_alive_post(conn, path, body)
            assert status == 400, (name, payload)
            assert set(payload["error"]) >= ENVELOPE_KEYS
            if name != "unclosed":
                assert "128" in payload["error"]["message"], payload
            assert not will_close, name
        local = conn.sock.getsockname()
        follow = {C: NORMAL, CH: {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 2},
                  "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [5, 6]}}[path]
        status, payload, _ = keep_alive_post(conn, path, json.dumps(follow).encode())
        assert status == 200, payload
        assert conn.sock.getsockname() == local, "the same connection served the follow-up"
    finally:
        conn.close()


# ---- bounded reading ----------------------------------------------------------------------
def read_response(sock: socket.socket, timeout: float) -> tuple[bytes, float, bool]:
    """Everything the server sends until it closes (or the timeout): (bytes, seconds until
    the first byte, closed?)."""
    sock.settimeout(timeout)
    start, first, data = time.monotonic(), None, b""
    try:
        while chunk := sock.recv(65536):
            first = first if first is not None else time.monotonic() - start
            data += chunk
    except TimeoutError:
        return data, first if first is not None else math.inf, False
    return data, first if first is not None else time.monotonic() - start, True


def test_a_stalled_body_gets_408_within_the_timeout_and_the_connection_closes(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        data, first, closed = read_response(sock, READ_TIMEOUT + 10)
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert READ_TIMEOUT - 0.5 <= first <= READ_TIMEOUT + 5, first
    assert closed and b"request_timeout" in data


def test_headers_that_never_complete_close_the_connection(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        data, waited, closed = read_response(sock, READ_TIMEOUT + 10)
    assert closed and data == b"" and waited <= READ_TIMEOUT + 5, (data, waited)


def test_a_client_leaving_mid_body_is_not_an_error(server, http, expected_tokens):
    host, port = server.url.removeprefix("http://").split(":")
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
            time.sleep(0.1)
    assert_serving(http, expected_tokens)  # the log check at the end covers the rest


# ---- bounded work -------------------------------------------------------------------------
def test_health_answers_fast_while_a_1mb_prompt_is_tokenized(server, http):
    line = "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    prompt = (line * (1_000_000 // len(line) + 1))[:1_000_000]
    idle = []
    for _ in range(5):
        start = time.perf_counter()
        assert http.get("/health").status_code == 200
        idle.append(time.perf_counter() - start)
    result = {}

    def big():
        with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as own:
            start = time.perf_counter()
            result["response"] = own.post(C, json={"model": "tiny", "prompt": prompt,
                                                   "max_tokens": 2})
            result["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=big)
    thread.start()
    time.sleep(0.2)  # the body is on its way, then tokenized
    busy = []
    while thread.is_alive():
        start = time.perf_counter()
        assert http.get("/health").status_code == 200
        busy.append(time.perf_counter() - start)
        time.sleep(0.02)
    thread.join()
    assert_envelope(result["response"], 400, "prompt")  # far longer than max_model_len
    assert len(busy) >= 5, (busy, result["seconds"])
    # Tokenizing takes seconds; /health keeps answering like an idle one.
    assert statistics.median(busy) < max(0.1, 10 * statistics.median(idle)), (idle, busy)
    assert max(busy) < result["seconds"] / 3, (busy, result["seconds"])


def test_a_1100_prompt_request_fails_no_one_else(server, expected_tokens):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60, trust_env=False) as own:
            big = own.post(C, json={"model": "tiny", "prompt": ["def f():"] * 1100,
                                    "max_tokens": 4})
            others = [own.post(C, json={**NORMAL, "logprobs": 0}) for _ in range(7)]
            return await asyncio.gather(big, *others)

    big, *others = asyncio.run(asyncio.wait_for(main(), 120))
    error = assert_envelope(big, 400, "prompt")
    assert "256" in error["message"]
    for resp in others:
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["logprobs"]["tokens"] == expected_tokens


# Keep last: the whole module's log.
def test_the_server_log_has_no_error_lines(server):
    errors = [line for line in server.log().splitlines()
              if line.startswith(("ERROR", "CRITICAL")) or "Traceback" in line]
    assert not errors, "\n".join(errors[:20])
