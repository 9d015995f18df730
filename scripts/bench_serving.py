"""Benchmark a running OpenAI-compatible server on this machine, like `vllm bench serve`.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --max-concurrency 16 \
        --num-prompts 200 --input-len 128 --output-len 128 [--request-rate 8] [--json out.json]

Random prompts of --input-len tokens (token ids for completions, words for chat) are streamed
with ignore_eos, so every answer has --output-len tokens. Requests start at Poisson arrival
times (--request-rate, default: all at once), at most --max-concurrency at a time, until
--num-prompts have been sent or --duration seconds have passed. Measures time to first token
(TTFT), time per output token after the first (TPOT), inter-token latency (ITL, the gap
between streamed chunks) and end-to-end latency (E2E), with request and token throughput.
Only loopback addresses are accepted: this is a local load generator, not a remote one.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import json
import math
import random
import socket
import statistics
import sys
import time
from urllib.parse import urlsplit

import httpx

WORDS = ("def class return import self value list dict for while yield print data file name "
         "index count result error open close read write start stop the of and to in is it "
         "that with as on be at by this from or an").split()


@dataclasses.dataclass
class Result:
    ok: bool
    start: float = 0.0  # monotonic time the request was sent
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


# ---- arguments and safety ---------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root (loopback only), e.g. http://127.0.0.1:8000")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight at once (default: no cap)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--duration", type=float, default=300.0,
                   help="stop sending new requests after this many seconds; the run ends at "
                   "most --timeout seconds later")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len*(1-r), len*(1+r)] (default 0: fixed)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="50,90,99")
    p.add_argument("--json", metavar="OUT", default=None, help="also save the results as JSON")
    args = p.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be >= 1")
    if not args.request_rate > 0:
        p.error("--request-rate must be > 0 (inf for all at once)")
    if not 0 <= args.range_ratio < 1:
        p.error("--range-ratio must be in [0, 1)")
    if not args.duration > 0 or not args.timeout > 0:
        p.error("--duration and --timeout must be > 0")
    try:
        check_loopback(args.base_url)
    except ValueError as err:
        p.error(str(err))
    args.base_url = args.base_url.rstrip("/")
    if args.base_url.endswith("/v1"):
        args.base_url = args.base_url[:-3]
    return args


def check_loopback(url: str) -> None:
    """Refuse any host that is not this machine's loopback interface."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url must look like http://127.0.0.1:PORT, got {url!r}")
    host = parts.hostname
    if host == "localhost":  # answered by /etc/hosts; still check where it points
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
        if addresses and all(ipaddress.ip_address(a).is_loopback for a in addresses):
            return
    else:
        try:
            if ipaddress.ip_address(host).is_loopback:
                return
        except ValueError:  # a name: not resolved (that would ask a DNS server)
            pass
    raise ValueError(f"refusing non-loopback host {host!r}: use 127.0.0.1, ::1 or localhost")


# ---- prompts ------------------------------------------------------------------------------
def lengths(rng: random.Random, length: int, ratio: float) -> int:
    low, high = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return rng.randint(low, high)


async def make_prompts(client: httpx.AsyncClient, args, model: str) -> list[tuple[object, int]]:
    """(prompt, output_len) pairs: random words cut to input_len tokens with the server's
    /tokenize, sent as token ids (completions) or as the /detokenize'd text (chat, whose
    template then adds a few tokens). Without those routes: the words, ~1 token each."""
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.num_prompts):
        n_in = lengths(rng, args.input_len, args.range_ratio)
        n_out = lengths(rng, args.output_len, args.range_ratio)
        text = " ".join(rng.choice(WORDS) for _ in range(n_in))  # >= 1 token per word
        ids = await call(client, f"{args.base_url}/tokenize", "tokens",
                         {"model": model, "prompt": text})
        if ids is None:
            out.append((text, n_out))
        elif args.endpoint == "completions":
            out.append((ids[:n_in], n_out))
        else:
            cut = await call(client, f"{args.base_url}/detokenize", "prompt",
                             {"model": model, "tokens": ids[:n_in]})
            out.append((cut or text, n_out))
    return out


async def call(client: httpx.AsyncClient, url: str, key: str, body: dict):
    """POST body and return response[key], or None if the server lacks the route."""
    try:
        response = await client.post(url, json=body)
    except httpx.HTTPError:
        return None
    return response.json().get(key) if response.status_code == 200 else None


