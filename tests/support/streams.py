"""HTTP clients of a running server for the tests that load it: request bodies for the
completion routes, an httpx.AsyncClient that never goes through a proxy, and `stream`, which
reads a streamed response's SSE events into a Stream (server/test_server_robustness.py,
server/test_engine_death_exit.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx

MODEL = "tiny"
TIMEOUT = httpx.Timeout(30.0, connect=5.0)


def request(chat: bool, prompt: str, max_tokens: int, **extra) -> tuple[str, dict]:
    body = {"model": MODEL, "max_tokens": max_tokens, **extra}
    if chat:
        return "/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/completions", {**body, "prompt": prompt}


def aclient(**kwargs) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=TIMEOUT, trust_env=False, **kwargs)  # no proxy, ever


@dataclasses.dataclass
class Stream:
    """What one streamed request got back."""

    status: int
    events: list[dict] = dataclasses.field(default_factory=list)
    done: bool = False  # saw `data: [DONE]`
    after_done: int = 0  # data lines after [DONE] (must be 0)
    error: dict | None = None  # a non-200 body, or an in-band error event

    def finish_reasons(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for event in self.events:
            for choice in event.get("choices", []):
                if choice.get("finish_reason") is not None:
                    out.setdefault(choice["index"], []).append(choice["finish_reason"])
        return out

    def usage(self) -> dict | None:
        found = [e["usage"] for e in self.events if e.get("usage")]
        return found[-1] if found else None

    def assert_complete(self, reasons=("length", "stop")) -> str:
        """A 200 stream with one finish_reason chunk, no error, and [DONE] last."""
        assert self.status == 200, (self.status, self.error)
        assert self.error is None, self.error
        assert self.done and self.after_done == 0
        finish = self.finish_reasons()
        assert list(finish) == [0] and len(finish[0]) == 1, finish
        assert finish[0][0] in reasons, finish
        return finish[0][0]


async def stream(client: httpx.AsyncClient, api: str, path: str, body: dict, *,
                 cut_after_first: bool = False, first_chunk: asyncio.Event | None = None
                 ) -> Stream:
    """POST with stream=true and read the SSE events; cut_after_first closes the connection
    right after the first data chunk (the caller's client must not reuse it)."""
    async with client.stream("POST", api + path, json={**body, "stream": True}) as response:
        result = Stream(response.status_code)
        if response.status_code != 200:
            raw = await response.aread()
            try:
                result.error = json.loads(raw)
            except ValueError:
                result.error = {"raw": raw[:200].decode(errors="replace")}
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue  # the blank lines between events
            data = line[len("data: "):]
            if result.done:
                result.after_done += 1
            elif data == "[DONE]":
                result.done = True
            else:
                payload = json.loads(data)
                if "error" in payload:
                    result.error = payload
                else:
                    result.events.append(payload)
                if first_chunk is not None:
                    first_chunk.set()
                if cut_after_first:
                    break
    return result


def run_async(coro, timeout: float):
    return asyncio.run(asyncio.wait_for(coro, timeout))
