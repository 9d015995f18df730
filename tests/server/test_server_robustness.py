"""A real `jaxserve serve` process under abuse: disconnects, load, SIGTERM, overload, metrics.

Every request goes to 127.0.0.1 and every loop is bounded in count and in time. The
disconnect, load and metrics tests use the server shared by the HTTP test modules (they
compare metric deltas, never absolute values); the SIGTERM and overload tests start servers
of their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pathlib
import random
import re
import signal
import subprocess
import time

import httpx
import openai
import pytest
from support.server_helpers import running_server
from support.streams import MODEL, Stream, aclient, request, run_async, stream

# Room for requests that outlive a SIGTERM: the shared server keeps SMALL_ENGINE's 512.
LONG_CONTEXT = ("--max-model-len", "2048")
WORDS = ("def class return import self value list dict for while yield print data file "
         "name index count result error open close read write start stop").split()
ENVELOPE_KEYS = {"message", "type", "param", "code"}


# ---- helpers ------------------------------------------------------------------------------
def metrics(url: str) -> dict[str, float]:
    """GET /metrics as {series name: value summed over its labels}."""
    text = httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def is_idle(values: dict[str, float], kv_before: float) -> bool:
    return (values["vllm:num_requests_running"] == 0
            and values["vllm:num_requests_waiting"] == 0
            and values["vllm:kv_cache_usage_perc"] == pytest.approx(kv_before, abs=1e-9))


def wait_idle(url: str, kv_before: float, timeout: float) -> tuple[bool, dict, float]:
    """Poll /metrics until idle (or the timeout): (idle?, last values, seconds waited)."""
    start = time.monotonic()
    while True:
        values = metrics(url)
        waited = time.monotonic() - start
        if is_idle(values, kv_before) or waited > timeout:
            return is_idle(values, kv_before), values, waited
        time.sleep(0.05)


def baseline(url: str) -> dict[str, float]:
    """Metrics once no request runs or waits (earlier tests may still be winding down)."""
    deadline = time.monotonic() + 10
    while True:
        values = metrics(url)
        idle = values["vllm:num_requests_running"] == 0 == values["vllm:num_requests_waiting"]
        if idle or time.monotonic() > deadline:
            assert idle, values
            return values
        time.sleep(0.05)


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def assert_envelope(body, status: int) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert set(body["error"]) == ENVELOPE_KEYS, body
    assert body["error"]["code"] and body["error"]["message"], body
    assert "Traceback" not in json.dumps(body)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0,
                         http_client=httpx.Client(timeout=30, trust_env=False))


def normal_request_works(server) -> None:
    out = client(server).completions.create(model=MODEL, prompt="def f(x):", max_tokens=4,
                                            extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 4


@pytest.fixture(scope="module")
def server(api_server):
    return api_server  # conftest: one server for the HTTP test modules


# ---- disconnects --------------------------------------------------------------------------
def test_streams_cut_after_first_chunk_are_aborted(server):
    before = baseline(server.url)
    num, max_tokens = 20, 400

    async def one(i):
        rng = random.Random(i)
        path, body = request(i % 2 == 0, words(rng, rng.randint(3, 30)), max_tokens,
                             ignore_eos=True)
        async with aclient() as own:  # closed on exit: a real cut
            return await stream(own, server.api, path, body, cut_after_first=True)

    async def main():
        return await asyncio.gather(*(one(i) for i in range(num)))

    results = run_async(main(), 60)
    assert all(r.status == 200 and r.events and r.error is None for r in results)
    idle, after, waited = wait_idle(server.url, before["vllm:kv_cache_usage_perc"], 2.0)
    assert idle, f"not idle {waited:.2f} s after the cuts: {after}"
    # Nothing still generates for the departed clients, and they got far less than asked.
    time.sleep(0.3)
    generated = metrics(server.url)["vllm:generation_tokens_total"]
    assert generated == after["vllm:generation_tokens_total"]
    assert generated - before["vllm:generation_tokens_total"] < num * max_tokens / 2
    normal_request_works(server)


def test_non_streaming_client_timeout_aborts(server):
    before = baseline(server.url)
    log_start = len(server.log())
    rng = random.Random(7)
    num, max_tokens = 32, 400  # 4 waves of 8 sequences: seconds of work
    body = {"model": MODEL, "prompt": [words(rng, rng.randint(3, 20)) for _ in range(num)],
            "max_tokens": max_tokens, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.api + "/completions", json=body,
                   timeout=httpx.Timeout(0.7, connect=5.0), trust_env=False)
    idle, after, waited = wait_idle(server.url, before["vllm:kv_cache_usage_perc"], 2.0)
    assert idle, f"not idle {waited:.2f} s after the client left: {after}"
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated < num * max_tokens / 2
    # Each of its 32 engine requests was logged once, and the unfinished ones as aborted.
    finished = re.findall(r"request cmpl-\w+-(\d+): .* finish (\w+)", server.log()[log_start:])
    assert sorted(int(i) for i, _ in finished) == list(range(num)), finished
    assert sum(reason == "abort" for _, reason in finished) >= num // 2, finished
    normal_request_works(server)


# ---- load ---------------------------------------------------------------------------------
async def load(api: str, clients: int, duration: float, seed: int) -> list[tuple[dict, Stream]]:
    """`clients` loops of random streaming requests until `duration` is up."""
    deadline = time.monotonic() + duration

    async def loop(k):
        rng = random.Random(seed * 1000 + k)
        done = []
        async with aclient() as own:
            for _ in range(100_000):  # the deadline ends it long before
                if time.monotonic() >= deadline:
                    break
                max_tokens = rng.randint(1, 160)
                extra = {"ignore_eos": rng.random() < 0.5,
                         "temperature": rng.choice([0.0, 0.7, 1.0]),
                         "stream_options": {"include_usage": True}}
                path, body = request(rng.random() < 0.5, words(rng, rng.randint(1, 60)),
                                     max_tokens, **extra)
                done.append((body, await stream(own, api, path, body)))
        return done

    per_client = await asyncio.gather(*(loop(k) for k in range(clients)))
    return [item for results in per_client for item in results]


def check_load(server, clients: int, duration: float, seed: int) -> None:
    before = baseline(server.url)
    start = time.monotonic()
    results = run_async(load(server.api, clients, duration, seed), duration + 120)
    elapsed = time.monotonic() - start
    statuses = [r.status for _, r in results]
    assert not [s for s in statuses if s >= 500], statuses
    assert len(results) >= 2 * clients, f"only {len(results)} requests in {elapsed:.1f} s"
    for body, result in results:
        reason = result.assert_complete()
        usage = result.usage()
        assert usage and usage["prompt_tokens"] + usage["completion_tokens"] == \
            usage["total_tokens"], usage
        if reason == "length" or body["ignore_eos"]:
            assert reason == "length" and usage["completion_tokens"] == body["max_tokens"]
        else:  # stopped at EOS
            assert usage["completion_tokens"] <= body["max_tokens"], usage
    idle, after, waited = wait_idle(server.url, before["vllm:kv_cache_usage_perc"], 2.0)
    assert idle, f"not idle {waited:.2f} s after the load: {after}"
    grown = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert grown == sum(r.usage()["completion_tokens"] for _, r in results)


def test_load_16_streaming_clients_10s(server):
    check_load(server, clients=16, duration=10.0, seed=1)


@pytest.mark.slow
def test_load_16_streaming_clients_60s(server):
    check_load(server, clients=16, duration=60.0, seed=2)


# ---- metrics and request logs -------------------------------------------------------------
def test_metrics_and_request_log_follow_the_requests(server):
    before = baseline(server.url)
    api = client(server)
    usages, engine_ids = [], []  # engine request ids: one per prompt
    one = api.completions.create(model=MODEL, prompt="def f(x):", max_tokens=7,
                                 extra_body={"ignore_eos": True})
    usages.append(one.usage)
    engine_ids.append(f"{one.id}-0")
    two = api.completions.create(model=MODEL, prompt=["import os", "class A:"], max_tokens=5,
                                 extra_body={"ignore_eos": True})
    usages.append(two.usage)
    engine_ids += [f"{two.id}-0", f"{two.id}-1"]
    chat = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=6, n=2, seed=3, temperature=1.0,
                                       extra_body={"ignore_eos": True})
    usages.append(chat.usage)
    engine_ids.append(f"{chat.id}-0")
    chunks = list(api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=9,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usages.append(chunks[-1].usage)
    engine_ids.append(f"{chunks[0].id}-0")

    after = metrics(server.url)
    delta = {name: after[name] - before.get(name, 0.0) for name in after}
    assert delta["vllm:prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert delta["vllm:generation_tokens_total"] == sum(u.completion_tokens for u in usages)
    assert sum(u.completion_tokens for u in usages) == 7 + 2 * 5 + 2 * 6 + 9
    for name in ("vllm:time_to_first_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_success_total",
                 "vllm:request_queue_time_seconds_count"):
        assert delta[name] == len(engine_ids), name
    assert delta["vllm:inter_token_latency_seconds_count"] > 0
    idle, values, waited = wait_idle(server.url, before["vllm:kv_cache_usage_perc"], 2.0)
    assert idle, values

    deadline = time.monotonic() + 5
    while True:  # the log line is written by the engine thread; give it a moment
        log = server.log()
        counts = {rid: len(re.findall(rf"request {re.escape(rid)}: ", log)) for rid in engine_ids}
        if all(counts.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert all(n == 1 for n in counts.values()), counts
    line = next(ln for ln in log.splitlines() if f"request {engine_ids[0]}: " in ln)
    assert "INFO" in line and "TTFT" in line and "finish length" in line, line
    assert f"prompt {one.usage.prompt_tokens} tokens, output 7 tokens" in line, line


# Every series vLLM 0.33.0's example Grafana dashboard queries
# (examples/observability/prometheus_grafana/grafana.json), by model_name.
DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_sum",
    "vllm:request_time_per_output_token_seconds_count", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_sum"]


def test_every_series_of_vllms_dashboard_is_there_after_one_request(server):
    client(server).completions.create(model=MODEL, prompt="def f(x):", max_tokens=5,
                                      extra_body={"ignore_eos": True})
    text = httpx.get(f"{server.url}/metrics", timeout=5, trust_env=False).text
    labelled = {line.split("{", 1)[0] for line in text.splitlines()
                if 'model_name="tiny"' in line}
    missing = [name for name in DASHBOARD_SERIES if name not in labelled]
    assert not missing, missing
    values = metrics(server.url)
    for name in ("vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count",
                 "vllm:request_max_num_generation_tokens_count",
                 "vllm:request_time_per_output_token_seconds_count"):
        assert values[name] >= 1, name
    # vLLM's buckets: a long request's latency is not cut off at 80 s
    assert 'vllm:e2e_request_latency_seconds_bucket{le="7680.0"' in text
    assert 'vllm:request_prompt_tokens_bucket{le="500.0"' in text  # 1-2-5 up to 512


def test_the_shared_server_log_has_no_error_lines(server):
    errors = [line for line in server.log().splitlines()
              if line.startswith(("ERROR", "CRITICAL")) or "Traceback" in line]
    assert not errors, "\n".join(errors[:20])


# ---- overload -----------------------------------------------------------------------------
def test_overload_answers_429_never_5xx(tiny_checkpoints, tmp_path):
    flood = 16
    with running_server(tiny_checkpoints["llama"], "--max-waiting-requests", "2",
                        "--max-num-seqs", "1", "--precompile", "lazy", wait_for="/health",
                        log_dir=tmp_path) as srv:
        before = baseline(srv.url)

        async def one(own, i):
            path, body = request(i % 3 == 0, words(random.Random(i), 8), 200, ignore_eos=True)
            if i % 2:
                return await stream(own, srv.api, path, body)
            response = await own.post(srv.api + path, json=body)
            return Stream(response.status_code, [response.json()], done=True,
                          error=response.json() if response.status_code != 200 else None)

        async def main():
            limits = httpx.Limits(max_connections=flood + 4)
            async with aclient(limits=limits) as own:
                return await asyncio.gather(*(one(own, i) for i in range(flood)))

        results = run_async(main(), 120)
        statuses = sorted(r.status for r in results)
        assert not [s for s in statuses if s >= 500], statuses
        assert set(statuses) <= {200, 429}, statuses
        assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
        for result in results:
            if result.status == 429:
                assert_envelope(result.error, 429)
                assert result.error["error"]["type"] == "rate_limit_error"
            else:
                assert result.finish_reasons() == {0: ["length"]}, result
                assert result.error is None and result.done
        idle, after, waited = wait_idle(srv.url, before["vllm:kv_cache_usage_perc"], 5.0)
        assert idle, after
        normal_request_works(srv)


# ---- SIGTERM ------------------------------------------------------------------------------
def child_pids(pid: int) -> list[int]:
    try:
        import psutil
    except ImportError:  # walk /proc instead
        parents = {}
        for entry in pathlib.Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
        found, frontier = [], [pid]
        while frontier:
            kids = [p for p, parent in parents.items() if parent in frontier]
            found += kids
            frontier = kids
        return found
    return [child.pid for child in psutil.Process(pid).children(recursive=True)]


def alive(pid: int) -> bool:
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclasses.dataclass
class Shutdown:
    timeout: float
    streams: list[Stream]
    during: httpx.Response  # a request sent while draining
    returncode: int | None  # None: still running after timeout + 20 s (then killed)
    exit_after: float  # seconds from SIGTERM to exit
    children: list[int]
    children_left: list[int]
    log: str


def sigterm_while_streaming(model, log_dir, timeout: float, max_tokens: int) -> Shutdown:
    """4 streams run; SIGTERM; a new request while draining; wait for the exit."""
    with running_server(model, *LONG_CONTEXT, "--shutdown-timeout", str(timeout),
                        "--precompile", "lazy", wait_for="/health", log_dir=log_dir) as srv:

        async def main():
            async with aclient() as own:
                # The same four requests, two tokens each, first: with cold caches the server
                # compiles their buckets now (--precompile lazy), slowly on a loaded machine,
                # and not while the streams below are timed.
                await asyncio.gather(*(own.post(srv.api + path, json=body, timeout=900)
                                       for path, body in (request(
                                           i % 2 == 1, f"request {i} says", 2, ignore_eos=True)
                                           for i in range(4))))
                firsts = [asyncio.Event() for _ in range(4)]
                tasks = [asyncio.create_task(stream(own, srv.api, *request(
                    i % 2 == 1, f"request {i} says", max_tokens, ignore_eos=True,
                    stream_options={"include_usage": True}), first_chunk=firsts[i]))
                    for i in range(4)]
                # Until every stream has its first token (prefix-cache hits: the prompts ran).
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 240)
                children = child_pids(srv.process.pid)
                srv.process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                for _ in range(100):  # /ready turns 503 once draining has begun
                    if (await own.get(srv.url + "/ready")).status_code == 503:
                        break
                    await asyncio.sleep(0.02)
                during = await own.post(srv.api + "/completions", json={
                    "model": MODEL, "prompt": "late", "max_tokens": 4})
                streams = await asyncio.wait_for(asyncio.gather(*tasks), timeout + 30)
                return signalled, during, streams, children

        try:
            signalled, during, streams, children = run_async(main(), timeout + 1200)
        except TimeoutError as err:
            raise AssertionError("timed out; the server's log ends:\n" +
                                 srv.log()[-3000:]) from err
        try:
            returncode = srv.process.wait(timeout + 20)
        except subprocess.TimeoutExpired:
            returncode = None
        exit_after = time.monotonic() - signalled
        time.sleep(0.2)
        left = [pid for pid in children if alive(pid)]
        log = srv.log()
    return Shutdown(timeout, streams, during, returncode, exit_after, children, left, log)


@pytest.fixture(scope="module")
def drained(tiny_checkpoints, tmp_path_factory):
    """--shutdown-timeout 30 and requests of ~1200 tokens (a few seconds): they finish."""
    return sigterm_while_streaming(tiny_checkpoints["llama"], tmp_path_factory.mktemp("drain"),
                                   30.0, 1200)


@pytest.fixture(scope="module")
def cut_short(tiny_checkpoints, tmp_path_factory):
    """--shutdown-timeout 1 and requests that need several seconds: they are aborted."""
    return sigterm_while_streaming(tiny_checkpoints["llama"], tmp_path_factory.mktemp("cut"),
                                   1.0, 2000)


def check_draining_answer(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert_envelope(response.json(), 503)
    assert response.json()["error"]["type"] == "service_unavailable"


def test_sigterm_lets_in_flight_requests_finish(drained):
    check_draining_answer(drained.during)
    for result in drained.streams:
        assert result.assert_complete(("length",)) == "length"
        assert result.usage()["completion_tokens"] == 1200
    assert drained.returncode is not None, drained.log[-3000:]
    assert drained.exit_after < drained.timeout, drained.exit_after
    assert "Traceback" not in drained.log


def test_sigterm_past_the_timeout_aborts_in_flight_requests(cut_short):
    check_draining_answer(cut_short.during)
    for result in cut_short.streams:
        result.assert_complete(("abort",))
        assert 0 < result.usage()["completion_tokens"] < 2000
    assert cut_short.returncode is not None, cut_short.log[-3000:]
    # 1 s of draining, then up to 2 s for the aborted streams to flush, then uvicorn stops.
    assert cut_short.exit_after < cut_short.timeout + 8, cut_short.exit_after
    assert "Traceback" not in cut_short.log


@pytest.mark.parametrize("case", ["drained", "cut_short"])
def test_sigterm_leaves_no_child_process(case, request):
    shutdown = request.getfixturevalue(case)
    assert shutdown.returncode is not None
    assert shutdown.children_left == [], (shutdown.children, shutdown.children_left)


@pytest.mark.parametrize("case", ["drained", "cut_short"])
def test_sigterm_exits_zero(case, request):
    shutdown = request.getfixturevalue(case)
    assert shutdown.returncode == 0, (shutdown.returncode, shutdown.log[-2000:])

