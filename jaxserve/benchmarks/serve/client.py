"""`jaxserve bench serve`'s HTTP side, as vLLM's benchmark request functions: one streamed
completion or chat completion timed chunk by chunk (TTFT, ITL, end-to-end latency, the
server's usage), the model list, the arrival times (Poisson or gamma, as vLLM) and one
benchmark run: every request sent at its arrival time, at most max_concurrency at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import time

import httpx
import numpy as np

from jaxserve.benchmarks.serve.datasets import SampleRequest

TIMEOUT_S = 6 * 60 * 60  # vLLM's: a request may take this long


@dataclasses.dataclass
class RequestOutput:
    """vLLM's RequestFuncOutput: one request's stream, in seconds."""

    generated_text: str = ""
    success: bool = False
    latency: float = 0.0  # send to the last streamed token
    output_tokens: int = 0  # the server's usage.completion_tokens (0: none sent)
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    prompt_len: int = 0
    error: str = ""
    start_time: float = 0.0  # time.perf_counter() at send


@dataclasses.dataclass
class Endpoint:
    """Where and how every request goes."""

    api_url: str  # e.g. http://127.0.0.1:8000/v1/completions
    chat: bool  # /v1/chat/completions (messages) or /v1/completions (prompt)
    model: str  # the name sent in each request
    extra_body: dict = dataclasses.field(default_factory=dict)  # sampling params, --extra-body
    ignore_eos: bool = False
    logprobs: int | None = None


def make_client(headers: dict, connections: int, verify: bool = True,
                trust_env: bool = True) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections + 4,
                          max_keepalive_connections=connections + 4)
    return httpx.AsyncClient(headers=headers, limits=limits, verify=verify, trust_env=trust_env,
                             timeout=httpx.Timeout(TIMEOUT_S, connect=30.0))


def request_body(endpoint: Endpoint, prompt: str, output_len: int) -> dict:
    body = {"model": endpoint.model, "stream": True, "stream_options": {"include_usage": True}}
    if endpoint.chat:
        body.update(messages=[{"role": "user", "content": prompt}],
                    max_completion_tokens=output_len)
    else:
        body.update(prompt=prompt, max_tokens=output_len)
        if endpoint.logprobs is not None:
            body["logprobs"] = endpoint.logprobs
    if endpoint.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **endpoint.extra_body}


async def send(client: httpx.AsyncClient, endpoint: Endpoint, request: SampleRequest,
               output_len: int | None = None) -> RequestOutput:
    """One streamed request, timed at each chunk that carries text (a role-only opening
    chunk, an empty finish chunk and the usage chunk do not count as tokens)."""
    body = request_body(endpoint, request.prompt, output_len or request.expected_output_len)
    headers = {"x-request-id": request.request_id} if request.request_id else {}
    out = RequestOutput(prompt_len=request.prompt_len)
    start = out.start_time = time.perf_counter()
    last = start
    done = False
    text: list[str] = []
    try:
        async with client.stream("POST", endpoint.api_url, json=body,
                                 headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread())[:300].decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {detail}"
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (": ping")
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"error in the stream: {json.dumps(chunk)[:300]}"
                    return out
                if usage := chunk.get("usage"):
                    out.output_tokens = usage.get("completion_tokens") or 0
                    out.prompt_len = usage.get("prompt_tokens") or out.prompt_len
                piece = "".join(_text(choice) for choice in chunk.get("choices") or [])
                if not piece:
                    continue
                now = time.perf_counter()
                if not text:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
                text.append(piece)
    except (httpx.HTTPError, ValueError) as err:
        out.error = f"{type(err).__name__}: {err}"[:300]
        return out
    out.generated_text = "".join(text)
    out.latency = last - start
    if not text:
        out.error = "no token was streamed"
    elif not done:
        out.error = "the stream ended without [DONE]"
    else:
        out.success = True
    return out


def _text(choice: dict) -> str:
    if "delta" in choice:
        delta = choice["delta"] or {}
        parts = [delta.get("content"), delta.get("reasoning_content"), delta.get("reasoning")]
        if delta.get("tool_calls"):
            parts.append(json.dumps(delta["tool_calls"]))
        return "".join(p for p in parts if isinstance(p, str))
    return choice.get("text") or ""


def first_model(base_url: str, headers: dict, verify: bool = True,
                trust_env: bool = True) -> tuple[str, str]:
    """(id, root) of the first model of GET /v1/models: the name to send, and where the
    server loaded it from (a folder or a Hub id: the tokenizer's default)."""
    url = f"{base_url}/v1/models"
    try:
        response = httpx.get(url, headers=headers, timeout=30.0, verify=verify,
                             trust_env=trust_env)
        response.raise_for_status()
        first = response.json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as err:
        raise ValueError(f"could not read the model list from {url} ({err}): is the server "
                         "running there? (or pass --model)") from None
    return first["id"], first.get("root") or first["id"]


async def ready_check(client: httpx.AsyncClient, endpoint: Endpoint, request: SampleRequest,
                      timeout_s: float) -> RequestOutput:
    """A short test request (not timed), repeated once a second until it succeeds or
    timeout_s has passed (0: one try)."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = await send(client, endpoint, request, min(request.expected_output_len, 16))
        if out.success or time.monotonic() >= deadline:
            return out
        await asyncio.sleep(1.0)


def arrival_times(count: int, request_rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Seconds from the start at which each request is sent (vLLM's get_request): gaps from
    a gamma distribution of shape `burstiness` (1: Poisson arrivals) at mean 1/rate,
    rescaled so the last one is at count/rate; all 0 at an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * count
    if math.isinf(burstiness):
        gaps = np.full(count, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=count)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (count / request_rate) / times[-1]
    return times.tolist()


async def run_benchmark(client: httpx.AsyncClient, endpoint: Endpoint,
                        requests: list[SampleRequest], request_rate: float,
                        burstiness: float, max_concurrency: int | None, seed: int = 0,
                        progress=None) -> tuple[list[RequestOutput], float]:
    """Every request at its arrival time, at most max_concurrency in flight (None: no cap);
    the outputs in request order and the seconds from the first send to the last answer.
    progress: a tqdm bar (or None) advanced as each request ends."""
    gate = (asyncio.Semaphore(max_concurrency) if max_concurrency
            else contextlib.nullcontext())

    async def limited(request: SampleRequest) -> RequestOutput:
        async with gate:
            out = await send(client, endpoint, request)
        if progress is not None:
            progress.update(1)
        return out

    start = time.perf_counter()
    tasks = []
    for request, at in zip(requests, arrival_times(len(requests), request_rate, burstiness,
                                                   seed)):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(limited(request)))
    outputs = await asyncio.gather(*tasks)
    return list(outputs), time.perf_counter() - start