# ---- one request ------------------------------------------------------------------------
def request_body(args, model: str, prompt, max_tokens: int) -> tuple[str, dict]:
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": args.temperature, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user",
                                                              "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def run_one(client: httpx.AsyncClient, args, model: str, prompt, max_tokens: int
                  ) -> Result:
    path, body = request_body(args, model, prompt, max_tokens)
    start = time.perf_counter()
    result = Result(ok=False, start=time.monotonic())
    last = None
    done = False
    chunks = 0  # chunks with text; the token count when the server sends no usage
    try:
        async with client.stream("POST", args.base_url + path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread())[:300].decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"in-stream error: {json.dumps(chunk)[:300]}"
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not any(_has_text(c) for c in chunk.get("choices", [])):
                    continue  # role-only opening chunk, usage chunk, empty finish chunk
                chunks += 1
                now = time.perf_counter()
                if last is None:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
    except (httpx.HTTPError, ValueError) as err:
        result.error = f"{type(err).__name__}: {err}"[:300]
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    if not done:
        result.error = "stream ended without [DONE]"
    elif last is None:
        result.error = "no text was streamed"
    else:
        result.ok = True
    return result


def _has_text(choice: dict) -> bool:
    if "delta" in choice:
        return bool(choice["delta"].get("content"))
    return bool(choice.get("text"))


# ---- the run ------------------------------------------------------------------------------
async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def benchmark(args) -> dict:
    limits = httpx.Limits(max_connections=(args.max_concurrency or args.num_prompts) + 4,
                          max_keepalive_connections=(args.max_concurrency or 64))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers,
                                 trust_env=False) as client:  # never through a proxy
        model = args.model or await first_model(client, args.base_url)
        prompts = await make_prompts(client, args, model)
        probe = await run_one(client, args, model, prompts[0][0], 4)  # fail fast, not timed
        if not probe.ok:
            raise SystemExit(f"the test request failed: {probe.error}")

        rng = random.Random(args.seed + 1)
        gate = asyncio.Semaphore(args.max_concurrency or len(prompts))
        tasks: list[asyncio.Task] = []

        async def limited(prompt, max_tokens):
            async with gate:
                return await run_one(client, args, model, prompt, max_tokens)

        start = time.monotonic()
        deadline = start + args.duration
        for prompt, max_tokens in prompts:
            if time.monotonic() >= deadline:
                break
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(min(rng.expovariate(args.request_rate),
                                        max(0.0, deadline - time.monotonic())))
        try:
            results = await asyncio.wait_for(asyncio.gather(*tasks),
                                             max(1.0, deadline - time.monotonic())
                                             + args.timeout)
        except asyncio.TimeoutError:
            results = [t.result() if t.done() else Result(ok=False, error="cancelled")
                       for t in tasks]
        elapsed = time.monotonic() - start
    return summarize(args, model, results, elapsed)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(args, model: str, results: list[Result], elapsed: float) -> dict:
    ok = [r for r in results if r.ok]
    qs = [float(q) for q in args.percentiles.split(",")]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    out = {
        "base_url": args.base_url, "model": model, "endpoint": args.endpoint,
        "max_concurrency": args.max_concurrency,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "input_len": args.input_len, "output_len": args.output_len,
        "range_ratio": args.range_ratio, "num_prompts": args.num_prompts,
        "sent": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": elapsed, "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / elapsed if elapsed else 0.0,
        "output_throughput": output_tokens / elapsed if elapsed else 0.0,
        "total_token_throughput": (prompt_tokens + output_tokens) / elapsed if elapsed else 0.0,
        "short_outputs": sum(r.output_tokens < 1 for r in ok),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }
    for name, values in series.items():
        out[f"mean_{name}_ms"] = 1000 * statistics.fmean(values) if values else float("nan")
        for q in qs:
            out[f"p{q:g}_{name}_ms"] = 1000 * percentile(values, q)
    return out


def print_table(out: dict, qs: list[float]) -> None:
    rows = [
        ("Model / endpoint", f"{out['model']} / {out['endpoint']}"),
        ("Max concurrency", out["max_concurrency"] or "none"),
        ("Request rate (req/s)", out["request_rate"] or "inf"),
        ("Successful requests", out["completed"]),
        ("Failed requests", out["failed"]),
        ("Benchmark duration (s)", f"{out['duration_s']:.2f}"),
        ("Total input tokens", out["total_input_tokens"]),
        ("Total generated tokens", out["total_output_tokens"]),
        ("Request throughput (req/s)", f"{out['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{out['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{out['total_token_throughput']:.2f}"),
    ]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st)",
              "itl": "Inter-token Latency", "e2e": "End-to-end Latency"}
    print("{:=^60}".format(" Serving Benchmark Result "))
    for label, value in rows:
        print(f"{label:<44}{value!s:>16}")
    for key, title in titles.items():
        print("{:-^60}".format(f" {title} "))
        print(f"{'Mean ' + key.upper() + ' (ms)':<44}{out[f'mean_{key}_ms']:>16.2f}")
        for q in qs:
            label = f"P{q:g} {key.upper()} (ms)"
            print(f"{label:<44}{out[f'p{q:g}_{key}_ms']:>16.2f}")
    print("=" * 60)
    for error in out["errors"]:
        print(f"error: {error}", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = asyncio.run(benchmark(args))
    print_table(out, [float(q) for q in args.percentiles.split(",")])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if out["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
