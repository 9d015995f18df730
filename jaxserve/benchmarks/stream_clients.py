"""Streaming clients for the serving benchmarks: N completions at once, each read to its end.

    python -m jaxserve.benchmarks.stream_clients URL N MAX_TOKENS

Runs in a process of its own (the server's process should spend its time serving, not
reading), one asyncio task per stream over one httpx connection pool. Prints the number of
SSE chunks and of streams that ended with [DONE].
"""

from __future__ import annotations

import asyncio
import sys

import httpx


async def _stream(client: httpx.AsyncClient, url: str, index: int, max_tokens: int) -> int:
    body = {"model": "standin", "prompt": [5 + index % 97, 40, 41, 42], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8}
    chunks = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return chunks
            if line.startswith("data: "):
                chunks += 1
    raise RuntimeError("a stream ended without [DONE]")


async def run(url: str, count: int, max_tokens: int) -> tuple[int, int]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(limits=limits, timeout=None) as client:
        results = await asyncio.gather(*(_stream(client, url, i, max_tokens)
                                         for i in range(count)), return_exceptions=True)
    done = [r for r in results if isinstance(r, int)]
    return sum(done), len(done)


def main() -> None:
    url, count, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    chunks, done = asyncio.run(run(url, count, max_tokens))
    print(f"chunks {chunks} streams {done}")


if __name__ == "__main__":
    main()
