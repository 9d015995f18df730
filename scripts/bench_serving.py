"""Benchmark a running OpenAI-compatible server on this machine, like `vllm bench serve`.

    python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --max-concurrency 16 \
        --num-prompts 200 --input-len 128 --output-len 128 [--request-rate 8] [--json out.json]
    python scripts/bench_serving.py --sweep 2 4 8 16 --num-prompts 100 --output-len 64 \
        [--plot sweep.png] [--json sweep.json]
    python scripts/bench_serving.py --launch-model [DIR] [--server-args "--max-num-seqs 64"] ...

Random prompts of --input-len tokens (token ids for completions, words for chat) are streamed
with ignore_eos, so every answer has --output-len tokens. Requests start at Poisson arrival
times (--request-rate, default: all at once), at most --max-concurrency at a time, until
--num-prompts have been sent or --duration seconds have passed. Measures time to first token
(TTFT), time per output token after the first (TPOT), inter-token latency (ITL, the gap
between streamed chunks) and end-to-end latency (E2E), with request and token throughput.

--sweep RATE [RATE ...] (or a comma list; "inf" for all at once) runs the benchmark once per
request rate against the same server, prints one summary line per rate and writes a PNG
(--plot, needs matplotlib) of latency against output token throughput, one point per rate.
--launch-model starts `jaxserve serve` (on DIR, or the built-in model without DIR) on a free
loopback port, waits for /health, and stops it at the end.
Only loopback addresses are accepted: this is a local load generator, not a remote one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import ipaddress
import json
import math
import random
import shlex
import socket
import sys
import tempfile
import time
from urllib.parse import urlsplit

import httpx

from jaxserve.benchmarks.local_server import (
    PYTHON_CLI,
    free_port,
    serve_command,
    start_server,
    stop_server,
    wait_healthy,
)
from jaxserve.benchmarks.serving_report import (
    MATPLOTLIB_MISSING,
    plot_sweep,
    print_table,
    rate_label,
    summarize,
    sweep_header,
    sweep_line,
)

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
def build_parser() -> argparse.ArgumentParser:
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
    p.add_argument("--sweep", nargs="+", metavar="RATE", default=None,
                   help="run once per request rate (replaces --request-rate), e.g. 2 4 8 or "
                   "2,4,8,inf; prints one line per rate and writes --plot")
    p.add_argument("--plot", metavar="OUT.png", default="bench_serving_sweep.png",
                   help="with --sweep: latency-vs-throughput PNG (default %(default)s)")
    p.add_argument("--launch-model", nargs="?", const="", default=None, metavar="DIR",
                   help="start `jaxserve serve [--model DIR]` on a free loopback port for the "
                   "run (no DIR: the built-in model); --base-url is then ignored")
    p.add_argument("--server-args", default="",
                   help="with --launch-model: extra `jaxserve serve` flags, one string")
    p.add_argument("--launch-timeout", type=float, default=900.0,
                   help="with --launch-model: seconds to wait for /health")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        check_args(args)
    except ValueError as err:
        p.error(str(err))
    args.base_url = args.base_url.rstrip("/")
    if args.base_url.endswith("/v1"):
        args.base_url = args.base_url[:-3]
    return args


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError on a bad combination; parse --sweep into floats."""
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (inf for all at once)")
    if not 0 <= args.range_ratio < 1:
        raise ValueError("--range-ratio must be in [0, 1)")
    if not args.duration > 0 or not args.timeout > 0:
        raise ValueError("--duration and --timeout must be > 0")
    if not all(0 <= float(q) <= 100 for q in args.percentiles.split(",")):
        raise ValueError("--percentiles must be in [0, 100]")
    if args.sweep is not None:
        args.sweep = parse_rates(args.sweep)
        if importlib.util.find_spec("matplotlib") is None:
            raise ValueError(MATPLOTLIB_MISSING)
    check_loopback(args.base_url)


def parse_rates(values: list[str]) -> list[float]:
    """'2 4,8 inf' -> [2.0, 4.0, 8.0, inf]."""
    try:
        rates = [float(v) for value in values for v in value.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep takes numbers (or inf), got {' '.join(values)!r}") from None
    if not rates or not all(rate > 0 for rate in rates):
        raise ValueError("--sweep needs request rates > 0 (inf for all at once)")
    return rates


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


# ---- sweep over request rates -----------------------------------------------------------
def run_sweep(args) -> list[dict]:
    """One benchmark per rate in args.sweep, each printed as one line as it finishes."""
    top = max(float(q) for q in args.percentiles.split(","))
    print(sweep_header(top), flush=True)
    results = []
    for rate in args.sweep:
        out = asyncio.run(benchmark(argparse.Namespace(**{**vars(args), "request_rate": rate})))
        print(sweep_line(out, top), flush=True)
        results.append(out)
    return results


# ---- optional local server ----------------------------------------------------------------
@contextlib.contextmanager
def launched_server(args):
    """With --launch-model: run `jaxserve serve` on a free loopback port for the block (and
    point args.base_url at it); without it, do nothing."""
    if args.launch_model is None:
        yield
        return
    port = free_port()
    cmd = serve_command(PYTHON_CLI, port, args.launch_model, shlex.split(args.server_args))
    with tempfile.NamedTemporaryFile(prefix="jaxserve-bench-", suffix=".log",
                                     delete=False) as log:
        print(f"starting: jaxserve {shlex.join(cmd[len(PYTHON_CLI):])} (log: {log.name})",
              file=sys.stderr)
        proc = start_server(cmd, log)
        args.base_url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(proc, args.base_url, args.launch_timeout, log.name)
            yield
        finally:
            stop_server(proc)


# ---- entry point --------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    qs = [float(q) for q in args.percentiles.split(",")]
    with launched_server(args):
        if args.sweep:
            results = run_sweep(args)
        else:
            results = [asyncio.run(benchmark(args))]
            print_table(results[0], qs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sweep": results} if args.sweep else results[0], f, indent=2)
    if args.sweep:
        plot_sweep(results, args.plot, qs)
        print(f"wrote {args.plot}")
        for out in results:
            for error in out["errors"]:
                print(f"error at rate {rate_label(out)}: {error}", file=sys.stderr)
    return 0 if all(out["failed"] == 0 for out in results) else 1


if __name__ == "__main__":
    sys.exit(main())
