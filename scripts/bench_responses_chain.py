"""A long /v1/responses conversation: chained turns of a few megabytes each, and what they
cost the server in memory and time.

    python scripts/bench_responses_chain.py [--model DIR] [--turns 20] [--turn-mb 3]
        [--truncation auto] [--max-model-len 2048] [--json OUT] [-- SERVE ARGS...]

Starts `jaxserve serve` (the installed command beside this Python; the built-in model
unless --model) on a free loopback port, waits for /ready (every bucket compiled), then
sends --turns requests, each continuing the
previous one (previous_response_id, store=true) with a new input of --turn-mb megabytes of
text (different words each turn, so no turn is a cached prefix of another) and
max_output_tokens 8, greedy. After each turn it reads the server's resident memory (its
process and any children, from /proc) and the turn's wall time. It reports the memory
before the first turn and after each, the largest growth over the start, each turn's
seconds, and the ratio of the median of the last five turns' seconds to the median of the
first five (1.0: flat), all measured in this one run. Exit status 1 when a turn fails.
Issue 54's bound: growth within 400 MB over 20 turns of 3 MB with truncation "auto", and
flat latency. Arguments after `--` go to `jaxserve serve` as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    """Resident memory of pid and its descendants, MiB (Linux /proc)."""
    total, stack, seen = 0, [pid], set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                stack += [int(c) for c in children]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1024


def turn_text(turn: int, megabytes: float) -> str:
    words, size, i = [], 0, 0
    target = int(megabytes * 1_000_000)
    while size < target:
        word = f"t{turn}w{i} "
        words.append(word)
        size += len(word)
        i += 1
    return "".join(words)


def start_server(args, port: int, log_path: Path) -> subprocess.Popen:
    executable = Path(sys.executable).with_name("jaxserve")
    cmd = [str(executable), "serve", *([args.model] if args.model else []), "--port", str(port),
           "--max-model-len", str(args.max_model_len), "--max-body-bytes",
           str(int(args.turn_mb * 1_000_000) + 2**20), *args.serve_args]
    log(f"starting: {' '.join(cmd)} (log: {log_path})")
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def wait_ready(client: httpx.Client, proc: subprocess.Popen, timeout: float) -> None:
    """Until /ready answers 200: every bucket compiled, so the background warm-up's memory
    is in the starting RSS, not in the turns'."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if client.get("/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no /ready 200 within {timeout:g} s")


def run(args) -> dict:
    port = free_port()
    log_path = Path(tempfile.mkdtemp(prefix="bench-responses-")) / "server.log"
    proc = start_server(args, port, log_path)
    report = {"turns": args.turns, "turn_mb": args.turn_mb, "truncation": args.truncation,
              "max_model_len": args.max_model_len, "model": args.model or "built-in",
              "ok": False, "seconds": [], "rss_mib": [], "input_tokens": []}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            wait_ready(client, proc, args.timeout)
            # One short request first, so compiling the buckets is not in the first turn.
            client.post("/v1/responses", json={"input": "hello", "max_output_tokens": 8,
                                               "store": False})
            report["rss_start_mib"] = rss_mib(proc.pid)
            previous = None
            for turn in range(args.turns):
                body = {"input": turn_text(turn, args.turn_mb), "max_output_tokens": 8,
                        "temperature": 0, "truncation": args.truncation}
                if previous is not None:
                    body["previous_response_id"] = previous
                started = time.perf_counter()
                response = client.post("/v1/responses", json=body)
                seconds = time.perf_counter() - started
                if response.status_code != 200:
                    report["error"] = f"turn {turn}: {response.status_code} {response.text[:300]}"
                    log(report["error"])
                    return report
                answer = response.json()
                previous = answer["id"]
                rss = rss_mib(proc.pid)
                report["seconds"].append(seconds)
                report["rss_mib"].append(rss)
                report["input_tokens"].append(answer["usage"]["input_tokens"])
                log(f"turn {turn + 1:2d}: {seconds:6.2f} s, {answer['usage']['input_tokens']} "
                    f"input tokens, server RSS {rss:7.1f} MiB "
                    f"({rss - report['rss_start_mib']:+.1f})")
        seconds = report["seconds"]
        head, tail = seconds[:5], seconds[-5:]
        report["rss_growth_max_mib"] = max(report["rss_mib"]) - report["rss_start_mib"]
        report["latency_last5_over_first5"] = statistics.median(tail) / statistics.median(head)
        report["ok"] = True
        return report
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: built-in)")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--turn-mb", type=float, default=3.0)
    parser.add_argument("--truncation", choices=["auto", "disabled"], default="auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for the server's /ready")
    parser.add_argument("--json", default=None, help="write the report here too")
    parser.add_argument("serve_args", nargs="*", help="after --: more `jaxserve serve` flags")
    args = parser.parse_args(argv)
    report = run(args)
    if report["ok"]:
        log(f"RSS growth at most {report['rss_growth_max_mib']:.1f} MiB over "
            f"{args.turns} turns of {args.turn_mb:g} MB; last-5 / first-5 median latency "
            f"{report['latency_last5_over_first5']:.2f}")
    print(json.dumps(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
